"""datagen.render: records -> capture items (windows or cut), every unusable record counted."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from datagen.render import Rendering, render_all
from eagle3.data.chat import render_record


def _helper():
    spec = importlib.util.spec_from_file_location(
        "tiny_chat", Path(__file__).resolve().parents[1] / "tiny_chat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _helper()


@pytest.fixture(scope="module")
def tokenizer():
    return tc.chatml_tokenizer()


def record(rid, question, answer, **extra):
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"id": rid, "dataset": "chat", "messages": messages, **extra}


RECORDS = [
    record("short", "hello", "hi"),
    record("long", "tell me a joke", "no " * 30, finish_reason="length"),
    record("empty", "hello", ""),
    {"id": "asks-nothing", "messages": [{"role": "assistant", "content": "hi"}]},
]


def test_unbalanced_think_tags_are_counted_not_raised(tokenizer):
    """A record whose turn has two </think> is skipped and counted by its reason; its neighbour
    is kept. Cheap (~5 ms)."""
    stats: Counter = Counter()
    records = [record("bad", "hello", "a</think>b</think>hi"), record("good", "hello", "hi")]
    items = render_all(records, tokenizer, Rendering(48, "window"), stats)
    assert [it.id for it in items] == ["good"]
    assert stats == Counter({"kept": 1, "skipped: unbalanced think tags": 1})


def test_a_long_record_becomes_windows_and_every_other_case_is_counted(tokenizer):
    stats: Counter = Counter()
    lengths: list = []
    items = render_all(RECORDS, tokenizer, Rendering(48, "window", 16), stats, lengths)
    long = render_record(tokenizer, RECORDS[1])
    windows = [it for it in items if it.id.startswith("long#w")]
    assert [it.id for it in items] == ["short", *(f"long#w{i}" for i in range(len(windows)))]
    assert len(windows) > 1 and all(len(it.input_ids) <= 48 for it in items)
    assert sum(sum(it.loss_mask) for it in windows) == sum(long.loss_mask)  # every token once
    assert stats == Counter({
        "kept": 2,
        "kept: longer than --max-length (window)": 1,
        "kept: response cut at max tokens (no end-of-turn token)": 1,
        "skipped: empty response": 1,
        "skipped: no user turn": 1,
    })  # fmt: skip
    assert [n for n, _, _ in lengths] == [len(render_record(tokenizer, RECORDS[0]).input_ids),
                                          len(long.input_ids)]  # fmt: skip


def test_windows_captured_before_are_left_out(tokenizer):
    stats: Counter = Counter()
    items = render_all(RECORDS[:2], tokenizer, Rendering(48, "window", 16), stats,
                       done={"short", "long#w0"})  # fmt: skip
    assert [it.id for it in items][:1] == ["long#w1"]  # the record's other windows only
    assert stats["already captured"] == 1 and stats["kept"] == 1


def test_cut_keeps_the_first_max_length_tokens_under_the_bare_id(tokenizer):
    stats: Counter = Counter()
    items = render_all(RECORDS[:2], tokenizer, Rendering(48, "cut"), stats)
    long = render_record(tokenizer, RECORDS[1])
    assert [it.id for it in items] == ["short", "long"]
    assert items[1].input_ids == long.input_ids[:48]
    assert stats["kept: longer than --max-length (cut)"] == 1
