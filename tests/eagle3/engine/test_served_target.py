"""eagle3.engine.served_target without an engine: what describe_served_target reads from the
embedded target's files, configured at construction (no caller sets its fields). The served
target against a real vLLM server: tests/datagen/test_capture_engine.py,
tests/train/test_online_engine.py."""

from __future__ import annotations

import pytest

from eagle3.engine.served_target import describe_served_target
from eagle3.errors import Eagle3Error


def test_described_from_its_files_and_configured_at_construction(embedded_target_dir):
    served = describe_served_target("smollm2-135m-q4", concurrency=3)
    assert served.served is True and served.server is None
    assert (served.name, served.num_layers, served.hidden_size) == ("smollm2-135m-q4", 30, 576)
    assert served.aux_layer_ids == [1, 14, 26] and served.concurrency == 3
    assert served.startup_timeout == 900  # no registry figure: the default
    assert served.engine_layer_ids() == [2, 15, 27, 30]  # vLLM's ids, then the last layer
    assert served.pool()._max_workers == 3
    served.stop()  # nothing started: drops the request threads only
    context = served.context
    served.check_length(context - 1, "data.max_length")  # and the one token generated
    with pytest.raises(Eagle3Error, match=f"use data.max_length {context - 1} or less") as err:
        served.check_length(context, "data.max_length")
    assert "\n" not in str(err.value)
    with pytest.raises(Eagle3Error, match="not started"):
        served.hidden_states([1, 2, 3])
