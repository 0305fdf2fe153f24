"""Generate target responses on OpenRouter within a hard dollar budget, resumably.

    OPENROUTER_API_KEY=sk-or-... python -m datagen.openrouter --budget 100 \\
        [--config configs/datagen/kimi-k2.5.yaml] [--prompts FILE.jsonl ...] [--out DIR] \\
        [--concurrency 2000] [--max-tokens N] [--tokens-per-dataset N] [--model SLUG] \\
        [--base-url URL] [--plan] [--audit-every N [--audit-target NAME_OR_PATH]]

Reads the model's endpoints, keeps only providers at or above the native precision (see
datagen.providers), and generates every prompt of the config's dataset mix, or with
``--prompts`` only those files' prompts (plus the config datasets ``--datasets`` names), into
``DIR/<dataset>.jsonl``; every charged request goes to ``DIR/ledger.jsonl``. ``--budget`` is
what DIR may spend over all runs; re-running the same command resumes. ``--plan`` prints the
provider table and what the budget buys (without and with prompt caching), and sends no chat
request.

The API key goes with every request. ``--plan`` runs without one (OpenRouter's endpoint
listing is public); a server that wants one for it gets a one-line error. Before its first chat
request a run writes the key's usage (``GET /key``) to the ledger; then it settles what earlier
runs left at worst case (datagen.ledger: ``GET /generation`` for known generation ids, the key's
usage growth for the rest) and prints one ``ledger:`` line per decision.

``--audit-every N`` loads a local copy of the target (``--audit-target``, default the config's
``audit_target``) and, every N finished prompts, scores a sample of each provider's responses
under it (datagen.audit.OnlineAudit). A provider whose responses stand out is added to the
rule's ``ignore`` list for the rest of the run, and the decision and its reason are appended to
``DIR/audit.jsonl``; later runs on DIR read that file and keep ignoring it (audit on or off).

Exit codes: 0 all work done; 75 stopped with work left (budget, a dataset's token budget, 402
out of credits, Ctrl-C/SIGTERM, the audit excluded every provider), nothing lost, re-run to
continue; 2 bad input or configuration (one line ``error: ...``); 1 anything unexpected. The
last line printed is the summary: prompts done / remaining, output tokens, dollars spent of the
budget (and the providers the audit has excluded for DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from datagen import providers, retry
from datagen.engine import Engine, Outcome, Settings
from datagen.ledger import Ledger, decide_settlement
from datagen.plan import plan_text, usd_per_m_out
from eagle3.cli import EXIT_ERROR, EXIT_OK, EXIT_TEMPFAIL, HelpFormatter, run_cli
from eagle3.config import load_typed
from eagle3.data.prompts import Prompt, dedupe, load_prompts
from eagle3.data.records import ResultStore
from eagle3.errors import ConfigError

log = logging.getLogger("datagen.openrouter")

PUBLIC_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/datagen/kimi-k2.5.yaml"
AUDIT_LOG = "audit.jsonl"  # in --out: audit checks and exclusions


@dataclass
class DatasetSpec:
    name: str = ""
    source: str = ""  # embedded name, hf:org/name[:split], or a file
    columns: dict | None = None  # normalize's field -> the source's column
    limit: int | None = None
    tokens: int | None = None  # output-token budget; None = the config's tokens_per_dataset


@dataclass
class GenConfig:
    model: str = "moonshotai/kimi-k2.5"
    native_precision: str = "int4"
    ignore: list[str] = field(default_factory=lambda: ["fireworks", "baseten"])
    max_tokens: int = 16384
    temperature: float = 0.7
    reasoning: dict | None = None  # e.g. {effort: high}, sent as the request's reasoning
    concurrency: int = 2000
    max_attempts: int = 6
    retry_initial_s: float = 0.5
    retry_max_s: float = 8.0
    request_timeout_s: float = 900.0
    grace_s: float = 30.0
    log_every_s: float = 30.0
    expected_output_tokens: int = 2000
    tokens_per_dataset: int = 10_000_000
    out_dir: str = "data/openrouter/kimi-k2.5"
    audit_target: str | None = None  # local copy of the target for --audit-every
    audit_device_map: str | None = None  # e.g. auto: spread the audit target over the GPUs
    datasets: list[DatasetSpec] = field(default_factory=list)

    def token_budget(self, dataset: str) -> int:
        """Output tokens ``dataset`` may use: its own ``tokens``, else tokens_per_dataset."""
        for d in self.datasets:
            if d.name == dataset and d.tokens is not None:
                return d.tokens
        return self.tokens_per_dataset


def check(cfg: GenConfig, problems: list[str]) -> None:
    """Value checks of a config whose fields all have the right types."""
    for key in (
        "max_tokens",
        "concurrency",
        "max_attempts",
        "expected_output_tokens",
        "tokens_per_dataset",
    ):
        if getattr(cfg, key) <= 0:
            problems.append(f"{key} must be a positive integer, got {getattr(cfg, key)!r}")
    for key in ("request_timeout_s", "log_every_s", "retry_initial_s", "retry_max_s"):
        if getattr(cfg, key) <= 0:
            problems.append(f"{key} must be a positive number, got {getattr(cfg, key)!r}")
    for key in ("temperature", "grace_s"):
        if getattr(cfg, key) < 0:
            problems.append(f"{key} must be a number >= 0, got {getattr(cfg, key)!r}")
    if cfg.native_precision not in providers.QUANT_RANK:
        problems.append(
            f"native_precision {cfg.native_precision!r} is not one of "
            f"{', '.join(providers.QUANT_RANK)}"
        )
    if "/" not in cfg.model:
        problems.append(f"model must be 'author/slug', got {cfg.model!r}")
    for key in ("audit_target", "audit_device_map"):
        if getattr(cfg, key) == "":
            problems.append(f"{key} must be a non-empty string or null, got ''")
    names: set[str] = set()
    for i, d in enumerate(cfg.datasets):
        where = f"datasets[{i}]"
        if not d.name:
            problems.append(f"{where}: name is required")
        elif d.name in names:
            problems.append(f"{where}: duplicate dataset name {d.name!r}")
        names.add(d.name)
        if not d.source:
            problems.append(f"{where}: source is required (sharegpt, hf:org/name, or a file)")
        for key in ("limit", "tokens"):
            value = getattr(d, key)
            if value is not None and value <= 0:
                problems.append(f"{where}: {key} must be a positive integer, got {value!r}")


def load_config(path: str | Path) -> GenConfig:
    """Read and validate a datagen YAML config; every problem is reported in one error."""
    return load_typed(GenConfig, path, check=check)


# ---------------------------------------------------------------------------- CLI


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
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap.parse_args(argv)


def _apply_overrides(cfg: GenConfig, args: argparse.Namespace) -> GenConfig:
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


def load_all_prompts(cfg: GenConfig, files: list[str]) -> dict[str, list[Prompt]]:
    """dataset -> prompts (deduplicated by id within the dataset), config mix then files."""
    groups: dict[str, list[Prompt]] = {}
    for d in cfg.datasets:
        prompts = load_prompts(d.source, dataset=d.name, limit=d.limit, columns=d.columns)
        groups.setdefault(d.name, []).extend(prompts)
    for f in files:
        if not os.access(f, os.R_OK) or not Path(f).is_file():
            raise ConfigError(f"cannot read prompt file {f}: check the path and permissions")
        try:
            prompts = load_prompts(f)
        except OSError as err:
            raise ConfigError(f"cannot read prompt file {f}: {err.strerror or err}") from err
        except UnicodeDecodeError as err:
            raise ConfigError(f"prompt file {f} is not UTF-8 text: {err.reason}") from err
        if not prompts:
            raise ConfigError(f"prompt file {f} holds no usable prompt: {prompts.report.summary()}")
        name = prompts.report.dataset
        groups.setdefault(name, []).extend(prompts)
    return {name: dedupe(ps) for name, ps in groups.items()}


def earlier_exclusions(path: Path) -> dict[str, dict]:
    """provider -> {"slugs", "reason"} from the exclusion lines of DIR/audit.jsonl (a partial
    last line left by a kill is skipped)."""
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("t") == "exclude" and entry.get("provider"):
            out[str(entry["provider"])] = {
                "slugs": [str(s) for s in entry.get("slugs") or []],
                "reason": str(entry.get("reason") or ""),
            }
    return out


def provider_slugs(endpoints: list[providers.Endpoint]) -> dict[str, list[str]]:
    """Display name (lower case; what responses report) -> the slugs of its endpoints."""
    out: dict[str, list[str]] = {}
    for e in endpoints:
        slugs = out.setdefault(e.provider.lower(), [])
        if e.tag not in slugs:
            slugs.append(e.tag)
    return out


def make_audit(target: str, every: int, log_path: Path, device_map: str | None = None):
    """Load the audit target once and wrap it in an OnlineAudit (tests replace this)."""
    from datagen.audit import OnlineAudit
    from eagle3.target import load_target

    log.info("audit: loading target %s; a check every %d prompts", target, every)
    model = load_target(target, device_map=device_map)
    if model.tokenizer is None:
        raise ConfigError(f"audit target {target} has no tokenizer; pass a target that has one")
    return OnlineAudit(model, every=every, log_path=log_path)


async def fetch_json(session: aiohttp.ClientSession, url: str, headers=None) -> tuple[int, dict]:
    async with session.get(url, headers=headers) as resp:
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = {}
        return resp.status, body if isinstance(body, dict) else {}


def auth(api_key: str) -> dict:
    """The key on every request (the spec declares it for every operation); none when empty
    (``--plan`` without a key reads the public endpoint listing)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def read_endpoints(base_url: str, model: str, api_key: str = "") -> list[providers.Endpoint]:
    url = f"{base_url.rstrip('/')}/models/{model}/endpoints"
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            status, body = await fetch_json(session, url, auth(api_key))
    except (aiohttp.ClientError, TimeoutError) as err:
        raise RuntimeError(f"cannot reach OpenRouter at {base_url}: {err}") from err
    if status == 401 and not api_key:
        raise ConfigError(
            f"{base_url} wants an API key for the endpoint listing (401): export OPENROUTER_API_KEY"
        )
    if status == 401:
        raise ConfigError("OpenRouter rejected the API key (401): check OPENROUTER_API_KEY")
    if status == 404:
        raise ConfigError(f"model {model!r} not found on {base_url}: check --model")
    if status != 200:
        raise RuntimeError(f"GET {url} answered HTTP {status}")
    try:
        return providers.parse_endpoints(body)
    except ValueError as err:
        raise RuntimeError(f"GET {url}: {err}") from err


