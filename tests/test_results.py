"""results/ is a record of what was measured, not of how the project got there.

Cost: ~0.2 s (reads results/'s text files; no model, no network).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"

# A benchmark question or answer runs to dozens of words; the longest note a result file
# carries today ("none: vLLM's spec-decode counters are one window over all requests") has 10.
MAX_WORDS = 20


def _strings(value: object, key: str = "") -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            # the held-out set's selection rule, eagle3.evaluate's own prose (no prompt text)
            if not (key == "held_out" and k == "rule"):
                yield from _strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _records(path: Path) -> Iterator[object]:
    if path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)
    else:
        yield json.loads(path.read_text())


def test_result_files_keep_ids_not_question_text():
    """Every string in results/'s JSON and JSONL files is short: eval files name a prompt by its
    id (MT-bench's question_id, HumanEval's task_id, a hash otherwise) and hold its counts; a
    copied question or answer would fail here."""
    files = sorted([*RESULTS.rglob("*.json"), *RESULTS.rglob("*.jsonl")])
    assert files, "results/ has no JSON files"
    long = [
        (str(path.relative_to(RESULTS)), text[:80])
        for path in files
        for record in _records(path)
        for text in _strings(record)
        if len(text.split()) > MAX_WORDS
    ]
    assert long == []
    per_prompt = json.loads(
        (RESULTS / "smollm2-q4-quickstart-20" / "eval-mt_bench.json").read_text()
    )
    ids = [p["id"] for p in per_prompt["results"][0]["per_prompt"]]
    assert ids[:2] == ["81", "82"] and len(ids) == per_prompt["results"][0]["prompts"]


def test_section_titles_say_what_was_measured():
    """No heading in results/'s markdown names an issue, a session or a pass: titles say what
    was measured, whenever it was."""
    history = re.compile(r"\b(issue|session|pass|turn ago)\b|#\d", re.IGNORECASE)
    titles = [
        f"{path.relative_to(RESULTS)}: {line}"
        for path in sorted(RESULTS.rglob("*.md"))
        for line in path.read_text().splitlines()
        if line.startswith("#") and history.search(line.lstrip("#"))
    ]
    assert titles == []
