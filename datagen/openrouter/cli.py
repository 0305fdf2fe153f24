"""Generate target responses on OpenRouter within a hard dollar budget, resumably.

    OPENROUTER_API_KEY=sk-or-... python -m datagen.openrouter --budget 100 \\
        [--config datagen/openrouter/kimi-k2.5.yaml] [--prompts FILE.jsonl ...] [--out DIR] \\
        [--concurrency 2000] [--max-tokens N] [--tokens-per-dataset N] [--model SLUG] \\
        [--base-url URL] [--plan] [--audit-every N [--audit-target NAME_OR_PATH]] \\
        [--no-wait-for-orphans] [--weight-by EVAL.json [--weight-drafter NAME]]

Reads the model's endpoints, keeps only providers at or above the native precision (see
datagen.openrouter.providers), and generates every prompt of the config's dataset mix, or with
``--prompts`` only those files' prompts (plus the config datasets ``--datasets`` names), into
``DIR/<dataset>.jsonl``; every charged request goes to ``DIR/ledger.jsonl``. ``--budget`` is
what DIR may spend over all runs; re-running the same command resumes. ``--plan`` prints the
provider table and what the budget buys (without and with prompt caching), and sends no chat
request. ``--weight-by EVAL.json`` (an ``eagle3.evaluate --held-out DIR --json`` file) tilts
the datasets' output-token budgets toward those with the lowest held-out tau and prints old
and new (datagen.openrouter.plan.weight_by), for the plan and the run alike.

The API key goes with every request. ``--plan`` runs without one (OpenRouter's endpoint
listing is public); a server that wants one for it gets a one-line error. Before its first chat
request a run writes the key's usage (``GET /key``) to the ledger; then it settles what earlier
runs left at worst case (datagen.openrouter.settle: ``GET /generation`` for known generation
ids, the key's usage growth for the rest) and prints one ``ledger:`` line per decision. What a
killed run left in flight is settled by the resumed run itself, while it runs, once that run's
last event is ``request_timeout_s`` (+5 s) old; if only that money stops the run, it waits for
the settlement with a countdown (``--no-wait-for-orphans``: exit 75 naming the time instead).

``--audit-every N`` loads a local copy of the target (``--audit-target``, default the config's
``audit_target``) and, every N finished prompts, scores a sample of each provider's responses
under it (datagen.online_audit.OnlineAudit). A provider whose responses stand out is added to the
rule's ``ignore`` list for the rest of the run, and the decision and its reason are appended to
``DIR/audit.jsonl``; later runs on DIR read that file and keep ignoring it (audit on or off).

Exit codes: 0 all work done; 75 stopped with work left (budget, a dataset's token budget, 402
out of credits, Ctrl-C/SIGTERM, the audit excluded every provider, a killed run's requests hold
the budget with ``--no-wait-for-orphans``), nothing lost, re-run to
continue; 2 bad input or configuration (one line ``error: ...``); 69 OpenRouter failed
(unreachable, an HTTP error: one line ``error: ...`` naming what failed and what to do; results
and ledger kept, re-run the same command once it answers); 1 a bug (with a traceback). The last
line printed is the summary: prompts done / remaining, output tokens, dollars spent of the
budget (and the providers the audit has excluded for DIR).

This module is the command line alone; the run itself is :mod:`datagen.openrouter.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from pathlib import Path

from datagen.openrouter.client import PUBLIC_BASE_URL
from datagen.openrouter.config import DEFAULT_CONFIG, GenConfig, load_config
from datagen.openrouter.plan import weight_by
from datagen.openrouter.run import run
from eagle3.cli import EXIT_TEMPFAIL, HelpFormatter, run_cli
from eagle3.errors import ConfigError

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m datagen.openrouter",
        description="Generate target responses on OpenRouter within a hard budget (resumable).",
    )
    ap.add_argument(
        "--budget", type=float, required=True, help="USD this --out may spend, all runs"
    )
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="datagen YAML (model, mix)")
    ap.add_argument("--prompts", nargs="+", default=[], metavar="FILE", help="ad-hoc prompt files")
    ap.add_argument(
        "--datasets", default=None, help="comma list of config datasets to run; '' = none"
    )
    ap.add_argument("--out", default=None, help="output directory (default: config out_dir)")
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight (2000)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (config)")
    ap.add_argument("--tokens-per-dataset", type=int, default=None, help="output-token budget")
    ap.add_argument("--model", default=None, help="OpenRouter slug author/name (config)")
    ap.add_argument("--base-url", default=None, help="default: $OPENROUTER_BASE_URL or public")
    ap.add_argument("--plan", action="store_true", help="print providers and projection; no chat")
    ap.add_argument("--grace", type=float, default=None, help="seconds for in-flight on Ctrl-C")
    ap.add_argument("--log-every", type=float, default=None, help="seconds between log lines")
    ap.add_argument(
        "--audit-every",
        type=int,
        default=0,
        metavar="N",
        help="audit providers against the local target every N prompts (0 = off)",
    )
    ap.add_argument(
        "--audit-target", default=None, help="target for the audit (default: config audit_target)"
    )
    ap.add_argument(
        "--no-wait-for-orphans",
        action="store_true",
        help="when only a killed run's requests of unknown cost hold the budget, exit 75 naming "
        "the time to resume instead of waiting for OpenRouter's figures to settle them",
    )
    ap.add_argument(
        "--weight-by",
        default=None,
        metavar="EVAL.json",
        help="tilt the datasets' token budgets toward low held-out tau (eagle3.evaluate "
        "--held-out DIR --json EVAL.json); the plan prints old and new",
    )
    ap.add_argument(
        "--weight-drafter",
        default=None,
        metavar="NAME",
        help="--weight-by: the drafter whose tau counts, when the file holds several",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap.parse_args(argv)


def apply_overrides(cfg: GenConfig, args: argparse.Namespace) -> GenConfig:
    problems = []
    if not (args.budget >= 0 and math.isfinite(args.budget)):
        problems.append(f"--budget must be a non-negative number of USD, got {args.budget}")
    for flag, key in (
        ("concurrency", "concurrency"),
        ("max_tokens", "max_tokens"),
        ("tokens_per_dataset", "tokens_per_dataset"),
    ):
        v = getattr(args, flag)
        if v is not None:
            if v <= 0:
                problems.append(f"--{flag.replace('_', '-')} must be positive, got {v}")
            setattr(cfg, key, v)
    if args.model is not None:
        if "/" not in args.model:
            problems.append(f"--model must be 'author/slug', got {args.model!r}")
        cfg.model = args.model
    if args.grace is not None:
        cfg.grace_s = args.grace
    if args.log_every is not None:
        cfg.log_every_s = args.log_every
    if args.tokens_per_dataset is not None:
        for d in cfg.datasets:
            d.tokens = None  # the flag overrides every dataset
    if args.weight_drafter is not None and args.weight_by is None:
        problems.append("--weight-drafter needs --weight-by EVAL.json")
    if args.audit_every < 0:
        problems.append(f"--audit-every must be >= 0 (0 = off), got {args.audit_every}")
    if args.audit_target is not None:
        cfg.audit_target = args.audit_target
    if args.audit_every > 0 and not cfg.audit_target:
        problems.append(
            "--audit-every needs a local copy of the target: pass --audit-target NAME_OR_PATH "
            "or set audit_target in the config"
        )
    if args.prompts and args.datasets is None:
        if cfg.datasets:
            log.info(
                "--prompts without --datasets: only those prompts; the config's %d dataset(s) "
                "are not run (name them with --datasets to run them too)",
                len(cfg.datasets),
            )
        cfg.datasets = []  # the prompt files someone names are the prompts they mean
    elif args.datasets is not None:
        wanted = [n for n in args.datasets.split(",") if n]
        names = {d.name for d in cfg.datasets}
        unknown = [n for n in wanted if n not in names]
        if unknown:
            problems.append(f"--datasets: {unknown} not in the config ({sorted(names)})")
        cfg.datasets = [d for d in cfg.datasets if d.name in wanted]
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def connection(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, API key) from the flags and the environment."""
    base_url = args.base_url or os.environ.get("OPENROUTER_BASE_URL") or PUBLIC_BASE_URL
    api_key = os.environ.get("OPENROUTER_API_KEY", "")
    if not args.plan and not api_key:
        raise ConfigError("OPENROUTER_API_KEY is not set: export your OpenRouter key")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url {base_url!r} is not an http(s) URL")
    return base_url, api_key