async def account(base_url: str, api_key: str) -> dict:
    """``/key`` and ``/credits`` facts: status of the key, USD left on it, the key's all-time
    usage in USD (None = unknown)."""
    headers = auth(api_key)
    base = base_url.rstrip("/")
    out: dict = {"key_status": None, "left": None, "usage": None}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            status, key = await fetch_json(session, base + "/key", headers)
            out["key_status"] = status
            data = key.get("data") or {}
            if status == 200 and data.get("limit_remaining") is not None:
                out["left"] = float(data["limit_remaining"])
            if status == 200 and data.get("usage") is not None:
                out["usage"] = float(data["usage"])
            status, credits = await fetch_json(session, base + "/credits", headers)
            data = credits.get("data") or {}
            if status == 200 and data.get("total_credits") is not None:
                left = float(data["total_credits"]) - float(data.get("total_usage") or 0.0)
                out["left"] = left if out["left"] is None else min(out["left"], left)
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        log.debug("account lookup failed: %s", err)
    return out


async def generation_costs(base_url: str, api_key: str, ids: list[str]) -> dict[str, float]:
    """generation id -> ``GET /generation?id=`` ``data.total_cost``, for those it answers."""
    url = base_url.rstrip("/") + "/generation"
    gate = asyncio.Semaphore(16)
    out: dict[str, float] = {}

    async def one(session: aiohttp.ClientSession, gen_id: str) -> None:
        async with gate:
            try:
                async with session.get(url, params={"id": gen_id}) as resp:
                    body = await resp.json(content_type=None) if resp.status == 200 else {}
            except (aiohttp.ClientError, TimeoutError, ValueError) as err:
                log.debug("GET /generation?id=%s failed: %s", gen_id, err)
                return
        cost = (body.get("data") or {}).get("total_cost") if isinstance(body, dict) else None
        if cost is not None:
            out[gen_id] = float(cost)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth(api_key)) as session:
        await asyncio.gather(*(one(session, i) for i in ids))
    return out


