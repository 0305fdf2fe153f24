"""``python -m datagen.capture``: run the target over finished conversations, store hidden states.

Each record (``eagle3.data.records`` format, from ``datagen.openrouter`` or ``datagen.local``) is
rendered with the target's chat template into token ids and a loss mask (:mod:`eagle3.data.chat`),
the target runs once over it (:meth:`eagle3.target.Target.capture`: the 3 aux layers and the
final post-norm hidden state, no lm_head), and the result is written as shards
(:mod:`eagle3.data.shards`, layout, dtypes and bytes per token there)::

    python -m datagen.capture --target smollm2-135m-q4 --data out/responses --out out/shards
    python -m datagen.capture --target kimi-k2.5 --estimate --tokens 40M       # before anything
    accelerate launch --num_processes 8 -m datagen.capture --target /models/Llama-3.1-8B \\
        --data out/responses --out /shared/shards      # one replica of the target per GPU
    python -m datagen.capture --target /models/Kimi-K2.5 --device-map auto \\
        --data out/responses --out /shared/shards      # one process, the target over all GPUs
    python -m datagen.capture --engine vllm --target smollm2-135m-q4 --data out/responses \\
        --out out/shards [--tensor-parallel-size 8] [--engine-arg=--enforce-eager]
    python -m datagen.capture --verify --out out/shards    # every shard whole? (no model)

``--engine vllm`` takes the hidden states from a managed vLLM server instead of HF in-process
(vLLM's ``extract_hidden_states`` method with the CPU-safe connector eagle3/vllm_capture.py):
each record's rendered token ids go to /v1/completions as a token-id prompt (max_tokens 1),
the engine returns the aux layers (our ids + 1 in vLLM's convention) and the pre-norm state
after the last layer, and the target's final norm (its weight read alone from the
safetensors) is applied here. The returned token ids are checked against ours; the shards,
meta.json and resume are the HF path's.

Scale-out: under ``accelerate launch`` (or ``torchrun``) every process captures its own slice
of the records (one process per GPU, or one per node with ``--device-map auto`` for a target
larger than one GPU), writing its own shards; process 0 merges the index at the end.
Resume: re-run the same command; records already in complete shards are skipped. A resume
first verifies every shard (size and xxh3, :mod:`eagle3.data.shards` Integrity) and drops the
damaged or missing ones, so it captures exactly their records again and leaves every other
shard byte-identical. ``--verify`` only checks: one line per damaged or missing shard and a
summary; exit 0 when all are intact, 1 when not (2, as always, for bad input).

Bad input never stops the run: records without a user turn, with an empty response or a
template error are skipped; responses cut at max tokens are kept without an end-of-turn token;
a record longer than ``--max-length`` is captured as windows of it (``--long-records window``,
the default; :mod:`eagle3.data.windows`: ids ``<id>#w<i>``, each window run through the target
from its own first token, every generated token in exactly one window's loss mask) or cut to
its first ``--max-length`` tokens (``cut``; skipped if no response token is left). The run
prints the records' length distribution and what a cut at ``--max-length`` would drop (also
meta.json's ``long_records``). Every case is counted in the summary printed at the end and
stored in meta.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.cli import EXIT_ERROR, HelpFormatter, run_cli
from eagle3.data.chat import RenderError, load_chat_template, render_record
from eagle3.data.records import read_records
from eagle3.data.shards import (
    DTYPES,
    ShardWriter,
    bytes_per_token,
    check_meta,
    finalize,
    read_index,
    read_meta,
    recapture_command,
    repair,
    target_meta,
    verify_shards,
)
from eagle3.data.windows import MODES as WINDOW_MODES
from eagle3.data.windows import cut_losses, lengths_line, record_of, record_windows, window_mask
from eagle3.errors import Eagle3Error
from eagle3.served_target import ServedTarget, describe_served_target
from eagle3.serving import add_engine_args
from eagle3.target import (
    Target,
    load_target,
    resolve,
    target_facts,
)

log = logging.getLogger("datagen.capture")

DEFAULT_MAX_LENGTH = 4096
DEFAULT_BATCH_TOKENS = 16384  # padded tokens per forward; lower it if the target runs out of memory
ESTIMATE_RATES = (1_000, 10_000, 50_000)  # tokens/s shown by --estimate when none is given
LOG_EVERY_S = 30.0
TB_WARN = 1e12  # bytes beyond which --estimate recommends online training
EXIT_DAMAGED = EXIT_ERROR  # --verify found damage: 1, as `sha256sum -c` for a mismatch
# flags that change neither which records are captured nor what is stored: not in meta's command
NOT_IN_COMMAND = {
    "help",
    "out",
    "verify",
    "estimate",
    "tokens",
    "tokens_per_s",
    "no_disk_check",
    "engine_log",
}


@dataclass
class Item:
    id: str
    dataset: str | None
    input_ids: list[int]
    loss_mask: list[int]


# ----------------------------------------------------------------------------- records


def render_all(
    records: list[dict],
    tokenizer: Any,
    args,
    stats: Counter,
    lengths: list | None = None,
    done: set[str] = frozenset(),
) -> list[Item]:
    """Rendered items, windows of a long record (--long-records window) or its cut; every
    record that cannot be used is counted in ``stats`` instead, and windows in `done`
    (captured by an earlier run) are left out. `lengths` collects each rendered record's
    (tokens, loss tokens a cut would drop, loss tokens) for the report."""
    items = []
    for record in records:
        try:
            r = render_record(
                tokenizer,
                record,
                chat_template=args.chat_template,
                template_kwargs=args.template_kwargs,
            )
        except RenderError as err:
            stats[f"skipped: {err.reason}"] += 1
            continue
        ids, mask = torch.tensor(r.input_ids), torch.tensor(r.loss_mask)
        if lengths is not None:
            lengths.append((len(ids), *cut_losses(mask, args.max_length)))
        windows = record_windows(mask, args.max_length, args.long_records, args.window_context)
        if not any(window_mask(mask, w).any() for w in windows):
            stats["skipped: too long (no response token within --max-length)"] += 1
            continue
        rid, windowed = str(record["id"]), args.long_records == "window" and len(windows) > 1
        # a long record's windows all carry #wI: the bare id is never "done" for select()
        wids = [f"{rid}#w{i}" if windowed else rid for i in range(len(windows))]
        new = [(wid, w) for wid, w in zip(wids, windows) if wid not in done]
        if not new:
            stats["already captured"] += 1
            continue
        if len(ids) > args.max_length:
            stats[f"kept: longer than --max-length ({args.long_records})"] += 1
        if record.get("finish_reason") == "length":
            stats["kept: response cut at max tokens (no end-of-turn token)"] += 1
        if r.reasoning_dropped:
            stats["kept: reasoning left out (the template has no place for it)"] += 1
        stats["kept"] += 1
        for wid, w in new:
            items.append(Item(wid, record.get("dataset"), ids[w.start : w.end].tolist(),
                              window_mask(mask, w).tolist()))  # fmt: skip
    return items


def report_lengths(state, lengths: list[tuple[int, int, int]], args) -> None:
    """Process 0 prints this run's records' length distribution and what a cut at
    --max-length would drop (every process's records)."""
    rows = [row for part in _gather(state, lengths) for row in part]
    if state.process_index == 0 and rows:
        line = lengths_line([n for n, _, _ in rows], [(d, t) for _, d, t in rows], args.max_length)
        how = "windows" if args.long_records == "window" else "cut"
        log.info("records to capture: %s (--long-records %s)", line, how)


def select(records: list[dict], done: set[str], stats: Counter) -> list[dict]:
    """Records still to capture: unique ids, not already in complete shards."""
    seen: set[str] = set()
    out = []
    for record in records:
        rid = record.get("id") if isinstance(record, dict) else None
        if not isinstance(rid, str | int) or str(rid) == "":
            stats["skipped: bad record"] += 1
            continue
        rid = str(rid)
        if rid in seen:
            stats["skipped: duplicate id"] += 1
            continue
        seen.add(rid)
        if rid in done:
            stats["already captured"] += 1
            continue
        out.append(record)
    return out


def my_slice(records: list[dict], rank: int, world: int) -> list[dict]:
    """This process's records: longest first, dealt round-robin so every process gets about
    the same number of tokens. Every record goes to exactly one process."""
    order = sorted(records, key=lambda r: (-len(json.dumps(r.get("messages"))), str(r["id"])))
    return order[rank::world]


# ----------------------------------------------------------------------------- capture


def batches(items: list[Item], batch_tokens: int) -> list[list[Item]]:
    """Longest first; each batch holds at most ``batch_tokens`` padded tokens (at least one)."""
    items = sorted(items, key=lambda it: -len(it.input_ids))
    out, i = [], 0
    while i < len(items):
        width = len(items[i].input_ids)
        n = max(1, batch_tokens // max(width, 1))
        out.append(items[i : i + n])
        i += n
    return out


def pad(batch: list[Item], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask [B, T]."""
    width = max(len(it.input_ids) for it in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for b, it in enumerate(batch):
        ids[b, : len(it.input_ids)] = torch.tensor(it.input_ids)
        attn[b, : len(it.input_ids)] = 1
    return ids, attn


def capture_items(target, items: list[Item], writer: ShardWriter, batch_tokens: int) -> int:
    """Capture and write every item; returns the number of tokens captured."""
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    total, t0, last_log = 0, time.monotonic(), time.monotonic()
    for n, batch in enumerate(batches(items, batch_tokens), 1):
        ids, attn = pad(batch, pad_id)
        aux, last = target.capture(ids, attn)  # [B, T, 3H], [B, T, H]
        writer.add_batch(
            [it.id for it in batch],
            [it.input_ids for it in batch],
            [it.loss_mask for it in batch],
            aux,
            last,
            datasets=[it.dataset for it in batch],
        )
        total += sum(len(it.input_ids) for it in batch)
        now = time.monotonic()
        if now - last_log >= LOG_EVERY_S:
            last_log = now
            log.info("batch %d: %d tokens, %.0f tok/s", n, total, total / (now - t0))
    return total


# ----------------------------------------------------------------------------- engine


def load_engine_target(args) -> ServedTarget:
    """The target as vLLM will serve it (eagle3.served_target), checked against the flags."""
    target = describe_served_target(args.target, args.aux_layers, "--aux-layers")
    target.check_length(args.max_length, "--max-length")
    target.concurrency = args.engine_concurrency
    if args.chat_template is None and not getattr(target.tokenizer, "chat_template", None):
        raise Eagle3Error(
            f"target {args.target}'s tokenizer has no chat template; pass --chat-template FILE"
        )
    return target


def capture_items_engine(target: ServedTarget, items: list[Item], writer: ShardWriter) -> int:
    """Capture every item through the started engine (target.concurrency requests in flight:
    the engine batches them) and write it; returns the number of tokens captured."""
    # written in the HF path's order (longest first), whatever order the engine finishes in:
    # the same records give the same shards and index, hence the same training batches
    order = sorted(items, key=lambda it: -len(it.input_ids))
    total, t0, last_log = 0, time.monotonic(), time.monotonic()
    pool = target.pool()
    futures = [pool.submit(target.hidden_states, it.input_ids, f"record {it.id}") for it in order]
    try:
        for item, future in zip(order, futures):
            aux, last = target.features(future.result())
            writer.add(item.id, item.input_ids, item.loss_mask, aux, last, dataset=item.dataset)
            total += len(item.input_ids)
            now = time.monotonic()
            if now - last_log >= LOG_EVERY_S:
                last_log = now
                log.info("%d tokens, %.0f tok/s", total, total / (now - t0))
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    return total


def start_capture_engine(args, target: ServedTarget) -> ServedTarget:
    """Start the managed vLLM server the engine flags ask for, with the capture connector."""
    return target.start(
        args.max_length,
        tensor_parallel_size=args.tensor_parallel_size,
        extra_args=args.engine_arg,
        log_path=args.engine_log,
    )


# ----------------------------------------------------------------------------- estimate


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


def estimate_text(
    name: str, hidden: int, tokens: int, dtype: str, rate: float | None, free: int | None
) -> str:
    """What --estimate prints: tokens, bytes per dtype, hours, and the online alternative."""
    lines = [f"capture estimate for {name} (hidden size {hidden}): {tokens:,} tokens"]
    for dt in DTYPES:
        per = bytes_per_token(hidden, dt)
        mark = "  <- --dtype" if dt == dtype else ""
        lines.append(
            f"  {dt:5s} {per:>7,} bytes/token  {human_bytes(per * tokens):>10} on disk{mark}"
        )
    rates = [rate] if rate else ESTIMATE_RATES
    hours = ", ".join(f"{tokens / r / 3600:,.2f} h at {r:,.0f} tok/s" for r in rates)
    lines.append(f"  time: {hours} (measure yours with scripts/bench_capture.py)")
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
    display, _, spec = resolve(name)
    if spec and spec.get("hidden_size"):
        return display, int(spec["hidden_size"])
    facts = target_facts(name)
    return facts["name"], int(facts["hidden_size"])


def count_record_tokens(records: list[dict], name: str, args) -> tuple[int, str]:
    """Total tokens of the records and how they were counted: rendered with the target's
    tokenizer when it is at hand, else the records' usage counts (prompt + completion tokens
    of the last turn)."""
    try:
        from transformers import AutoTokenizer

        _, hf_dir, spec = resolve(name)
        tokenizer = AutoTokenizer.from_pretrained(
            hf_dir, trust_remote_code=bool(spec and spec.get("trust_remote_code"))
        )
        stats: Counter = Counter()
        items = render_all(records, tokenizer, args, stats)
        return sum(len(it.input_ids) for it in items), "rendered with the target's tokenizer"
    except (OSError, ValueError, Eagle3Error):
        usage = [r.get("usage") or {} for r in records if isinstance(r, dict)]
        total = sum(
            int(u.get("prompt_tokens") or 0) + int(u.get("completion_tokens") or 0) for u in usage
        )
        return total, "from the records' usage counts (no tokenizer at hand)"


def free_bytes(path: Path) -> int | None:
    """Free disk space where `path` is (or will be created); None if it cannot be read."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def run_estimate(args) -> int:
    """--estimate: print tokens, bytes and hours of a capture without loading the target."""
    name, hidden = target_dims(args.target)
    if args.tokens:
        tokens, how = args.tokens, "given"
    elif args.data:
        records = read_records(args.data)
        tokens, how = count_record_tokens(records, args.target, args)
        if args.limit:
            tokens = tokens * min(1.0, args.limit / max(len(records), 1))
        tokens = int(tokens)
    else:
        raise Eagle3Error("--estimate needs --tokens N (e.g. 40M) or --data FILES to count")
    free = free_bytes(Path(args.out)) if args.out else None
    print(estimate_text(name, hidden, tokens, args.dtype, args.tokens_per_s, free))
    print(f"  (tokens {how})")
    return 0


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m datagen.capture",
        description="Capture the target's hidden states over finished conversations into shards.",
    )
    p.add_argument(
        "--target", help="registry name, HF model directory or .gguf (required unless --verify)"
    )
    p.add_argument(
        "--data", nargs="+", default=[], help="result files or directories (datagen output)"
    )
    p.add_argument("--out", help="output directory for the shards")
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="bf16", help="storage dtype (default bf16)"
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        help="tokens per captured sequence; a longer record becomes windows (or is cut)",
    )
    p.add_argument(
        "--long-records",
        choices=WINDOW_MODES,
        default="window",
        help="a record longer than --max-length: windows of it that keep --window-context "
        "tokens of preceding context (every generated token captured once), or its first "
        "--max-length tokens",
    )
    p.add_argument(
        "--window-context",
        type=int,
        help="tokens of context each later window keeps (default: half of --max-length)",
    )
    p.add_argument(
        "--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="padded tokens per forward"
    )
    p.add_argument("--shard-mb", type=float, default=256, help="approximate shard size in MB")
    p.add_argument("--limit", type=int, help="capture at most this many records (smoke runs)")
    p.add_argument(
        "--chat-template", help="a Jinja chat template (file or text) instead of the tokenizer's"
    )
    p.add_argument(
        "--template-kwargs",
        type=json.loads,
        default=None,
        help="JSON passed to the template, e.g. '{\"thinking\": true}'",
    )
    p.add_argument(
        "--aux-layers", type=int, nargs=3, help="aux decoder-layer ids (default: the target's)"
    )
    p.add_argument("--device", help="cuda, cpu, ... (default: this process's accelerator)")
    p.add_argument(
        "--device-map", help='"auto" spreads a target larger than one GPU over all visible GPUs'
    )
    p.add_argument(
        "--model-dtype", help="weights dtype: float32, bfloat16 (default: bf16 on GPU, fp32 on CPU)"
    )
    p.add_argument(
        "--no-disk-check", action="store_true", help="start even if the estimate exceeds free disk"
    )
    p.add_argument(
        "--estimate", action="store_true", help="print tokens, bytes and hours, then exit"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every shard of --out (size, xxh3), print the damaged or missing ones, exit "
        "1 if any (no model; a resume recaptures them)",
    )
    p.add_argument("--tokens", type=parse_count, help="token count for --estimate (e.g. 40M)")
    p.add_argument("--tokens-per-s", type=float, help="capture speed for --estimate")
    add_engine_args(p)
    p.add_argument("--engine-concurrency", type=int, default=16, help="engine: requests in flight")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.verify:
        if not args.out:
            p.error("--verify needs --out DIR")
        return args
    if not args.target:
        p.error("--target is required")
    if not args.estimate and not (args.data and args.out):
        p.error("--data and --out are required (or use --estimate)")
    if args.window_context is not None and not 0 < args.window_context < args.max_length:
        p.error(f"--window-context must be in (0, --max-length={args.max_length})")
    args.flags = command_flags(p, args)  # before the template file is replaced by its text
    args.chat_template = load_chat_template(args.chat_template)
    return args


