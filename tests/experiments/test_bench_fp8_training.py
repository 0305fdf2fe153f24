"""experiments/bench_fp8_training.py's τ table, read from an eagle3.evaluate JSON (no engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from bench_fp8_training import tau_table


def row(drafter: str, bench: str, tau: float, ci: tuple[float, float]) -> dict:
    bucket = {"label": "0+", "tau": tau, "tau_ci95": list(ci), "prompts": 20, "steps": 300}
    return {"drafter": drafter, "bench": bench, "by_context": [bucket]}


def test_tau_table_reads_each_modes_vllm_row_and_says_whether_intervals_overlap(tmp_path):
    """~0.01 s. Each mode's vLLM row of ENGINE_BATCH in flight (not another pass's row, not "fp8"
    for "fp8-aux"), its one bucket's τ and interval, and the overlap verdict against bf16."""
    results = [
        row("bf16/final [vllm x8]", "mt_bench", 1.30, (1.20, 1.40)),
        row("bf16/final [vllm]", "mt_bench", 9.0, (9.0, 9.0)),
        row("fp8-aux/final [vllm x8]", "mt_bench", 1.28, (1.18, 1.38)),
        row("fp8/final [vllm x8]", "mt_bench", 1.60, (1.50, 1.70)),
    ]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": results}))
    assert tau_table(path, ["bf16", "fp8-aux", "fp8"]) == (
        "mt_bench: bf16 1.300 [1.200, 1.400] (20 prompts); "
        "fp8-aux 1.280 [1.180, 1.380] (20 prompts), overlaps bf16; "
        "fp8 1.600 [1.500, 1.700] (20 prompts), DOES NOT overlap"
    )


@pytest.mark.slow
def test_prepare_captures_every_mode_once_and_reuses_it(tmp_path, monkeypatch, one_thread):
    """~5 s (the embedded target's load; ShareGPT read until 4 short conversations): the
    stage before training that the docstring's command (and bench_rope_positions.py's) runs,
    at 4 conversations of at most 128 tokens: records split once, one capture into each
    mode's shards, all complete; a rerun reads them back without loading the target.
    (Training two drafters and vLLM's tau take minutes.)"""
    import bench_fp8_training
    from bench_fp8_training import prepare

    from eagle3.data.shards import ShardDataset, read_meta

    args = SimpleNamespace(conversations=4, min_tokens=16, max_length=128, val_fraction=0.25,
                           seed=0)  # fmt: skip
    dirs = prepare(tmp_path, args, ("bf16", "fp8-aux"))
    assert set(dirs) == {f"{m}/{p}" for m in ("bf16", "fp8-aux") for p in ("train", "val")}
    assert all(read_meta(d)["complete"] for d in dirs.values())
    assert (len(ShardDataset(dirs["bf16/train"])), len(ShardDataset(dirs["bf16/val"]))) == (3, 1)
    assert len(ShardDataset(dirs["fp8-aux/train"])) == 3

    def no_target(*args, **kwargs):
        raise AssertionError("prepare loaded the target again")

    monkeypatch.setattr(bench_fp8_training, "load_target", no_target)
    assert prepare(tmp_path, args, ("bf16", "fp8-aux")) == dirs
