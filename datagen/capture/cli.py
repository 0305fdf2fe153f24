"""``python -m datagen.capture``: run the target over finished conversations, store hidden states.

Each record (``eagle3.data.records`` format, from ``datagen.openrouter`` or ``datagen.local``) is
rendered with the target's chat template into token ids and a loss mask (:mod:`datagen.render`),
the target runs once over it (:meth:`eagle3.targets.Target.capture`: the 3 aux layers and the
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
import os
from pathlib import Path

from datagen.capture.pipeline import capture
from datagen.capture.settings import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_LENGTH, CaptureSettings
from datagen.capture.target import run_serve
from datagen.estimate import parse_count, run_estimate
from datagen.render import Rendering
from eagle3.cli import EXIT_ERROR, HelpFormatter, run_main
from eagle3.data.chat import load_chat_template
from eagle3.data.shards import DTYPES, read_index, read_meta, recapture_command, verify_shards
from eagle3.data.windows import MODES as WINDOW_MODES
from eagle3.engine.server import EngineSettings, add_engine_args
from eagle3.errors import Eagle3Error

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
    "engine_startup_timeout",
    "engine_url",  # which servers ran the forwards changes nothing stored
    "serve",
    "host",
    "port",
}


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
        "--dtype",
        default="bf16",
        metavar="{" + ",".join(DTYPES) + "}",
        help="storage dtype of the hidden states; fp8-aux: the aux states in fp8, the last "
        "(the soft labels' source) in bf16 (docs/formats.md#shards)",
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
    add_engine_capture_args(p)
    return p


def add_engine_capture_args(p: argparse.ArgumentParser) -> None:
    """Capture through an engine: the managed one's flags, running capture servers, --serve."""
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


def parse_args(argv: list[str] | None) -> CaptureSettings:
    p = build_parser()
    args = p.parse_args(argv)
    if args.dtype not in DTYPES:  # checked here, not by argparse: one line, exit 2
        raise Eagle3Error(f"--dtype {args.dtype}: not a storage dtype; use one of "
                          f"{', '.join(DTYPES)}")  # fmt: skip
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


def run(s: CaptureSettings) -> int:
    """--verify, --serve, --estimate, or (the default) a capture: datagen.capture.pipeline."""
    if s.verify:
        return run_verify(Path(s.out))
    if s.serve:
        return run_serve(s)
    if s.estimate:
        return run_estimate(s.target, s.rendering, s.dtype, data=s.data, limit=s.limit,
                            out=s.out, tokens=s.tokens, tokens_per_s=s.tokens_per_s)  # fmt: skip
    return capture(s)


def run_verify(out: Path) -> int:
    """--verify: is every shard of --out whole? One line per damaged or missing shard, then a
    summary (no model; a resume recaptures the rest)."""
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


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)
