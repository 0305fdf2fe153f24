"""experiments/bench_fp8_training.py's τ table, read from an eagle3.evaluate JSON (no engine), and
its command with bench_rope_positions.py's, as results/README.md prints them, at their smallest."""

from __future__ import annotations

import json
import re

import pytest
from bench_fp8_training import tau_table

from tests.experiments.commands import run_experiment


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
def test_the_documented_commands_share_one_capture_and_print_their_tables(tmp_path):
    """~100 s (the embedded target: one capture of 6 short ShareGPT conversations, three
    1-step trainings of its 49k-vocab drafter, each a process): `bench_fp8_training.py --work W
    --dtypes bf16,fp8-aux` as results/README.md prints it, at its smallest, then
    `bench_rope_positions.py --work W` over the same W. The first captures both modes once and
    prints each mode's acc_k row and the 0.5-point verdict; the second reuses its records, its
    bf16 capture and its bf16 drafter (the "new" RoPE), trains only the old-RoPE drafter and
    scores one held-out text, its chunked unroll equal to ttt_forward. (vLLM's τ, --evaluate, is
    the engine tests' and takes minutes.)"""
    small = ["--work", str(tmp_path), "--conversations", "6", "--min-tokens", "32",
             "--max-length", "256", "--steps", "1", "--warmup", "1", "--serial"]  # fmt: skip
    fp8 = run_experiment("bench_fp8_training.py", *small, "--dtypes", "bf16,fp8-aux").stdout
    assert fp8.count("captured ") == 2 and "training bf16" in fp8 and "training fp8-aux" in fp8
    for row in ("bf16 all", "bf16 in-vocab", "fp8-aux all", "fp8-aux - bf16"):
        assert re.search(rf"^{re.escape(row)} +[-+0-9.]+", fp8, re.M), (row, fp8)
    assert re.search(r"^fp8-aux: \|acc_0 difference\| = [0-9.]+ pp: (NOT )?under", fp8, re.M)

    rope = run_experiment(
        "bench_rope_positions.py", *small, "--docs", "1", "--doc-tokens", "512", "--skip", "10"
    ).stdout
    assert "captured " not in rope and "training new" not in rope and "training old" in rope
    assert "rope_theta 100000.0" in rope and "rope_theta 10000.0" in rope
    agree = re.search(r"argmax agreement: ([0-9.]+)%", rope)
    assert agree and float(agree.group(1)) == 100.0, rope
    first = re.search(r"^ +0-1024 +([0-9.]+) +([0-9.]+) +([0-9]+) +1 ", rope, re.M)
    assert (
        first
        and int(first.group(3)) > 0
        and all(1.0 <= float(first.group(i)) <= 5.0 for i in (1, 2))
    ), rope
