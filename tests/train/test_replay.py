"""data.replay_shard_dirs / data.replay_fraction: a share of generic data drawn into training,
its held-out side kept out by conversation (train/datasets.py, train/sources.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3.errors import ConfigError
from train.config import load_config
from train.datasets import replay_tokens, take_replay
from train.sources import add_replay


class Part:
    """What the replay code reads of a dataset: ids, lengths and subset()."""

    def __init__(self, ids: list[str], lengths: list[int]):
        self.ids, self.lengths = ids, lengths

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, keep: list[int]) -> Part:
        return Part([self.ids[i] for i in keep], [self.lengths[i] for i in keep])


def generic(n: int = 200) -> list[Part]:
    return [Part([f"g{i}" for i in range(0, n, 2)], [10 + i % 7 for i in range(0, n, 2)]),
            Part([f"g{i}" for i in range(1, n, 2)], [10 + i % 7 for i in range(1, n, 2)])]  # fmt: skip


def tokens(parts: list[Part]) -> int:
    return sum(sum(p.lengths) for p in parts)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5])
def test_replay_draws_the_stated_share_of_tokens_nested(fraction):
    """~0 s: replay tokens / (own + replay) is the stated fraction up to one record (the last
    one is taken whole), and a larger share keeps every record of a smaller one."""
    own = 1000
    taken = take_replay(generic(), replay_tokens(own, fraction), seed=0)
    got = tokens(taken)
    assert got / (own + got) >= fraction
    assert got - replay_tokens(own, fraction) < 16  # under one record (lengths 10-16)
    smaller = take_replay(generic(), replay_tokens(own, fraction / 2), seed=0)
    assert {i for p in smaller for i in p.ids} <= {i for p in taken for i in p.ids}


def test_replay_short_of_tokens_is_one_line():
    """~0 s: asking for more replay tokens than the dirs hold names the key to lower."""
    with pytest.raises(ConfigError, match="lower data.replay_fraction"):
        take_replay(generic(10), 10_000, seed=0)


def test_replay_held_out_side_is_validated_never_trained():
    """~0 s: the replay dirs are split by conversation like the training ones: every window of
    a held-out conversation is in the "replay" validation set, none in training."""
    parts = [Part(["o1", "o2"], [100, 100])]
    windows = [Part([f"g{i}" if i % 3 else f"g{i - 1}#w1" for i in range(1, 300)], [12] * 299)]
    cfg = SimpleNamespace(
        data=SimpleNamespace(
            val_fraction=0.2, val_seed=0, replay_fraction=0.25, replay_shard_dirs=["gen"]
        )
    )
    provenance: dict = {}
    trained, sets = add_replay(cfg, parts, windows, {}, provenance)
    held = {i.split("#")[0] for p in sets["replay"] for i in p.ids}
    replayed = {i.split("#")[0] for p in trained[1:] for i in p.ids}
    assert held and replayed and not held & replayed
    assert provenance["replay"]["fraction"] == pytest.approx(0.25, abs=12 / 200)


def test_config_checks_replay_and_named_sets():
    """~0.1 s: the share and the dirs go together, offline only; named sets need a free name,
    their data, and data no training dir holds."""
    base = ["data.shard_dirs=[own]"]
    for overrides, message in [
        (["data.replay_fraction=0.2"], "go together"),
        (["data.replay_shard_dirs=[gen]"], "go together"),
        (["data.replay_shard_dirs=[gen]", "data.replay_fraction=1"], "must be in [0, 1)"),
        (["data.val_sets=[{name: heldout, shard_dirs: [v]}]"], "its own name"),
        (["data.val_sets=[{name: generic}]"], "list its shard_dirs"),
        (["data.val_sets=[{name: g, shard_dirs: [own]}]"], "own is also trained on"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
            load_config(None, base + overrides, check_paths=False)
    cfg = load_config(
        None,
        base
        + [
            "data.replay_shard_dirs=[gen]",
            "data.replay_fraction=0.2",
            "data.val_sets=[{name: generic, shard_dirs: [gv]}]",
        ],  # fmt: skip
        check_paths=False,
    )
    assert cfg.data.val_sets[0].name == "generic" and cfg.data.replay_fraction == 0.2
