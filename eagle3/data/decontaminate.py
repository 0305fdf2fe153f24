"""Keep benchmark prompts and their answers out of training data.

A drafter measured on MT-bench, HumanEval or GSM8K must not have trained on them: that would
read as acceptance the drafter cannot deliver on new prompts. A training prompt is
contaminated when one of its turns shares a run of ``NGRAM`` words with a benchmark question or
reference answer (the 13-gram rule of the GPT-3 and Llama decontamination studies), or, for
benchmark texts shorter than that, when a turn contains the whole text. Words are compared
lower-cased, punctuation dropped, so re-spaced or re-punctuated copies still match.

    index = BenchmarkIndex.from_sources(["mt_bench", "humaneval", "gsm8k=test.jsonl"])
    kept, dropped = index.split(prompts)

Benchmarks are named by one spec, ``mt_bench,humaneval,gsm8k=PATH/test.jsonl``
(:func:`parse_benches`): ``eagle3.evaluate --bench`` measures on it, and a data CLI given
:func:`add_exclude_args` drops the prompts it overlaps before generating anything
(:func:`exclude_contaminated`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.data.long_context import benchmark_texts as long_context_texts
from eagle3.data.prompts import Prompt, normalize, open_source
from eagle3.errors import Eagle3Error

NGRAM = 13
MIN_WORDS = 4  # shorter benchmark texts ("Hello") would match everything: left out
# Raw record fields that hold a benchmark's reference answer (GSM8K, HumanEval, MT-bench refs).
ANSWER_KEYS = ("answer", "canonical_solution", "reference", "references", "solution")

# long_context: Python's standard-library sources with tasks (eagle3.data.long_context)
EMBEDDED_BENCHES = ("mt_bench", "humaneval", "long_context")
# a file named like this takes its directory's name as the benchmark's: gsm8k/test.jsonl -> gsm8k
GENERIC_STEMS = {"test", "train", "question", "questions", "data", "prompts", "validation"}

_WORD = re.compile(r"[a-z0-9]+")


def parse_benches(spec: str, flag: str = "--bench") -> list[tuple[str, str]]:
    """'mt_bench,humaneval,gsm8k=FILE,FILE.jsonl' -> [(name, source)]; `flag` names the
    option in the errors."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, source = item.partition("=")
        if sep:
            out.append((name, source))
        elif item in EMBEDDED_BENCHES:
            out.append((item, item))
        elif Path(item).exists():
            path = Path(item)
            stem = path.name.split(".")[0]
            out.append((path.parent.name if stem in GENERIC_STEMS else stem, item))
        elif item == "gsm8k":
            raise Eagle3Error(
                f"gsm8k has no embedded copy: pass its file, e.g. {flag} gsm8k=PATH/gsm8k/test.jsonl"
            )
        else:
            raise Eagle3Error(
                f"unknown benchmark {item!r} in {flag}: use mt_bench, humaneval, long_context, "
                "NAME=FILE.jsonl or an existing prompts file"
            )
    if not out:
        raise Eagle3Error(f"{flag} is empty; e.g. {flag} mt_bench,humaneval")
    return out


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int = NGRAM) -> Iterator[tuple[str, ...]]:
    return (tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def benchmark_texts(source: str) -> Iterator[str]:
    """Every question turn and reference answer of a benchmark source (name or file)."""
    if source == "long_context":  # built per tokenizer: every text any of its prompts holds
        yield from long_context_texts()
        return
    records, report = open_source(source)
    for raw in records:
        if not isinstance(raw, dict):
            continue
        try:
            prompt = normalize(raw, report.dataset)
        except Eagle3Error:
            prompt = None
        if prompt is not None:
            yield from (m["content"] for m in prompt.messages)
        for key in ANSWER_KEYS:
            yield from _texts(raw.get(key))


@dataclass
class BenchmarkIndex:
    grams: set[tuple[str, ...]] = field(default_factory=set)
    short: set[str] = field(default_factory=set)  # whole texts of MIN_WORDS..NGRAM-1 words
    texts: int = 0

    def add(self, text: str) -> None:
        tokens = words(text)
        if len(tokens) >= NGRAM:
            self.grams.update(ngrams(tokens))
        elif len(tokens) >= MIN_WORDS:
            self.short.add(" ".join(tokens))
        self.texts += 1

    @classmethod
    def from_sources(cls, sources: Iterable[str]) -> BenchmarkIndex:
        """``sources``: benchmark names or files, as ``eagle3.evaluate --bench`` takes them
        (``NAME=FILE`` is accepted and reads FILE)."""
        index = cls()
        for source in sources:
            for text in benchmark_texts(source.split("=", 1)[-1]):
                index.add(text)
        return index

    def contaminated(self, text: str) -> bool:
        tokens = words(text)
        if any(g in self.grams for g in ngrams(tokens)):
            return True
        if not self.short:
            return False
        joined = f" {' '.join(tokens)} "
        return any(f" {s} " in joined for s in self.short)

    def hit(self, messages: Iterable[dict]) -> bool:
        return any(self.contaminated(str(m.get("content") or "")) for m in messages)

    def split(self, prompts: Iterable[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
        """(clean prompts, contaminated prompts), order kept."""
        kept, dropped = [], []
        for p in prompts:
            (dropped if self.hit(p.messages) else kept).append(p)
        return kept, dropped


# -- the CLI flag ---------------------------------------------------------------------------------
def add_exclude_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--exclude-benchmarks SPEC`` (read by :func:`exclude_contaminated`)."""
    parser.add_argument(
        "--exclude-benchmarks",
        metavar="SPEC",
        help=f"drop prompts that share a {NGRAM}-word run with these benchmarks' questions or "
        "answers, before generating: mt_bench,humaneval,gsm8k=PATH/gsm8k/test.jsonl (as "
        "eagle3.evaluate --bench)",
    )
    return parser


def exclude_contaminated(prompts: list[Prompt], spec: str | None) -> list[Prompt]:
    """The prompts that overlap none of the benchmarks in ``spec`` (order kept; all of them
    when ``spec`` is None). Prints one line: how many were dropped, and for which benchmark."""
    if not spec:
        return prompts
    benches = parse_benches(spec, flag="--exclude-benchmarks")
    indexes = {name: BenchmarkIndex.from_sources([source]) for name, source in benches}
    kept, hits = [], {name: 0 for name in indexes}
    for prompt in prompts:
        name = next((n for n, index in indexes.items() if index.hit(prompt.messages)), None)
        if name is None:
            kept.append(prompt)
        else:
            hits[name] += 1
    why = ", ".join(f"{name} {n}" for name, n in hits.items())
    print(
        f"--exclude-benchmarks: dropped {len(prompts) - len(kept)} of {len(prompts)} prompts "
        f"sharing a {NGRAM}-word run with a benchmark question or answer ({why})",
        flush=True,
    )
    return kept