@dataclass
class Settled:
    """What this run settled of earlier runs' unknown costs (for the summary)."""

    requests: int = 0
    usd: float = 0.0
    worst_usd: float = 0.0


async def settle_earlier(
    ledger: Ledger, base_url: str, api_key: str, now_usage: float | None, timeout_s: float
) -> tuple[list[str], Settled]:
    """Settle the requests of earlier runs whose cost is unknown: by ``GET /generation`` where
    the generation id is known, the rest together from the key's usage counter
    (:func:`datagen.ledger.decide_settlement`). Returns one line per decision."""
    lines, settled = [], Settled()
    with_ids = [u for u in ledger.unknown.values() if u.generation_id]
    if with_ids:
        costs = await generation_costs(base_url, api_key, [u.generation_id for u in with_ids])
        found = [u for u in with_ids if u.generation_id in costs]
        for u in found:
            ledger.settle_generation(u.rid, costs[u.generation_id])
        if found:
            usd, worst = sum(costs[u.generation_id] for u in found), sum(u.usd for u in found)
            settled = Settled(len(found), usd, worst)
            lines.append(
                f"ledger: settled {len(found)} request(s) of unknown cost at ${usd:.4f} "
                f"(worst case was ${worst:.4f}; from GET /generation)"
            )
        if len(found) < len(with_ids):
            lines.append(
                f"ledger: GET /generation did not answer for {len(with_ids) - len(found)} "
                "request(s) of unknown cost; settled with the orphans below"
            )
    window = ledger.window()
    if window is None:
        return lines, settled
    idle = time.time() - window.last_ts if window.last_ts is not None else None
    decision = decide_settlement(
        window.start_usage, now_usage, window.known_usd, window.worst_usd, idle, timeout_s
    )
    ledger.settle_window(window, decision)
    n, worst = len(window.unknowns), window.worst_usd
    runs = ", ".join(dict.fromkeys(u.run for u in window.unknowns))
    if decision.action == "settle":
        settled.requests += n
        settled.usd += decision.usd
        settled.worst_usd += worst
        lines.append(
            f"ledger: settled {n} orphaned request(s) of run {runs} at ${decision.usd:.4f} "
            f"(worst case was ${worst:.4f}; {decision.why})"
        )
    else:
        lines.append(
            f"ledger: {n} orphaned request(s) of run {runs} kept at their worst case "
            f"${worst:.4f}"
            + (" for good" if decision.action == "worst_case" else "")
            + f": {decision.why}"
        )
    return lines, settled


