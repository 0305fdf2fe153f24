"""``python -m datagen.capture``: run the target over finished conversations, store hidden states.

Each record (``eagle3.data.records`` format, from ``datagen.openrouter`` or ``datagen.local``) is
rendered with the target's chat template into token ids and a loss mask (:mod:`datagen.render`),
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
    python -m datagen.capture --serve --target smollm2-135m-q4 --host 0.0.0.0 --port 8100  # per node
    python -m datagen.capture --engine-url http://n1:8100 http://n2:8100 --target smollm2-135m-q4 \
        --data out/responses --out out/shards    # the records shared across running servers

``--engine vllm`` takes the hidden states from a managed vLLM server instead of HF in-process
(vLLM's ``extract_hidden_states`` method with the CPU-safe connector in eagle3/engine/plugin/):
each record's rendered token ids go to /v1/completions as a token-id prompt (max_tokens 1),
the engine returns the aux layers (our ids + 1 in vLLM's convention) and the pre-norm state
after the last layer, and the target's final norm (its weight read alone from the
safetensors) is applied here. The returned token ids are checked against ours; the shards,
meta.json and resume are the HF path's: both targets go through one loop (`capture_items`,
the same batches in the same order), the served one with every batch's rows in flight at once.

Across servers: ``--serve`` starts one capture server (a managed vLLM with the connector, on
``--host``/``--port``) and keeps it up until Ctrl-C or SIGTERM; ``--engine-url URL...`` captures
through running ones: one process, one writer, one index and one meta.json, each row a request
to the server with the fewest in flight (eagle3.engine.served_target), so the shards are those
of a one-server capture. A server that dies mid-run is dropped with a warning and the others
take its requests; the hidden-state files a server writes are read by path, so a server on
another host needs TMPDIR on a filesystem both see, at the same path.

Scale-out: under ``accelerate launch`` (or ``torchrun``) every process captures its own slice
of the records (one process per GPU, or one per node with ``--device-map auto`` for a target
larger than one GPU), writing its own shards; process 0 merges the index at the end.
Resume: re-run the same command; records already in complete shards are skipped. A resume
first verifies every shard (size and xxh3, :mod:`eagle3.data.shards` Integrity) and drops the
damaged or missing ones, so it captures exactly their records again and leaves every other
shard byte-identical. ``--verify`` only checks: one line per damaged or missing shard and a
summary; exit 0 when all are intact, 1 when not (2, as always, for bad input).
``--estimate`` prints what a capture would cost and loads no weights (:mod:`datagen.estimate`).
Progress (:mod:`eagle3.progress`) is counted in tokens, which the time goes with (batches run
longest first): the selected records' tokens in complete shards count as already done; the
last line says what the directory holds and where.

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
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datagen.estimate import free_bytes, human_bytes, parse_count, run_estimate
from datagen.render import Item, Rendering, render_all
from eagle3.cli import EXIT_ERROR, HelpFormatter, run_main
from eagle3.data.chat import check_renderable, load_chat_template
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
from eagle3.data.windows import lengths_line, record_of
from eagle3.engine.served_target import ServedTarget, describe_served_target
from eagle3.engine.server import EngineSettings, add_engine_args
from eagle3.errors import Eagle3Error, RemoteError
from eagle3.progress import Progress, count
from eagle3.target import ResolvedTarget, TargetModel, load_target, resolve

log = logging.getLogger("datagen.capture")

DEFAULT_MAX_LENGTH = 4096
DEFAULT_BATCH_TOKENS = 16384  # padded tokens per forward; lower it if the target runs out of memory
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
    "engine_url",  # which servers ran the forwards changes nothing stored
    "serve",
    "host",
    "port",
}


@dataclass(frozen=True)
class CaptureSettings:
    """One run's flags, parsed and checked once (parse_args); the helpers below read these."""

    target: str | None  # registry name, HF model directory or .gguf; None only with --verify
    data: list[str]  # result files or directories (datagen output)
    out: str | None  # the shard directory
    dtype: str  # storage dtype (eagle3.data.shards.DTYPES)
    rendering: Rendering  # --max-length, --long-records, --window-context, the chat template
    batch_tokens: int  # padded tokens per forward
    shard_mb: float
    limit: int | None  # capture at most this many records
    aux_layers: list[int] | None  # None: the target's
    device: str | None
    device_map: str | None
    model_dtype: str | None
    no_disk_check: bool
    verify: bool  # only check the shards of --out
    estimate: bool  # only print what the capture would cost (datagen.estimate)
    tokens: int | None  # --estimate's token count
    tokens_per_s: float | None  # --estimate's capture speed
    engine: EngineSettings  # kind "vllm": a managed server runs the forwards (eagle3.engine)
    engine_concurrency: int  # engine requests in flight
    engine_urls: list[str]  # --engine-url: running capture servers to share the requests
    serve: bool  # only start a capture server and keep it up (--host, --port)
    host: str
    port: int | None
    flags: list[str]  # the flags that shape the data (meta.json's command: command_flags)


