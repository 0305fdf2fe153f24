"""`python -m eagle3.compare`: markdown table and PNG charts from evaluate reports."""

from __future__ import annotations

import json

from eagle3.evaluation.side_by_side import collect, format_table, main


def row(drafter, bench, tau, speedup, alpha):
    return {"drafter": drafter, "bench": bench, "tau": tau, "speedup": speedup, "alpha": alpha}


def write(path, rows):
    path.write_text(json.dumps({"target": "t", "config": {}, "results": rows}))
    return path


def test_table_and_charts(tmp_path, capsys):
    a = write(
        tmp_path / "run_a.json",
        [
            row("exp/final", "mt_bench", 3.2, 1.8, [0.8, 0.6, None]),
            row("prompt-lookup", "mt_bench", 1.4, 1.1, [0.3, 0.5, 0.6]),
            row("exp/final", "humaneval", 3.9, 2.1, [0.9, 0.7, 0.5]),
            row("none", "mt_bench", 1.0, 0.97, []),
        ],
    )
    b = write(tmp_path / "run_b.json", [row("prompt-lookup", "mt_bench", 1.5, 1.2, [0.4])])
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| drafter | mt_bench τ / speedup | humaneval τ / speedup |"
    assert "| exp/final | 3.20 / 1.80x | 3.90 / 2.10x |" in out
    assert "| prompt-lookup (run_a) | 1.40 / 1.10x | – |" in out  # same name in two inputs
    assert "| prompt-lookup (run_b) | 1.50 / 1.20x | – |" in out
    for name in ("tau.png", "acceptance.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collect_keeps_unique_names(tmp_path):
    a = write(tmp_path / "a.json", [row("x", "b1", 2.0, 1.5, [0.5])])
    rows = collect([str(a)])
    assert [r["label"] for r in rows] == ["x"]
    assert "| x | 2.00 / 1.50x |" in format_table(rows)


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main([str(bad), "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {bad} has no 'results' list; pass a file from eagle3.evaluate --json"
    )
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "not a results JSON" in capsys.readouterr().err


def test_intervals_show_where_present_and_old_files_still_read(tmp_path, capsys):
    new = {**row("x/final", "mt_bench", 1.45, 1.5, [0.5]), "tau_ci95": [1.3, 1.61],
           "speedup_ci95": [1.2, 1.74], "per_prompt": [{"id": "a", "tau": 1.45}]}  # fmt: skip
    vllm = {**row("x/final [vllm]", "mt_bench", 1.5, 1.6, [0.5]), "tau_ci95": None,
            "speedup_ci95": None, "engine": {"name": "vllm"}}  # fmt: skip
    a = write(tmp_path / "new.json", [new, vllm])
    b = write(tmp_path / "old.json", [row("y/final", "mt_bench", 1.2, 1.1, [0.4])])
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| x/final | 1.45 [1.30, 1.61] / 1.50x [1.20, 1.74] |" in out
    assert "| x/final [vllm] | 1.50 / 1.60x |" in out
    assert "| y/final | 1.20 / 1.10x |" in out
    assert "[lo, hi]: 95% bootstrap interval over prompts" in out
    assert (tmp_path / "out" / "tau.png").is_file()
    assert "bootstrap" not in format_table(collect([str(b)]))  # no interval, no legend
