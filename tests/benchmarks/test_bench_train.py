"""benchmarks/bench_train.py builds the draft with the recipe's own builder (train/draft.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_train import recipe_draft_config

from eagle3.draft_shapes import target_shape
from train.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_timing_the_kimi_recipe_times_its_mla_draft():
    """<1 s: the Kimi recipe's draft as bench_train builds it is the recipe's MLA draft, and
    model.draft.attention=gqa gives the GQA one (no copy of the config code to drift)."""
    hf = target_shape("kimi-k2.5")  # the registry's plan_shape: no download
    path = REPO / "configs/train/kimi-k2.5-offline.yaml"
    mla = recipe_draft_config(
        load_config(path, check_paths=False), {"hf_config": hf}, 32000, [1, 2, 3]
    )
    assert (mla.attention, mla.q_lora_rank, mla.kv_lora_rank, mla.head_dim) == (
        "mla",
        1536,
        512,
        192,
    )
    gqa_cfg = load_config(path, ["model.draft.attention=gqa"], check_paths=False)
    gqa = recipe_draft_config(gqa_cfg, {"hf_config": hf}, 32000, [1, 2, 3])
    assert (gqa.attention, gqa.num_attention_heads, gqa.num_key_value_heads) == ("gqa", 56, 8)


def test_recompute_flag_prints_the_ratio_and_both_peaks():
    """~8 s (mostly imports): `bench_train.py --recompute` on a tiny GQA draft runs both modes
    alternating in one run and prints the step-time ratio and each mode's peak (at this size
    the peaks are allocator noise: their values are measured at the Kimi layout, not here)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_train.py"),
         "--config", str(REPO / "configs/train/smollm2-q4-cpu.yaml"), "--recompute",
         "--seq-len", "128", "--steps", "1", "--device", "cpu",
         "--target-shape", "hidden=64,vocab=512,heads=4,kv_heads=2,head_dim=16,intermediate=128",
         "model.draft_vocab_size=256", "model.ttt_steps=5"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "x the plain step's time" in proc.stdout
    peaks = next(line for line in proc.stdout.splitlines() if line.startswith("peak above"))
    assert len(re.findall(r"[\d.]+ GiB", peaks)) == 2, peaks


def test_a_registry_target_runs_without_a_target_shape():
    """~7 s (mostly imports and the matmul peak): the command as docs/benchmarks.md prints it,
    a registry target and no --target-shape, at its smallest size (this path once stopped with
    KeyError: 'hidden_size')."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_train.py"),
         "--config", str(REPO / "configs/train/smollm2-q4-cpu.yaml"),
         "--seq-len", "16", "--batch-size", "1", "--steps", "1", "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "target V=49152" in proc.stdout and "MFU" in proc.stdout


# the Kimi recipe's MLA dims for a tiny --target-shape (which carries none), as the docstring's
# --recompute command gives Kimi's
TINY_MLA = ["model.draft.mla.q_lora_rank=32", "model.draft.mla.kv_lora_rank=32",
            "model.draft.mla.qk_nope_head_dim=16", "model.draft.mla.qk_rope_head_dim=8",
            "model.draft.mla.v_head_dim=16"]  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--recompute"]], ids=["plain", "recompute"])
def test_the_kimi_recipe_times_its_mla_draft_at_a_tiny_target_shape(extra, capsys, monkeypatch):
    """~3 s each: the docstring's two Kimi commands (`--config
    configs/train/kimi-k2.5-offline.yaml --seq-len 2048 --batch-size 2`, and `--recompute`
    with a --target-shape) at 16 tokens on a tiny target shape: the recipe's MLA draft trains
    and prints its MFU, or both modes' ratio (that command once stopped: no MLA dims). In
    process: the matmul peak measured for 0.05 s (its 2 s measure the machine, not the script)."""
    import bench_train

    real = bench_train.matmul_peak
    monkeypatch.setattr(bench_train, "matmul_peak", lambda d, t: real(d, t, seconds=0.05))
    bench_train.main(
        [
            "--config", str(REPO / "configs/train/kimi-k2.5-offline.yaml"), *extra,
            "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--device", "cpu",
            "--target-shape", "hidden=64,vocab=512,heads=4,kv_heads=4,head_dim=24,intermediate=128",
            "model.draft_vocab_size=256", "model.ttt_steps=2", *TINY_MLA,
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    if extra:
        assert re.search(r"ratio\s+[\d.]+x the plain step's time", out), out
    else:
        assert "Vd=256 target V=512; batch 2 x 16 tokens, ttt_steps 2" in out
        assert re.search(r"MFU\s+[\d.]+%", out), out