# ----------------------------------------------------------------------------- records


def report_lengths(state, lengths: list[tuple[int, int, int]], rendering: Rendering) -> None:
    """Process 0 prints this run's records' length distribution and what a cut at
    --max-length would drop (every process's records)."""
    rows = [row for part in _gather(state, lengths) for row in part]
    if state.process_index == 0 and rows:
        cuts = [(d, t) for _, d, t in rows]
        line = lengths_line([n for n, _, _ in rows], cuts, rendering.max_length)
        how = "windows" if rendering.long_records == "window" else "cut"
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


def capture_items(
    target: TargetModel,
    items: list[Item],
    writer: ShardWriter,
    batch_tokens: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> int:
    """Capture and write every item, in `batches` (longest first) whatever the target: the
    same records give the same shards and index, hence the same training batches. Returns the
    number of tokens captured; `on_batch(sequences, tokens)` hears of each written batch.

    An in-process target runs one batch at a time. A served one is sent every batch at once
    (one request per row, its `concurrency` in flight: the engine batches them, and a batch of
    a few long rows does not leave the engine idle); each batch is written when its rows are
    back, whatever order the engine finishes them in."""
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    todo = batches(items, batch_tokens)
    ahead = [target.capture_async(*pad(b, pad_id)) for b in todo] if target.served else []
    total = 0
    try:
        for n, batch in enumerate(todo, 1):
            # [B, T, 3H], [B, T, H]
            aux, last = ahead[n - 1].result() if ahead else target.capture(*pad(batch, pad_id))
            writer.add_batch(
                [it.id for it in batch],
                [it.input_ids for it in batch],
                [it.loss_mask for it in batch],
                aux,
                last,
                datasets=[it.dataset for it in batch],
            )
            tokens = sum(len(it.input_ids) for it in batch)
            total += tokens
            if on_batch is not None:
                on_batch(len(batch), tokens)
    except BaseException:  # an error or Ctrl-C: assemble no more (target.stop() drops requests)
        for future in ahead:
            future.cancel()
        raise
    return total


# ----------------------------------------------------------------------------- target


def load_capture_target(s: CaptureSettings, state, model: ResolvedTarget) -> TargetModel:
    """The target (`model`: --target resolved once) with a tokenizer and a chat template to
    render with: in-process on this process's device, or (--engine) as vLLM will serve it, not
    started yet."""
    if s.engine.kind or s.engine_urls:
        target = describe_served_target(
            model, s.aux_layers, "--aux-layers", concurrency=s.engine_concurrency
        )
        target.check_length(s.rendering.max_length, "--max-length")
    else:
        target = load_target(
            model,
            dtype=s.model_dtype,
            device=s.device or (None if s.device_map else str(state.device)),
            device_map=s.device_map,
            aux_layer_ids=s.aux_layers,
        )
    check_renderable(target.tokenizer, s.rendering.chat_template, s.target)
    return target


def start_capture_engine(s: CaptureSettings, target: ServedTarget) -> ServedTarget:
    """Attach to the running servers of --engine-url, or start the managed vLLM server the
    engine flags ask for, with the capture connector."""
    if s.engine_urls:
        return target.attach(*s.engine_urls)
    return target.start(
        s.rendering.max_length,
        tensor_parallel_size=s.engine.tensor_parallel_size,
        extra_args=list(s.engine.extra_args),
        log_path=s.engine.log_path,
        host=s.host,
        port=s.port,
    )


def run_serve(s: CaptureSettings) -> int:
    """--serve: one capture server for --target, up until Ctrl-C or SIGTERM (then stopped with
    its engine and temp dir); RemoteError (exit 69) if its engine dies."""
    import signal
    import socket

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # SIGTERM stops it as Ctrl-C does: the engine goes with it

    signal.signal(signal.SIGTERM, interrupt)
    target = load_capture_target(s, None, resolve(s.target))
    start_capture_engine(s, target)
    server = target.server
    host = socket.getfqdn() if s.host in ("0.0.0.0", "::") else s.host
    print(f"capture server for {target.name}: http://{host}:{server.port} (Ctrl-C stops it); "
          f"capture through it with --engine-url http://{host}:{server.port}", flush=True)  # fmt: skip
    try:
        while server.running():
            time.sleep(1)
        raise RemoteError(f"the capture server's engine exited (log {server.log_path})")
    except KeyboardInterrupt:
        return 0
    finally:
        target.stop()


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
    p.add_argument(
        "--engine-url",
        nargs="+",
        default=[],
        metavar="URL",
        help="capture through these running capture servers (--serve), the records shared "
        "among them, instead of --engine's managed one",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="only start a capture server for --target (the engine flags apply) and keep it up "
        "until Ctrl-C; give its URL to --engine-url",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="--serve: the address to listen on (0.0.0.0: all)"
    )
    p.add_argument("--port", type=int, help="--serve: the port (default: a free one)")
    return p


def parse_args(argv: list[str] | None) -> CaptureSettings:
    p = build_parser()
    args = p.parse_args(argv)
    if args.verify:
        if not args.out:
            p.error("--verify needs --out DIR")
    else:
        if not args.target:
            p.error("--target is required")
        if args.engine and args.engine_url:
            p.error("--engine starts a server, --engine-url uses running ones: pass one of them")
        if args.serve and args.engine_url:
            p.error("--serve starts a capture server; --engine-url is for the capture using it")
        if args.serve:
            args.engine = args.engine or "vllm"  # what a capture server is
        if not args.estimate and not args.serve and not (args.data and args.out):
            p.error("--data and --out are required (or use --estimate)")
        if args.window_context is not None and not 0 < args.window_context < args.max_length:
            p.error(f"--window-context must be in (0, --max-length={args.max_length})")
    rendering = Rendering(
        max_length=args.max_length,
        long_records=args.long_records,
        window_context=args.window_context,
        chat_template=load_chat_template(args.chat_template),
        template_kwargs=args.template_kwargs,
    )
    return CaptureSettings(
        target=args.target,
        data=args.data,
        out=args.out,
        dtype=args.dtype,
        rendering=rendering,
        batch_tokens=args.batch_tokens,
        shard_mb=args.shard_mb,
        limit=args.limit,
        aux_layers=args.aux_layers,
        device=args.device,
        device_map=args.device_map,
        model_dtype=args.model_dtype,
        no_disk_check=args.no_disk_check,
        verify=args.verify,
        estimate=args.estimate,
        tokens=args.tokens,
        tokens_per_s=args.tokens_per_s,
        engine=EngineSettings.from_args(args),
        engine_concurrency=args.engine_concurrency,
        engine_urls=args.engine_url,
        serve=args.serve,
        host=args.host,
        port=args.port,
        flags=command_flags(p, args),  # the template as given: its file's path, not its text
    )


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


def capture_command(flags: list[str], data: list[str], old_sources: list[str]) -> list[str]:
    """meta.json's ``command``: this run's flags, with --data naming every source of the
    directory when earlier runs read others (so a resume finds all of its records)."""
    if not set(old_sources) <= set(data):
        data = sorted(set(old_sources) | set(data))
    target, rest = flags[:2], flags[2:]  # command_flags lists --target first
    return [*target, "--data", *data, *rest]


def run_verify(out: Path) -> int:
    """--verify: one line per damaged or missing shard of --out, then a summary."""
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


def produced_line(out: Path, meta: dict) -> str:
    """The closing line: what the directory holds, where."""
    sequences = meta.get("num_records", 0)
    records = len({record_of(e["id"]) for e in read_index(out)})
    held = f"{count(records)} records" + (
        f" as {count(sequences)} sequences (long ones as windows)" if sequences != records else ""
    )
    return (
        f"capture: {held}, {count(meta.get('num_tokens', 0))} tokens in "
        f"{meta.get('num_shards', 0)} shards -> {out} (meta.json, index.jsonl)"
    )


def already_tokens(index: list[dict], records: list[dict], world: int) -> int:
    """Tokens of this run's records that earlier runs captured (their whole records or some
    windows): the "already done" of the progress count. 0 with several processes, where
    process 0 counts its own share only."""
    if world > 1:
        return 0
    wanted = {str(r.get("id")) for r in records if isinstance(r, dict)}
    return sum(e["length"] for e in index if record_of(e["id"]) in wanted)


def capture_progress(
    state, items: list[Item], already: int
) -> tuple[Progress, Callable[[int, int], None]]:
    """Process 0's count of tokens (the unit the time goes with: batches run longest first)
    and sequences; the others' is silent."""
    world = state.num_processes
    stage = "capture" if world == 1 else f"capture (process 0 of {world}, its share)"
    sequences = {"done": 0}
    progress = Progress(
        stage,
        already + sum(len(it.input_ids) for it in items),
        "tokens",
        already=already,
        status=lambda: f"{sequences['done']:,}/{len(items):,} sequences in this run",
        mode=None if state.process_index == 0 else "off",
    )

    def on_batch(n: int, tokens: int) -> None:
        sequences["done"] += n
        progress.update(tokens)

    return progress, on_batch


def check_resumable(out: Path, settings: dict) -> None:
    """Refuse to add to a capture in `out` made with other settings (dtype, target, ...)."""
    old = read_meta(out)
    if old is not None:
        check_meta(old, settings, out)


def capture_meta(
    target: TargetModel, dtype: str, rendering: Rendering, model: ResolvedTarget
) -> dict:
    """meta.json of this capture: the target's identity (its registry name where the registry
    knows it, and the local directory it was read from: offline training reads the target's
    embeddings and lm_head there when its recipe names the registry entry), plus how the
    records were rendered."""
    return {
        **target_meta(target),
        "target_dir": str(Path(model.hf_dir).resolve()) if model.is_local else None,
        "max_length": rendering.max_length,
        "dtype": dtype,
        "bytes_per_token": bytes_per_token(target.hidden_size, dtype),
        "chat_template": "given" if rendering.chat_template else "tokenizer",
        "template_kwargs": rendering.template_kwargs or {},
    }


def check_disk(state, items: list[Item], hidden_size: int, s: CaptureSettings, out: Path) -> None:
    """Refuse to start (on every process alike) when all processes' tokens will not fit."""
    tokens = sum(_gather(state, sum(len(it.input_ids) for it in items)))
    size = tokens * bytes_per_token(hidden_size, s.dtype)
    free = free_bytes(out)
    if state.process_index == 0:
        log.info(
            "capturing %s tokens (%s in %s) with %d process(es)",
            f"{tokens:,}",
            human_bytes(size),
            s.dtype,
            state.num_processes,
        )
    if free is not None and size > free and not s.no_disk_check:
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


def run(s: CaptureSettings) -> int:
    """Capture this process's share of the records; process 0 merges and prints the summary."""
    if s.verify:
        return run_verify(Path(s.out))
    if s.serve:
        return run_serve(s)
    if s.estimate:
        return run_estimate(s.target, s.rendering, s.dtype, data=s.data, limit=s.limit,
                            out=s.out, tokens=s.tokens, tokens_per_s=s.tokens_per_s)  # fmt: skip
    state = _state()
    rank, world = state.process_index, state.num_processes
    out = Path(s.out)
    records = read_records(s.data)
    if s.limit is not None:
        records = records[: s.limit]
    # settings that need no model are checked before a large target loads
    check_resumable(out, {"dtype": s.dtype, "max_length": s.rendering.max_length})
    if s.engine.kind and world > 1:
        raise Eagle3Error(
            "--engine runs as one process (the engine batches and spreads the model itself); "
            "drop accelerate launch and use --tensor-parallel-size, or start a capture server "
            "per node (--serve) and pass their URLs to one capture with --engine-url"
        )
    model = resolve(s.target)
    target = load_capture_target(s, state, model)
    meta = capture_meta(target, s.dtype, s.rendering, model)
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
            s.dtype,
            int(s.shard_mb * 2**20),
            part=f"{rank:03d}",
            finalize_on_close=False,
        )
    index = read_index(out)
    done = {e["id"] for e in index}
    pending = select(records, done, stats)
    state.wait_for_everyone()  # all read what is done before anyone writes: the same split
    mine = my_slice(pending, rank, world)
    lengths: list[tuple[int, int, int]] = []
    items = render_all(mine, target.tokenizer, s.rendering, stats, lengths, done)
    report_lengths(state, lengths, s.rendering)
    check_disk(state, items, target.hidden_size, s, out)
    models, providers = response_origins(mine, items)

    if target.served and items:
        start_capture_engine(s, target)
    t0 = time.monotonic()
    progress, on_batch = capture_progress(state, items, already_tokens(index, records, world))
    try:
        with writer:  # on an error or Ctrl-C, what was captured is written: re-run to resume
            captured = capture_items(target, items, writer, s.batch_tokens, on_batch)
    finally:
        target.stop()  # the engine, when one was started
        progress.close()  # how far it got, also when interrupted
    seconds = time.monotonic() - t0  # every process's own (process 0's is in its progress too)
    log.info("process %d: %d tokens in %.1f s (%.0f tok/s)",
             rank, captured, seconds, captured / max(seconds, 1e-9))  # fmt: skip

    gathered = _gather(state, (stats, models, providers))
    state.wait_for_everyone()
    if rank == 0:
        sources = [str(Path(p).expanduser().resolve()) for p in s.data]
        served_by = None
        if target.served and target.serving:  # the managed server's dtype and backend
            served_by = {"engine": s.engine.kind, **target.serving}
        elif target.served and target.sent:  # running servers: who answered how many rows
            served_by = {"engine": "vllm", "servers": dict(sorted(target.sent.items()))}
        command = capture_command(s.flags, sources, (read_meta(out) or {}).get("sources") or [])
        stats, final = merge_provenance(out, gathered, sources, world, served_by, command)
        print(summary_text(stats, final))
        print(produced_line(out, final), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