def summary_line(
    done: int,
    total: int,
    failed: int,
    tokens: int,
    spent: float,
    budget: float,
    excluded: list[str] | None = None,
    settled: Settled | None = None,
    cache: tuple[int, float] = (0, 0.0),
):
    remaining = total - done - failed
    line = (
        f"summary: {done}/{total} prompts done, {remaining} remaining, {failed} failed; "
        f"{tokens:,} output tokens; ${spent:.2f} spent of ${budget:.2f} budget"
    )
    if settled is not None and settled.requests:
        line += (
            f" (incl. {settled.requests} earlier request(s) settled at ${settled.usd:.4f}, "
            f"worst case ${settled.worst_usd:.4f})"
        )
    if cache[0]:
        line += f"; {cache[0]:,} cached prompt tokens saved ${cache[1]:.4f}"
    if excluded:
        line += f"; audit excluded {', '.join(excluded)}"
    return line


def connection(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, API key) from the flags and the environment."""
    base_url = args.base_url or os.environ.get("OPENROUTER_BASE_URL") or PUBLIC_BASE_URL
    api_key = os.environ.get("OPENROUTER_API_KEY", "")
    if not args.plan and not api_key:
        raise ConfigError("OPENROUTER_API_KEY is not set: export your OpenRouter key")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url {base_url!r} is not an http(s) URL")
    return base_url, api_key


def ignore_earlier_exclusions(
    cfg: GenConfig, out_dir: Path, slugs_of: dict[str, list[str]]
) -> dict[str, dict]:
    """Add the providers an earlier run's audit excluded for ``out_dir`` to ``cfg.ignore``:
    its verdicts hold for the directory. Returns them (provider -> {"slugs", "reason"})."""
    earlier = earlier_exclusions(out_dir / AUDIT_LOG)
    for name, entry in earlier.items():
        slugs = sorted(set(entry["slugs"]) | set(slugs_of.get(name.lower(), [])))
        cfg.ignore = cfg.ignore + [s for s in slugs if s not in cfg.ignore]
        log.info(
            "audit: ignoring %s, excluded by an earlier run (%s); see %s",
            ", ".join(slugs) or f"nothing ({name} matches no endpoint)",
            entry["reason"],
            out_dir / AUDIT_LOG,
        )
    return earlier


def show_plan(
    cfg: GenConfig,
    out_dir: Path,
    endpoints: list[providers.Endpoint],
    allowed: list[providers.Endpoint],
    groups: dict[str, list[Prompt]],
    budget: float,
) -> int:
    """Print the plan for what ``out_dir`` already holds; sends no chat request."""
    ledger = Ledger(out_dir / "ledger.jsonl") if (out_dir / "ledger.jsonl").exists() else None
    done = {}
    if out_dir.is_dir():
        reader = ResultStore(out_dir, readonly=True)
        done = {name: reader.done_ids(name) for name in groups}
    print(plan_text(cfg, endpoints, allowed, groups, done, budget, ledger))
    if ledger:
        ledger.close()
    if not allowed:
        raise ConfigError(f"no endpoint of {cfg.model} passes the provider rule (table above)")
    return EXIT_OK


def prompts_left(
    store: ResultStore, groups: dict[str, list[Prompt]]
) -> tuple[list[list[Prompt]], int]:
    """Per dataset, the prompts not done in an earlier run; and how many were done."""
    todo, done_before = [], 0
    for name, prompts in groups.items():
        done = store.done_ids(name)
        left = [p for p in prompts if p.id not in done]
        done_before += len(prompts) - len(left)
        todo.append(left)
        log.info(
            "%s: %d prompts, %d done earlier, %d to generate",
            name,
            len(prompts),
            len(prompts) - len(left),
            len(left),
        )
    return todo, done_before


async def run(args: argparse.Namespace) -> int:
    cfg = _apply_overrides(load_config(args.config), args)
    base_url, api_key = connection(args)
    out_dir = Path(args.out or cfg.out_dir)
    groups = load_all_prompts(cfg, args.prompts)
    if not groups:
        raise ConfigError("no prompts: the config has no datasets and no --prompts was given")

    endpoints = await read_endpoints(base_url, cfg.model, api_key)
    slugs_of = provider_slugs(endpoints)
    earlier = ignore_earlier_exclusions(cfg, out_dir, slugs_of)
    allowed = providers.select(endpoints, cfg.native_precision, cfg.ignore, cfg.max_tokens)
    if args.plan:
        return show_plan(cfg, out_dir, endpoints, allowed, groups, args.budget)
    if not allowed:
        raise ConfigError(
            f"no endpoint of {cfg.model} passes the provider rule: run with --plan to see why"
        )
    acct = await account(base_url, api_key)
    if acct["key_status"] == 401:
        raise ConfigError("OpenRouter rejected the API key (401): check OPENROUTER_API_KEY")

    block = providers.provider_block(endpoints, cfg.native_precision, cfg.ignore)
    settings = Settings(
        base_url=base_url,
        api_key=api_key,
        model=cfg.model,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        reasoning=cfg.reasoning,
        provider=block,
        prices=providers.dearest(allowed),
        budget=args.budget,
        token_budgets={name: cfg.token_budget(name) for name in groups},
        concurrency=cfg.concurrency,
        retry_policy=retry.Policy(cfg.max_attempts, cfg.retry_initial_s, cfg.retry_max_s),
        request_timeout=cfg.request_timeout_s,
        grace=cfg.grace_s,
        log_every=cfg.log_every_s,
        audit_log=out_dir / AUDIT_LOG,
        provider_slugs=slugs_of,
        allowed_slugs=[e.tag for e in allowed],
        cache_savings=providers.cache_savings(allowed),
    )
    total = sum(len(prompts) for prompts in groups.values())
    store = ResultStore(out_dir, fsync_interval=1.0)
    ledger = Ledger(out_dir / "ledger.jsonl")
    try:
        if acct["usage"] is not None:  # the snapshot comes before this run's first chat request
            ledger.record_key_usage(acct["usage"])
        lines, settled = await settle_earlier(
            ledger, base_url, api_key, acct["usage"], cfg.request_timeout_s
        )
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        todo, done_before = prompts_left(store, groups)
        settings.plan_usd_per_m_out = usd_per_m_out(cfg, allowed, dict(zip(groups, todo)))
        log.info("allowed providers: %s; rule %s", ", ".join(e.provider for e in allowed), block)
        audit = None
        if args.audit_every > 0 and any(todo):
            audit = make_audit(
                cfg.audit_target, args.audit_every, out_dir / AUDIT_LOG, cfg.audit_device_map
            )
        outcome = await Engine(settings, todo, store, ledger, audit).run()
        spent = ledger.spent_usd + ledger.reserved_usd  # open reservations now are abandoned
        tokens = sum(ledger.tokens.values())
        cache = (ledger.cached_tokens, ledger.cache_discount_usd)
        remaining = total - done_before - outcome.done - outcome.failed
        for line in await stop_messages(
            outcome, remaining, spent, args.budget, base_url, api_key, store, groups
        ):
            print(line, file=sys.stderr)
    finally:
        ledger.close()
        store.close()
    sys.stderr.flush()
    excluded = [*earlier, *(p for p in outcome.excluded if p not in earlier)]
    done = done_before + outcome.done
    line = summary_line(
        done, total, outcome.failed, tokens, spent, args.budget, excluded, settled, cache
    )
    print(line, flush=True)
    return EXIT_OK if remaining == 0 else EXIT_TEMPFAIL


async def stop_messages(
    out: Outcome,
    remaining: int,
    spent: float,
    budget: float,
    base_url: str,
    api_key: str,
    store: ResultStore,
    groups: dict[str, list[Prompt]],
) -> list[str]:
    lines = []
    for provider, entry in out.excluded.items():
        lines.append(
            f"note: the audit excluded {provider} ({', '.join(entry['slugs']) or 'no slug'}): "
            f"{entry['reason']}; see {AUDIT_LOG} in the output directory"
        )
    if out.audit_failures:
        lines.append(f"note: {out.audit_failures} audit check(s) failed (logged above)")
    if out.length:
        lines.append(
            f"note: {out.length} answer(s) hit max_tokens (finish_reason length, "
            "kept with truncated: true)"
        )
    if out.failed:
        lines.append(
            f"note: {out.failed} prompt(s) failed for good this run (see failed.jsonl; "
            "a re-run tries them again)"
        )
    if remaining == 0:
        return lines
    if out.stop == "credits":
        acct = await account(base_url, api_key)
        costs = [
            r["usage"]["cost"] for r in store.iter_records() if (r.get("usage") or {}).get("cost")
        ]
        per_prompt = sum(costs) / len(costs) if costs else None
        need = min(budget - spent, remaining * per_prompt) if per_prompt else budget - spent
        have = acct["left"]
        missing = max(0.0, need - (have or 0.0))
        lines.append(
            f"stopped: OpenRouter credits ran out (402: {out.stop_detail}). "
            + (f"${have:.2f} credit left; " if have is not None else "")
            + f"about ${missing:.2f} more credit is needed for the {remaining} remaining prompts"
            + (f" (~${per_prompt:.4f} each so far)" if per_prompt else "")
            + "; add credits and re-run the same command"
        )
    elif out.stop == "budget":
        lines.append(
            f"stopped: budget reached ({out.stop_detail}); raise --budget and re-run to continue"
        )
    elif out.stop == "audit":
        lines.append(
            f"stopped: {out.stop_detail}; see {AUDIT_LOG} in the output directory, and "
            "check the target or the audit before re-running"
        )
    elif out.stop == "interrupted":
        lines.append(
            f"stopped: interrupted ({out.stop_detail}); re-run the same command to continue"
        )
    if out.capped:
        lines.append(
            f"stopped: output-token budget reached for {', '.join(sorted(out.capped))}; "
            "raise --tokens-per-dataset (or the dataset's tokens) to generate more"
        )
    return lines


def run_sync(args: argparse.Namespace) -> int:
    """``run`` on a new event loop; an unexpected failure is one line and exit 1."""
    try:
        return asyncio.run(run(args))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the engine took over the signals: nothing was sent
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


if __name__ == "__main__":
    sys.exit(main())
