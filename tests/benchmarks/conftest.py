"""The files in benchmarks/ run as scripts (`python benchmarks/bench_long_context.py`): a script's
own directory is on its sys.path, so they import each other by bare name. The tests import
them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture
def brief_matmul_peak(monkeypatch):
    """The matmul peak the benchmarks divide by, measured for 0.05 s instead of 2 s (twice a
    run): these tests check that a script's path runs, not this machine's peak."""
    from eagle3 import compute

    real = compute.matmul_peak

    def brief(device="cpu", dtype=torch.float32, seconds=2.0):
        return real(device, dtype, seconds=0.05)

    monkeypatch.setattr(compute, "matmul_peak", brief)
    return brief  # for a script that imported matmul_peak by name
