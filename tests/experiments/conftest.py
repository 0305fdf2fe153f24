"""The files in experiments/ run as scripts (`python experiments/recipe_search.py`): a script's
own directory is on its sys.path, so they import each other by bare name. The tests import
them the same way.

The experiments that train (through train_arms.train_arm) run as the commands docs print, at
their smallest size (tests/experiments/commands.py): on shards of random token sequences
captured through the tiny random chat target (tests/conftest.py's chat_target_dir: a tokenizer
and chat template beside it, so the drafters trained can be evaluated against it too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, chat_target_dir) -> dict[str, Path]:
    """Shards of the tiny chat target (~1 s): "a" and "b" (8 sequences each: two training
    sources) and "val" (4: a fixed held-out set)."""
    from eagle3.targets import load_target
    from tests.experiments.commands import capture

    target = load_target(chat_target_dir, device="cpu")
    root = tmp_path_factory.mktemp("experiment_shards")
    sizes = {"a": 8, "b": 8, "val": 4}
    return {
        name: capture(target, root / name, n, seed) for seed, (name, n) in enumerate(sizes.items())
    }
