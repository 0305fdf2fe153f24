"""The long-context benchmark: Python standard-library source files with a task appended, at
prompt lengths spread from short to the target's context.

    python -m eagle3.evaluate --target smollm2-135m-q4 --draft runs/x/final \\
        --bench long_context --limit 100 [--long-context-max 7936]

Every Python installation ships its standard library's source, so the benchmark needs no hub
and no download. The documents are the long modules of :data:`MODULES`, in that order (those
this Python has: the sources differ a little between Python versions, so the prompts are
fixed for a given Python and tokenizer; the log names the version). Prompt j of n asks for
about ``shortest * (longest / shortest) ** (j / (n - 1))`` tokens (log-spaced: each doubling of
the context gets the same number of prompts, one octave per default context bucket of
``eagle3.evaluate``), rendered through the target's chat template; ``longest`` defaults to the
target's context less the answer's tokens, ``shortest`` is ``longest / 32`` (at least twice
the prompt without its excerpt). It excerpts
document j mod D from its start (and the documents after it, each under a file header, where
one is too short), cut at a line end so the whole prompt fits, then asks one of :data:`TASKS`
in turn (continue the code, summarise it, explain or test the last function it defines). The
exact token length of every prompt is what `eagle3.evaluate` reports.

Training data is kept apart from it by `--exclude-benchmarks long_context` (every document
and task text: eagle3.data.decontaminate).
"""

from __future__ import annotations

import logging
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3.data.chat import prompt_ids
from eagle3.data.prompts import Prompt, PromptError

log = logging.getLogger(__name__)

NAME = "long_context"
DEFAULT_PROMPTS = 100  # without --limit: 20 a doubling over the five doublings below
SPAN = 32  # shortest prompt = longest / SPAN: five doublings, one per default context bucket
# no prompt is asked for under this many times the tokens of the prompt without its excerpt
MIN_OVERHEADS = 2
FIT_ROUNDS = 8  # rescalings of an excerpt towards its token target

# Long modules of the standard library (Lib/...), first existing alternative taken; stable
# across Python 3.10-3.13 (none of them removed by PEP 594).
MODULES: tuple[tuple[str, ...], ...] = (
    ("argparse.py",),
    ("typing.py",),
    ("inspect.py",),
    ("subprocess.py",),
    ("tarfile.py",),
    ("difflib.py",),
    ("pydoc.py",),
    ("ssl.py",),
    ("shutil.py",),
    ("threading.py",),
    ("logging/__init__.py",),
    ("unittest/mock.py",),
    ("dataclasses.py",),
    ("enum.py",),
    ("configparser.py",),
    ("mailbox.py",),
    ("imaplib.py",),
    ("http/client.py",),
    ("urllib/request.py",),
    ("xml/etree/ElementTree.py",),
    ("statistics.py",),
    ("tempfile.py",),
    ("socket.py",),
    ("optparse.py",),
    ("pickle.py",),
    ("doctest.py",),
    ("pdb.py",),
    ("ast.py",),
    ("ipaddress.py",),
    ("collections/__init__.py",),
    ("functools.py",),
    ("email/_header_value_parser.py",),
    ("zipfile/__init__.py", "zipfile.py"),
)

HEADER = "Below is Python source code from the standard library ({files}).\n\n```python\n"
FILE_MARK = "# ---- file: Lib/{path} ----\n"
TASKS = (
    "Continue this code from where it stops: write the next lines.",
    "Summarise what this code does and how it is organised.",
    "Explain what the function `{function}` above does, step by step.",
    "Write unit tests for the function `{function}` above.",
)
_DEF = re.compile(r"^\s*def (\w+)\(", re.MULTILINE)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_path("stdlib"))


def documents() -> list[tuple[str, str]]:
    """(Lib-relative path, source text) of every module of MODULES this Python has, in order."""
    root = stdlib_dir()
    out = []
    for alternatives in MODULES:
        for rel in alternatives:
            path = root / rel
            if path.is_file():
                out.append((rel, path.read_text(encoding="utf-8", errors="replace")))
                break
    if not out:
        raise PromptError(
            f"the long_context benchmark reads Python's standard-library sources, and {root} has "
            "none of them (a Python without its .py sources): use a full Python installation"
        )
    return out


def benchmark_texts() -> Iterator[str]:
    """Every text a long_context prompt can hold: the documents and the tasks (decontamination)."""
    for _, text in documents():
        yield text
    yield from (t.format(function="") for t in TASKS)


