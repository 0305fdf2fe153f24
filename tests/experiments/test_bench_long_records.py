"""experiments/bench_long_records.py: its records stay off the benchmark and its arms train the
same loss tokens a step. ~10 s (the embedded tokenizer and the long_context n-gram index)."""

from __future__ import annotations

import json

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
