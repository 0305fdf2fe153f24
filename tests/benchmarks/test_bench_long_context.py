"""benchmarks/bench_long_context.py: its sweep through its real path at the smallest size (one
point, measured in its own process as every point is)."""

from __future__ import annotations

import json

import bench_long_context
import pytest


@pytest.mark.slow
def test_one_point_of_the_sweep_is_measured_in_its_own_process(tmp_path, capsys, monkeypatch):
    """~10 s (the point's process: imports, its matmul peak measured for 2 s before and
    after its step, a warm-up at 256 tokens): `bench_long_context.py --drafts smollm2 --paths
    new --seq-lens 32768` at 128 tokens, one step, with --json: the point is measured (not
    skipped, no error), its MFU printed and every number written. --quick runs this sweep at
    2k and 16k (minutes); --packing trains the recipe twice per arm on a quickstart's shards
    (minutes) and is not run here."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the point's process: one thread is faster here
    out = tmp_path / "long_context.json"
    bench_long_context.main(["--drafts", "smollm2", "--paths", "new", "--seq-lens", "128",
                             "--steps", "1", "--device", "cpu", "--json", str(out)])  # fmt: skip
    (point,) = json.loads(out.read_text())["points"]
    assert (point["draft"], point["path"], point["seq_len"]) == ("smollm2", "new", 128)
    assert point["tokens_per_s"] > 0 and point["peak_gib"] >= 0 and 0 < point["mfu"]
    assert "%" in capsys.readouterr().out.splitlines()[-2]  # the point's row, MFU last