def target_lengths(n: int, longest: int, least: int = 1) -> list[int]:
    """n token targets, log-spaced from longest / SPAN (or `least` where more) to longest."""
    if n < 1:
        return []
    shortest = max(least, longest // SPAN)
    if n == 1 or longest <= shortest:
        return [longest] * n
    ratio = longest / shortest
    return [round(shortest * ratio ** (j / (n - 1))) for j in range(n)]


def least_tokens(tokenizer: Any) -> int:
    """The fewest tokens a prompt is asked for: twice the prompt without its excerpt."""
    return MIN_OVERHEADS * len(prompt_ids(tokenizer, _render(0, "", ["x.py"])))


def _task(j: int, excerpt: str) -> str:
    task = TASKS[j % len(TASKS)]
    if "{function}" not in task:
        return task
    names = _DEF.findall(excerpt)
    if not names:  # an excerpt without a def: summarise it instead
        return TASKS[1]
    return task.format(function=names[-1])


def _source(docs: list[tuple[str, str]], first: int, chars: int) -> tuple[str, list[str]]:
    """The first `chars` characters of documents first, first + 1, ... (each under a file
    header), cut back to a line end -> (text, the files in it)."""
    parts, files, size = [], [], 0
    for i in range(len(docs)):
        rel, text = docs[(first + i) % len(docs)]
        piece = FILE_MARK.format(path=rel) + text
        parts.append(piece)
        files.append(rel)
        size += len(piece)
        if size >= chars:
            break
    text = "".join(parts)[:chars]
    cut = text.rfind("\n")
    text = text[: cut + 1] if cut > 0 else text
    # the files whose header made it into the cut
    files = [f for f in files if FILE_MARK.format(path=f) in text] or files[:1]
    return text, files


def _render(j: int, excerpt: str, files: list[str]) -> list[dict[str, str]]:
    body = HEADER.format(files=", ".join(files)) + excerpt + "```\n\n" + _task(j, excerpt)
    return [{"role": "user", "content": body}]


def long_context_prompts(
    tokenizer: Any, longest: int, n: int = DEFAULT_PROMPTS, shortest: int | None = None
) -> list[Prompt]:
    """n prompts of log-spaced lengths from `shortest` (default: longest / 32) to `longest`
    tokens as `tokenizer`'s chat template renders them (each at most its target, within a few
    percent of it where a line end allows). Deterministic for a given Python and tokenizer.
    Each prompt's id is ``NNN-module-TOKENS`` (TOKENS: its own rendered length)."""
    least = least_tokens(tokenizer)
    if longest < least:
        raise PromptError(
            f"long_context: the longest prompt must be >= {least} tokens with this chat template "
            f"(twice the prompt without its excerpt), got {longest}; raise --long-context-max "
            "(or lower --max-new-tokens, which leaves the prompts the rest of the context)"
        )
    if shortest is not None and not least <= shortest <= longest:
        raise PromptError(
            f"long_context: the shortest prompt must be {least}..{longest} tokens (at least "
            f"twice the prompt without its excerpt, at most the longest), got {shortest}"
        )
    docs = documents()
    out = []
    # from the given shortest, else from longest / SPAN (never under `least`)
    for j, goal in enumerate(target_lengths(n, longest, shortest or least)):
        overhead = len(prompt_ids(tokenizer, _render(j, "", ["x.py"])))
        chars, best = max(4 * (goal - overhead), 64), None
        for _ in range(FIT_ROUNDS):
            excerpt, files = _source(docs, j % len(docs), chars)
            messages = _render(j, excerpt, files)
            size = len(prompt_ids(tokenizer, messages))
            if size <= goal and (best is None or size > best[0]):
                best = (size, messages, files)
            if size <= goal and size >= 0.97 * goal:
                break
            # rescale the excerpt's characters by the tokens it should have vs has
            want, have = max(goal - overhead, 1), max(size - overhead, 1)
            chars = max(int(chars * want / have * (0.99 if size > goal else 1.0)), 1)
        if best is None:
            raise PromptError(
                f"long_context: no excerpt fits {goal} tokens with this chat template "
                f"({overhead} tokens without one); raise --long-context-max"
            )
        size, messages, files = best
        stem = Path(files[0]).with_suffix("").as_posix().removesuffix("/__init__")
        stem = stem.replace("/", ".")
        out.append(Prompt(id=f"{j:03d}-{stem}-{size}", dataset=NAME, messages=messages))
    log.info(
        "long_context: %d prompts of %d-%d tokens from %d standard-library files (Python %s)",
        len(out), _tokens(out[0]) if out else 0, _tokens(out[-1]) if out else 0, len(docs),
        sys.version.split()[0],
    )  # fmt: skip
    return out


def _tokens(prompt: Prompt) -> int:
    return int(prompt.id.rsplit("-", 1)[-1])
