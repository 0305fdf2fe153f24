"""benchmarks/preflight_all_to_all.py: the long recipe's all-to-all, sized from the recipe and
timed under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from preflight_all_to_all import Exchange, main, recipe_exchange

from eagle3.engine.server import free_port

REPO = Path(__file__).resolve().parents[2]
LONG = str(REPO / "configs/train/kimi-k2.5-offline-long.yaml")


def test_the_exchange_is_the_recipes_kimi_mla_heads_at_its_length():
    """~1 s: the long recipe's draft moves 64 heads of 192 (q, k) and 128 (v, output) for
    the row's share of a rank; at its 32,768 positions a rank and sp 2 that is 1.34 GB in bf16
    a TTT step, ~28 GB a 7-step micro-batch: forward, the recomputed forward and backward (the
    figure the runbook quotes; 19 GB without recompute)."""
    ex, ttt_steps, passes = recipe_exchange(LONG, [], None)
    assert (ex.heads, ex.qk_dim, ex.v_dim, ex.sp, ex.local_tokens) == (64, 192, 128, 2, 32768)
    assert ex.wire_bytes(2) == 64 * 32768 * (192 + 192 + 128 + 128) * 2 / 2
    assert (ttt_steps, passes) == (7, 3)
    assert 28.0e9 < passes * ttt_steps * ex.wire_bytes(2) < 28.5e9
    _, _, passes = recipe_exchange(LONG, ["train.recompute_ttt_steps=false"], None)
    assert passes == 2
    default, *_ = recipe_exchange(LONG, ["train.sequence_parallel=4"], None)
    assert default.local_tokens * 4 >= 65536  # the row over the group, rounded up


def test_a_recipe_without_sequence_parallelism_is_refused_in_one_line(capsys):
    """~1 s: nothing to check is one line, exit 2, before any process group."""
    assert main(["--config", LONG, "train.sequence_parallel=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sequence_parallel is 1" in err[0]


def test_two_gloo_ranks_exchange_and_report_the_slowest(tmp_path):
    """~10 s (two processes import torch): torchrun with 2 ranks in one group of 2 exchanges
    the buffers and writes the numbers; the projection is forward, the recomputed forward and
    backward of every TTT step of the slowest rank's median."""
    out = tmp_path / "a2a.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(REPO / "benchmarks/preflight_all_to_all.py"),
           "--config", LONG, "train.sequence_parallel=2", "--local-tokens", "64",
           "--repeats", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    ex = Exchange(64, 192, 128, 64, 2)
    assert result["step_wire_bytes"] == ex.wire_bytes(4)  # fp32 on gloo
    assert result["step_seconds"] > 0
    assert result["micro_batch_seconds"] == pytest.approx(3 * 7 * result["step_seconds"])
    assert "one micro-batch (7 TTT steps, forward, recomputed forward, backward)" in proc.stdout
