"""``python -m datagen.capture --estimate``: what a capture would cost, before anything loads.

    python -m datagen.capture --target kimi-k2.5 --estimate --tokens 40M
    python -m datagen.capture --target smollm2-135m-q4 --estimate --data out/responses --out out/shards

Prints the tokens (given, or counted by rendering --data with the target's tokenizer, else
the records' usage counts), the bytes per token and on disk in every storage dtype (with the
dtype each stores the aux and the last hidden states in), hours at a few capture speeds (or
--tokens-per-s), the free space at --out, and, beyond what is sensible to store, the advice
to train online instead. No weights are read: a registry entry's hidden size needs no
config.json, so a hub-only target (kimi-k2.5) downloads nothing.
"""

from __future__ import annotations

import argparse
import shutil
from collections import Counter
from pathlib import Path

import torch

from datagen.render import Rendering, render_all
from eagle3.data.records import read_records
from eagle3.data.shards import DTYPES, bytes_per_token
from eagle3.errors import Eagle3Error
from eagle3.targets import load_tokenizer, resolve, target_facts

ESTIMATE_RATES = (1_000, 10_000, 50_000)  # tokens/s shown by --estimate when none is given
TB_WARN = 1e12  # bytes beyond which --estimate recommends online training
STORED_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}


def parse_count(text: str) -> int:
    """'40M' -> 40_000_000; also K, B and plain integers."""
    text = str(text).strip().upper().replace("_", "").replace(",", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 40M)") from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


def free_bytes(path: Path) -> int | None:
    """Free disk space where `path` is (or will be created); None if it cannot be read."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def estimate_text(
    name: str, hidden: int, tokens: int, dtype: str, rate: float | None, free: int | None
) -> str:
    """What --estimate prints: tokens, bytes per dtype, hours, and the online alternative."""
    lines = [f"capture estimate for {name} (hidden size {hidden}): {tokens:,} tokens"]
    for dt, stored in DTYPES.items():
        per = bytes_per_token(hidden, dt)
        what = (
            f"aux {STORED_NAMES[stored['aux_hidden']]}, last {STORED_NAMES[stored['last_hidden']]}"
        )
        mark = "  <- --dtype" if dt == dtype else ""
        lines.append(
            f"  {dt:7s} {per:>7,} bytes/token  {human_bytes(per * tokens):>10} on disk"
            f"  ({what}){mark}"
        )
    rates = [rate] if rate else ESTIMATE_RATES
    hours = ", ".join(f"{tokens / r / 3600:,.2f} h at {r:,.0f} tok/s" for r in rates)
    lines.append(f"  time: {hours} (measure yours with benchmarks/bench_capture.py)")
    size = bytes_per_token(hidden, dtype) * tokens
    if free is not None:
        lines.append(f"  free space at --out: {human_bytes(free)}")
    if size >= TB_WARN or (free is not None and size > free):
        lines.append(
            f"  {human_bytes(size)} of hidden states is more than is sensible to store: train "
            "online instead (the target runs inside the training loop and nothing is written; "
            "data.mode=online with data.records=<these result files> in train/train_drafter.py)"
        )
    return "\n".join(lines)


def target_dims(name: str) -> tuple[str, int]:
    """(display name, hidden size) without loading weights. A registry entry's hidden_size
    needs no config.json, so --estimate for a hub-only target (kimi-k2.5) downloads nothing."""
    target = resolve(name)
    if target.spec and target.spec.get("hidden_size"):
        return target.name, int(target.spec["hidden_size"])
    facts = target_facts(name)
    return facts["name"], int(facts["hidden_size"])


def count_record_tokens(records: list[dict], name: str, rendering: Rendering) -> tuple[int, str]:
    """Total tokens of the records and how they were counted: rendered with the target's
    tokenizer when it is at hand, else the records' usage counts (prompt + completion tokens
    of the last turn)."""
    try:
        tokenizer = load_tokenizer(name)
        stats: Counter = Counter()
        items = render_all(records, tokenizer, rendering, stats)
        return sum(len(it.input_ids) for it in items), "rendered with the target's tokenizer"
    except (OSError, ValueError, Eagle3Error):
        usage = [r.get("usage") or {} for r in records if isinstance(r, dict)]
        total = sum(
            int(u.get("prompt_tokens") or 0) + int(u.get("completion_tokens") or 0) for u in usage
        )
        return total, "from the records' usage counts (no tokenizer at hand)"


def run_estimate(
    target: str,
    rendering: Rendering,
    dtype: str,
    *,
    data: list[str],
    limit: int | None,
    out: str | None,
    tokens: int | None,
    tokens_per_s: float | None,
) -> int:
    """--estimate: print tokens, bytes and hours of a capture without loading the target."""
    name, hidden = target_dims(target)
    if tokens:
        how = "given"
    elif data:
        records = read_records(data)
        tokens, how = count_record_tokens(records, target, rendering)
        if limit:
            tokens = tokens * min(1.0, limit / max(len(records), 1))
        tokens = int(tokens)
    else:
        raise Eagle3Error("--estimate needs --tokens N (e.g. 40M) or --data FILES to count")
    free = free_bytes(Path(out)) if out else None
    print(estimate_text(name, hidden, tokens, dtype, tokens_per_s, free))
    print(f"  (tokens {how})")
    return 0
