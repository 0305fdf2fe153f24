"""benchmarks/gpu_check.py runs end to end on a CPU in its tiny mode (the GPU run is the user's)."""

from __future__ import annotations

import json

import gpu_check


def test_gpu_check_tiny_on_cpu_writes_its_json(tmp_path):
    """~5 s: every check but the recompile count (test_flex_fallback covers it, ~20 s) runs
    at tiny shapes on a CPU and lands in the JSON without an error."""
    out = tmp_path / "gpu_check.json"
    checks = "soft_label_grad,flex_vs_chunked,memory"
    assert (
        gpu_check.main(["--device", "cpu", "--tiny", "--json", str(out), "--checks", checks]) == 0
    )
    report = json.loads(out.read_text())
    assert not [name for name in checks.split(",") if "error" in report[name]]
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):
        assert report["soft_label_grad"][dtype]["max_abs_grad"] < tol
    assert report["flex_vs_chunked"]["auto_chooses"] == "chunked"  # no flex on a CPU
    assert set(report["memory"]) == {"64", "128", "192"}
    assert all(entry["planned_gb"] > 0 for entry in report["memory"].values())