def command_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """This run's flags that shape the data, as a command line with absolute paths, less --data
    and --out (meta.json's ``command`` adds the directory's sources: see recapture_command)."""
    argv: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in NOT_IN_COMMAND | {"data"}:
            continue
        if value is None or value is False or value == action.default:
            continue
        flag = action.option_strings[-1]
        path = os.path.expanduser(str(value))
        if action.dest in ("target", "chat_template") and os.path.exists(path):  # not inline text
            value = os.path.realpath(path)
        if action.nargs == 0:  # store_true
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):  # the = form: values start with dashes
            argv += [f"{flag}={v}" for v in value]
        elif isinstance(value, list | tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _state():
    """accelerate's process state: rank/world/barrier under `accelerate launch` or torchrun."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _gather(state, obj: Any) -> list[Any]:
    """`obj` of every process, in rank order (a plain list of one without a process group)."""
    if state.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * state.num_processes
    dist.all_gather_object(out, obj)
    return out


def capture_command(args, data: list[str], old_sources: list[str]) -> list[str]:
    """meta.json's ``command``: this run's flags, with --data naming every source of the
    directory when earlier runs read others (so a resume finds all of its records)."""
    if not set(old_sources) <= set(data):
        data = sorted(set(old_sources) | set(data))
    target, rest = args.flags[:2], args.flags[2:]  # command_flags lists --target first
    return [*target, "--data", *data, *rest]


def run_verify(args) -> int:
    """--verify: one line per damaged or missing shard of --out, then a summary."""
    out = Path(args.out)
    meta = read_meta(out)
    if meta is None:
        raise Eagle3Error(f"{out} is not a hidden-state capture (no meta.json); nothing to verify")
    entries = read_index(out)
    shards = len({e["shard"] for e in entries})
    problems = verify_shards(out)
    for p in problems:
        print(f"{out / p.shard}: {p.problem}, {p.records} record(s)")
    unfinished = "" if meta.get("complete") else " (the capture did not finish)"
    if problems:
        print(
            f"{len(problems)} of {shards} shards damaged or missing, "
            f"{sum(p.records for p in problems)} of {len(entries)} records{unfinished}; "
            f"recapture exactly those by resuming the capture: {recapture_command(out, meta)}"
        )
        return EXIT_DAMAGED
    how = "size and xxh3"
    if not all("shard_xxh3" in e for e in entries):  # captured before checksums were recorded
        how = "size and xxh3 where recorded, else the size the shard's header says"
    print(f"all {shards} shards of {out} are intact ({len(entries)} records; {how}){unfinished}")
    return 0


def summary_text(stats: Counter, meta: dict) -> str:
    """The one-line summary printed at the end: this run's counts, then the directory's totals."""
    kept = stats.get("kept", 0)
    skipped = {k[len("skipped: ") :]: v for k, v in stats.items() if k.startswith("skipped: ")}
    notes = {k[len("kept: ") :]: v for k, v in stats.items() if k.startswith("kept: ")}
    parts = [f"captured {kept} records in this run"]
    if notes:
        parts.append("of them " + ", ".join(f"{v} {k}" for k, v in sorted(notes.items())))
    if skipped:
        parts.append(
            f"skipped {sum(skipped.values())} ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
            + ")"
        )
    if stats.get("already captured"):
        parts.append(f"{stats['already captured']} already captured")
    if stats.get("dropped: damaged shards"):
        parts.append(
            f"dropped {stats['dropped: damaged shards']} damaged or missing shard(s) holding "
            f"{stats['dropped: records']} records (captured again in this run when in --data)"
        )
    parts.append(
        f"directory: {meta.get('num_records', 0)} records, {meta.get('num_tokens', 0):,} tokens "
        f"({meta.get('num_loss_tokens', 0):,} under the loss mask) in {meta.get('num_shards', 0)} shards"
    )
    return "; ".join(parts)


def check_resumable(out: Path, settings: dict) -> None:
    """Refuse to add to a capture in `out` made with other settings (dtype, target, ...)."""
    old = read_meta(out)
    if old is not None:
        check_meta(old, settings, out)


def load_capture_target(args, state) -> Target:
    """The target on this process's device, with a tokenizer and a chat template to render with."""
    device = args.device or (None if args.device_map else str(state.device))
    target = load_target(
        args.target,
        dtype=args.model_dtype,
        device=device,
        device_map=args.device_map,
        aux_layer_ids=args.aux_layers,
    )
    if target.tokenizer is None:
        raise Eagle3Error(f"target {args.target} has no tokenizer; pass a model directory with one")
    if args.chat_template is None and not getattr(target.tokenizer, "chat_template", None):
        raise Eagle3Error(
            f"target {args.target}'s tokenizer has no chat template; pass --chat-template FILE"
        )
    return target


def capture_meta(target: Target, args) -> dict:
    """meta.json of this capture: the target's identity plus how the records were rendered."""
    return {
        **target_meta(target),
        "max_length": args.max_length,
        "dtype": args.dtype,
        "bytes_per_token": bytes_per_token(target.hidden_size, args.dtype),
        "chat_template": "given" if args.chat_template else "tokenizer",
        "template_kwargs": args.template_kwargs or {},
    }


def check_disk(state, items: list[Item], hidden_size: int, args, out: Path) -> None:
    """Refuse to start (on every process alike) when all processes' tokens will not fit."""
    tokens = sum(_gather(state, sum(len(it.input_ids) for it in items)))
    size = tokens * bytes_per_token(hidden_size, args.dtype)
    free = free_bytes(out)
    if state.process_index == 0:
        log.info(
            "capturing %s tokens (%s in %s) with %d process(es)",
            f"{tokens:,}",
            human_bytes(size),
            args.dtype,
            state.num_processes,
        )
    if free is not None and size > free and not args.no_disk_check:
        raise Eagle3Error(
            f"the capture needs about {human_bytes(size)} but {out} has {human_bytes(free)} "
            "free; free space, use --dtype fp8, or train online (see --estimate)"
        )


def response_origins(records: list[dict], items: list[Item]) -> tuple[Counter, Counter]:
    """How many of the captured items each model and each provider wrote (provenance)."""
    by_id = {str(r["id"]): r for r in records}
    kept = {record_of(it.id) for it in items}  # a long record's windows count once
    models = Counter(str(by_id[i].get("model")) for i in kept)
    providers = Counter(str(by_id[i].get("provider")) for i in kept)
    return models, providers


def merge_provenance(
    out: Path,
    gathered: list,
    sources: list[str],
    processes: int,
    served_by: dict | None = None,
    command: list[str] | None = None,
) -> tuple[Counter, dict]:
    """Process 0, once every writer closed: add this run's sources, origins and counts (from
    every process) to the directory's, merge the index and mark it complete.

    -> (this run's counts over all processes, the final meta)."""
    stats, models, providers = Counter(), Counter(), Counter()
    for s, m, p in gathered:
        stats.update(s)
        models.update(m)
        providers.update(p)
    old = read_meta(out) or {}
    final = finalize(
        out,
        {
            "sources": sorted(set(old.get("sources") or []) | set(sources)),
            "models": dict(Counter(old.get("models") or {}) + models),
            "providers": dict(Counter(old.get("providers") or {}) + providers),
            "summary": dict(stats),
            "processes": processes,
            # the flags a resume repeats: what error messages name to recapture a damaged shard
            **({"command": command} if command else {}),
            # an engine capture: the dtype and attention backend it served (the last run's)
            **({"served_by": served_by} if served_by else {}),
        },
    )
    return stats, final


def run(args) -> int:
    """Capture this process's share of the records; process 0 merges and prints the summary."""
    if args.verify:
        return run_verify(args)
    if args.estimate:
        return run_estimate(args)
    state = _state()
    rank, world = state.process_index, state.num_processes
    out = Path(args.out)
    records = read_records(args.data)
    if args.limit is not None:
        records = records[: args.limit]
    # settings that need no model are checked before a large target loads
    check_resumable(out, {"dtype": args.dtype, "max_length": args.max_length})
    if args.engine and world > 1:
        raise Eagle3Error(
            "--engine runs as one process (the engine batches and spreads the model itself); "
            "drop accelerate launch and use --tensor-parallel-size"
        )
    target = load_engine_target(args) if args.engine else load_capture_target(args, state)
    meta = capture_meta(target, args)
    check_resumable(out, meta)

    stats: Counter = Counter()
    with state.main_process_first():  # process 0 repairs, creates (or re-opens) the directory
        if rank == 0:  # damaged or missing shards are dropped: their records are pending again
            for problem in repair(out):
                log.warning("%s is %s: dropped, its %d record(s) are captured again",
                            out / problem.shard, problem.problem, problem.records)  # fmt: skip
                stats.update({"dropped: damaged shards": 1, "dropped: records": problem.records})
        writer = ShardWriter(
            out,
            meta,
            args.dtype,
            int(args.shard_mb * 2**20),
            part=f"{rank:03d}",
            finalize_on_close=False,
        )
    done = {e["id"] for e in read_index(out)}
    pending = select(records, done, stats)
    state.wait_for_everyone()  # all read what is done before anyone writes: the same split
    mine = my_slice(pending, rank, world)
    lengths: list[tuple[int, int, int]] = []
    items = render_all(mine, target.tokenizer, args, stats, lengths, done)
    report_lengths(state, lengths, args)
    check_disk(state, items, target.hidden_size, args, out)
    models, providers = response_origins(mine, items)

    if args.engine and items:
        start_capture_engine(args, target)
        t0 = time.monotonic()
        try:
            with writer:  # on an error or Ctrl-C, what was captured is written: re-run to resume
                captured = capture_items_engine(target, items, writer)
        finally:
            target.stop()
        seconds = time.monotonic() - t0
    else:
        t0 = time.monotonic()
        with writer:  # on an error or Ctrl-C, what was captured is written: re-run to resume
            captured = capture_items(target, items, writer, args.batch_tokens)
        seconds = time.monotonic() - t0
    log.info(
        "process %d: %d tokens in %.1f s (%.0f tok/s)",
        rank,
        captured,
        seconds,
        captured / max(seconds, 1e-9),
    )

    gathered = _gather(state, (stats, models, providers))
    state.wait_for_everyone()
    if rank == 0:
        sources = [str(Path(p).expanduser().resolve()) for p in args.data]
        served_by = (
            {"engine": args.engine, **target.serving} if args.engine and target.serving else None
        )
        command = capture_command(args, sources, (read_meta(out) or {}).get("sources") or [])
        stats, final = merge_provenance(out, gathered, sources, world, served_by, command)
        print(summary_text(stats, final))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
