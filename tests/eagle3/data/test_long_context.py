"""eagle3.data.long_context: standard-library prompts of log-spaced token lengths, and the
decontamination that knows them. Each test under a second."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from eagle3.data.chat import prompt_ids
from eagle3.data.decontaminate import BenchmarkIndex, parse_benches
from eagle3.data.long_context import (
    NAME,
    documents,
    least_tokens,
    long_context_prompts,
    target_lengths,
)
from eagle3.data.prompts import Prompt, PromptError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.spec_from_file_location("tiny_chat", REPO / "tests" / "tiny_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chatml_tokenizer(256)


def test_lengths_are_log_spaced_over_five_doublings():
    lengths = target_lengths(6, 3200)
    assert lengths[0] == 100 and lengths[-1] == 3200  # longest / 32
    ratios = [b / a for a, b in zip(lengths, lengths[1:])]
    assert all(r == pytest.approx(2.0, rel=0.02) for r in ratios)
    assert target_lengths(1, 500) == [500] and target_lengths(0, 500) == []


def test_prompts_fit_their_lengths_deterministically(tokenizer):
    prompts = long_context_prompts(tokenizer, 600, n=8)
    again = long_context_prompts(tokenizer, 600, n=8)
    assert prompts == again and [p.messages for p in prompts] == [p.messages for p in again]
    sizes = [len(prompt_ids(tokenizer, p.messages)) for p in prompts]
    assert [int(p.id.rsplit("-", 1)[1]) for p in prompts] == sizes  # the id names its length
    assert sizes == sorted(sizes) and sizes[-1] <= 600 and sizes[0] < 300
    for size, goal in zip(sizes, target_lengths(8, 600, least_tokens(tokenizer))):
        assert 0.85 * goal <= size <= goal  # never over: prompt + answer must fit the context
    assert all(p.dataset == NAME for p in prompts)
    first = prompts[0].messages[0]["content"]
    path, _ = documents()[0]
    assert f"# ---- file: Lib/{path} ----" in first and "```\n\n" in first
    with pytest.raises(PromptError, match="--long-context-max"):
        long_context_prompts(tokenizer, 4, n=2)
    # from a given shortest: the lengths of one doubling only
    sizes = [int(p.id.rsplit("-", 1)[1]) for p in long_context_prompts(tokenizer, 600, 4, 300)]
    assert 0.85 * 300 <= sizes[0] <= 300 and 0.85 * 600 <= sizes[-1] <= 600
    with pytest.raises(PromptError, match="shortest prompt must be"):
        long_context_prompts(tokenizer, 600, n=2, shortest=700)


def test_a_long_prompt_spans_several_files(tokenizer):
    docs = documents()
    (prompt,) = long_context_prompts(tokenizer, len(docs[0][1]) // 2 + 4000, n=1)
    text = prompt.messages[0]["content"]
    assert text.count("# ---- file: Lib/") >= 2  # the first file alone is too short


def test_training_data_is_checked_against_it():
    assert parse_benches("mt_bench,long_context") == [
        ("mt_bench", "mt_bench"),
        ("long_context", "long_context"),
    ]
    index = BenchmarkIndex.from_sources(["long_context"])
    _, source = documents()[0]
    copied = " ".join(source.split()[200:240])  # 40 words of a document, re-spaced
    assert index.hit(Prompt("x", "d", [{"role": "user", "content": copied}]).messages)
    clean = "Tell me about the weather in Paris in the spring and what to wear there today."
    assert not index.hit(Prompt("y", "d", [{"role": "user", "content": clean}]).messages)
