"""train/selection.py: best/ across several validation sets, by the mean simulated tau."""

from __future__ import annotations

import pytest

from train.selection import selection_tau


@pytest.mark.parametrize(
    "taus, expected",
    [
        ({"heldout": 2.3}, 2.3),  # one set: its tau, as before several sets existed
        ({"heldout": 2.4, "generic": 2.0}, 2.2),  # mean, each set alike (not by tokens)
        ({"heldout": 2.5, "generic": 1.9}, 2.2),  # an equal gain and loss cancel
        ({"heldout": 2.0, "generic": 2.0, "replay": 2.6}, 2.2),
    ],
)
def test_mean_of_the_sets(taus, expected):
    """~0 s: the rule as a table."""
    assert selection_tau(taus) == pytest.approx(expected)


def test_a_change_counts_alike_on_every_set_whatever_its_level():
    """~0 s: sets sit at different levels of tau; +0.3 on one beats +0.05 on another at the
    cost of nothing, where the min would follow the lowest set alone."""
    start = {"code": 3.0, "chat": 2.0}
    gained_on_code, gained_on_chat = {"code": 3.3, "chat": 2.0}, {"code": 3.0, "chat": 2.05}
    assert selection_tau(gained_on_code) > selection_tau(gained_on_chat) > selection_tau(start)
    assert min(gained_on_chat.values()) > min(gained_on_code.values())  # the min's choice
    with pytest.raises(ValueError):
        selection_tau({})