def run_sync(args: argparse.Namespace) -> int:
    """The run the flags ask for, on a new event loop. A ConfigError (exit 2) or a RemoteError
    from OpenRouter (exit 69) goes up to ``run_cli``, which prints it as one line."""
    try:
        cfg = load_config(args.config)
        mix = [d.name for d in cfg.datasets]  # the whole mix, before --datasets / --prompts
        cfg = apply_overrides(cfg, args)
        if args.weight_by is not None:  # the datasets this run generates are tilted
            lines = weight_by(cfg, args.weight_by, args.weight_drafter, mix)
            print("\n".join(lines), flush=True)
        base_url, api_key = connection(args)
        return asyncio.run(
            run(
                cfg,
                out_dir=Path(args.out or cfg.out_dir),
                prompt_files=args.prompts,
                budget=args.budget,
                base_url=base_url,
                api_key=api_key,
                plan=args.plan,
                audit_every=args.audit_every,
                wait_for_orphans=not args.no_wait_for_orphans,
            )
        )
    except KeyboardInterrupt:  # before the requester took over the signals: nothing was sent
        print("error: interrupted before generation started", file=sys.stderr, flush=True)
        return EXIT_TEMPFAIL


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)  # on the package logger: main() may run twice
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    pkg = logging.getLogger("datagen")
    pkg.addHandler(handler)
    pkg.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return run_cli(lambda: run_sync(args))
    finally:
        pkg.removeHandler(handler)
