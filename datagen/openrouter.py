"""Generate target responses on OpenRouter within a hard dollar budget, resumably.

    OPENROUTER_API_KEY=sk-or-... python -m datagen.openrouter --budget 100 \\
        [--config configs/datagen/kimi-k2.5.yaml] [--prompts FILE.jsonl ...] [--out DIR] \\
        [--concurrency 2000] [--max-tokens N] [--tokens-per-dataset N] [--model SLUG] \\
        [--base-url URL] [--plan] [--audit-every N [--audit-target NAME_OR_PATH]]

Reads the model's endpoints, keeps only providers at or above the native precision (see
datagen.providers), and generates every prompt of the config's dataset mix (plus ``--prompts``
files) into ``DIR/<dataset>.jsonl``; every charged request goes to ``DIR/ledger.jsonl``.
``--budget`` is what DIR may spend over all runs; re-running the same command resumes.
``--plan`` prints the provider table and what the budget buys, and sends no chat request.

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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from datagen import providers
from datagen.engine import Engine, Outcome, Settings
from datagen.ledger import Ledger
from eagle3.data.prompts import Prompt, dedupe, load_prompts
from eagle3.data.records import ResultStore
from eagle3.errors import Eagle3Error

log = logging.getLogger("datagen.openrouter")

PUBLIC_BASE_URL = "https://openrouter.ai/api/v1"
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/datagen/kimi-k2.5.yaml"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TEMPFAIL = 0, 1, 2, 75
AUDIT_LOG = "audit.jsonl"  # in --out: audit checks and exclusions


class ConfigError(Eagle3Error):
    """Bad configuration or input; printed as one line, exit 2."""


@dataclass
class DatasetSpec:
    name: str
    source: str  # embedded name, hf:org/name[:split], or a file
    columns: dict | None = None  # normalize's field -> the source's column
    limit: int | None = None
    tokens: int | None = None  # output-token budget; None = the config's tokens_per_dataset


@dataclass
class GenConfig:
    model: str = "moonshotai/kimi-k2.5"
    native_precision: str = "int4"
    ignore: list = field(default_factory=lambda: ["fireworks", "baseten"])
    max_tokens: int = 16384
    temperature: float = 0.7
    reasoning: dict | None = None
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
    datasets: list = field(default_factory=list)  # DatasetSpec


_INT_KEYS = (
    "max_tokens",
    "concurrency",
    "max_attempts",
    "expected_output_tokens",
    "tokens_per_dataset",
)
_POS_KEYS = ("request_timeout_s", "log_every_s", "retry_initial_s", "retry_max_s")
_DATASET_KEYS = {"name", "source", "columns", "limit", "tokens"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_config(path: str | Path) -> GenConfig:
    """Read and validate a datagen YAML config; every problem is reported in one error."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0]
        raise ConfigError(f"config {path} is not valid YAML: {first}") from err
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: expected a mapping at the top level")
    defaults = GenConfig()
    known = set(defaults.__dataclass_fields__)
    problems = [f"unknown key {k!r}" for k in raw if k not in known]
    values = {k: v for k, v in raw.items() if k in known}
    for k in _INT_KEYS:
        if k in values and not (_is_int(values[k]) and values[k] > 0):
            problems.append(f"{k} must be a positive integer, got {values[k]!r}")
    for k in _POS_KEYS:
        v = values.get(k, 1)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            problems.append(f"{k} must be a positive number, got {v!r}")
    v = values.get("temperature", 0.0)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0):
        problems.append(f"temperature must be a number >= 0, got {v!r}")
    v = values.get("grace_s", 0.0)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0):
        problems.append(f"grace_s must be a number >= 0, got {v!r}")
    if "native_precision" in values and values["native_precision"] not in providers.QUANT_RANK:
        problems.append(
            f"native_precision {values['native_precision']!r} is not one of "
            f"{', '.join(providers.QUANT_RANK)}"
        )
    if "model" in values and not (isinstance(values["model"], str) and "/" in values["model"]):
        problems.append(f"model must be 'author/slug', got {values['model']!r}")
    if "ignore" in values and not (
        isinstance(values["ignore"], list) and all(isinstance(s, str) for s in values["ignore"])
    ):
        problems.append("ignore must be a list of provider slugs")
    for k in ("audit_target", "audit_device_map"):
        if values.get(k) is not None and not (isinstance(values[k], str) and values[k]):
            problems.append(f"{k} must be a string or null, got {values[k]!r}")
    if values.get("reasoning") is not None and not isinstance(values["reasoning"], dict):
        problems.append("reasoning must be a mapping such as {effort: high}, or null")
    datasets = []
    raw_ds = values.pop("datasets", []) or []
    if not isinstance(raw_ds, list):
        problems.append("datasets must be a list of {name, source, ...}")
        raw_ds = []
    names = set()
    for i, d in enumerate(raw_ds):
        where = f"datasets[{i}]"
        if not isinstance(d, dict):
            problems.append(f"{where} must be a mapping with name and source")
            continue
        problems += [f"{where}: unknown key {k!r}" for k in d if k not in _DATASET_KEYS]
        name, source = d.get("name"), d.get("source")
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: name is required")
        elif name in names:
            problems.append(f"{where}: duplicate dataset name {name!r}")
        names.add(name)
        if not isinstance(source, str) or not source:
            problems.append(f"{where}: source is required (sharegpt, hf:org/name, or a file)")
        if d.get("columns") is not None and not isinstance(d["columns"], dict):
            problems.append(f"{where}: columns must be a mapping field -> column")
        for k in ("limit", "tokens"):
            if d.get(k) is not None and not (_is_int(d[k]) and d[k] > 0):
                problems.append(f"{where}: {k} must be a positive integer, got {d[k]!r}")
        datasets.append(DatasetSpec(**{k: d.get(k) for k in _DATASET_KEYS}))
    if problems:
        raise ConfigError(f"config {path}: " + "; ".join(problems))
    return GenConfig(**values, datasets=datasets)


# ---------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
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
        help="audit providers against the local target every N prompts; 0 = off (default)",
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
    if args.datasets is not None:
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


def token_budget(cfg: GenConfig, dataset: str) -> int:
    for d in cfg.datasets:
        if d.name == dataset and d.tokens is not None:
            return d.tokens
    return cfg.tokens_per_dataset


async def fetch_json(session: aiohttp.ClientSession, url: str, headers=None) -> tuple[int, dict]:
    async with session.get(url, headers=headers) as resp:
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = {}
        return resp.status, body if isinstance(body, dict) else {}


async def read_endpoints(base_url: str, model: str) -> list[providers.Endpoint]:
    url = f"{base_url.rstrip('/')}/models/{model}/endpoints"
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            status, body = await fetch_json(session, url)
    except (aiohttp.ClientError, TimeoutError) as err:
        raise RuntimeError(f"cannot reach OpenRouter at {base_url}: {err}") from err
    if status == 404:
        raise ConfigError(f"model {model!r} not found on {base_url}: check --model")
    if status != 200:
        raise RuntimeError(f"GET {url} answered HTTP {status}")
    try:
        return providers.parse_endpoints(body)
    except ValueError as err:
        raise RuntimeError(f"GET {url}: {err}") from err


async def account(base_url: str, api_key: str) -> dict:
    """``/key`` and ``/credits`` facts: status of the key, USD left on it (None = unknown)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    base = base_url.rstrip("/")
    out: dict = {"key_status": None, "left": None}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            status, key = await fetch_json(session, base + "/key", headers)
            out["key_status"] = status
            data = key.get("data") or {}
            if status == 200 and data.get("limit_remaining") is not None:
                out["left"] = float(data["limit_remaining"])
            status, credits = await fetch_json(session, base + "/credits", headers)
            data = credits.get("data") or {}
            if status == 200 and data.get("total_credits") is not None:
                left = float(data["total_credits"]) - float(data.get("total_usage") or 0.0)
                out["left"] = left if out["left"] is None else min(out["left"], left)
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        log.debug("account lookup failed: %s", err)
    return out


def plan_text(
    cfg: GenConfig,
    endpoints: list[providers.Endpoint],
    allowed: list[providers.Endpoint],
    groups: dict[str, list[Prompt]],
    done: dict[str, set[str]],
    budget: float,
    ledger: Ledger | None,
) -> str:
    lines = [f"providers of {cfg.model} (native precision {cfg.native_precision}):"]
    lines.append(providers.format_table(endpoints, cfg.native_precision))
    unknown = [e.provider for e in allowed if e.assumed_native]
    if unknown:
        lines.append(
            f"note: {', '.join(unknown)} report no quantization; taken as native "
            f"{cfg.native_precision} (the only public weights)"
        )
    if not allowed:
        return "\n".join(lines)
    lines.append(
        "provider rule sent with every request: "
        + json.dumps(providers.provider_block(endpoints, cfg.native_precision, cfg.ignore))
    )
    cheap, dear = providers.cheapest(allowed), providers.dearest(allowed)
    spent = ledger.spent_usd if ledger else 0.0
    left = max(0.0, budget - spent)
    demands = []
    for name, prompts in groups.items():
        todo = [p for p in prompts if p.id not in done.get(name, set())]
        inp = out = 0.0
        for p in todo:
            i, o = providers.conversation_tokens(p.messages, cfg.expected_output_tokens)
            inp, out = inp + i, out + o
        n = max(1, len(todo))
        spent_tokens = ledger.spent_tokens(name) if ledger else 0
        demands.append(
            providers.DatasetDemand(
                name, len(todo), inp / n, out / n, max(0, token_budget(cfg, name) - spent_tokens)
            )
        )
    rows = providers.project(demands, left, cheap)
    worst = providers.project(demands, left, dear)
    wanted_tokens = sum(r.wanted_tokens for r in rows)
    wanted_usd = sum(r.wanted_usd for r in rows)
    in_per_out = (
        sum(d.input_per_prompt * r.wanted_prompts for d, r in zip(demands, rows)) / wanted_tokens
        if wanted_tokens
        else 0.0
    )
    lines.append(
        f"budget projection: ${left:.2f} left of ${budget:.2f} (spent ${spent:.2f}); "
        f"~{cfg.expected_output_tokens} output tokens per answer assumed (expected_output_tokens)"
    )
    lines.append(
        f"  at the cheapest allowed ${cheap.prompt * 1e6:.2f}/M in, ${cheap.completion * 1e6:.2f}"
        f"/M out: ${left:.2f} buys {providers.tokens_for_budget(left, in_per_out, cheap) / 1e6:.1f}M"
        f" output tokens; at the dearest allowed ${dear.prompt * 1e6:.2f}/M in, "
        f"${dear.completion * 1e6:.2f}/M out: "
        f"{providers.tokens_for_budget(left, in_per_out, dear) / 1e6:.1f}M"
    )
    lines.append(
        f"  the datasets want {wanted_tokens / 1e6:.2f}M output tokens "
        f"(${wanted_usd:.2f} at the cheapest allowed)"
    )
    header = (
        "dataset",
        "prompts",
        "in tok/prompt",
        "out tok/prompt",
        "token budget",
        "wanted tok",
        "wanted $",
        "buys tok",
        "buys prompts",
        "% of budget",
        "worst-case tok",
    )
    table = [header]
    for d, r, w in zip(demands, rows, worst):
        pct = 100.0 * r.bought_tokens / d.token_budget_left if d.token_budget_left else 0.0
        table.append(
            (
                d.name,
                str(d.prompts),
                f"{d.input_per_prompt:.0f}",
                f"{d.output_per_prompt:.0f}",
                f"{d.token_budget_left:,}",
                f"{r.wanted_tokens:,.0f}",
                f"{r.wanted_usd:.2f}",
                f"{r.bought_tokens:,.0f}",
                f"{r.bought_prompts:,.0f}",
                f"{pct:.1f}%",
                f"{w.bought_tokens:,.0f}",
            )
        )
    widths = [max(len(t[i]) for t in table) for i in range(len(header))]
    for t in table:
        lines.append(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))
            )
        )
    return "\n".join(lines)


def summary_line(
    done: int,
    total: int,
    failed: int,
    tokens: int,
    spent: float,
    budget: float,
    excluded: list[str] | None = None,
):
    remaining = total - done - failed
    line = (
        f"summary: {done}/{total} prompts done, {remaining} remaining, {failed} failed; "
        f"{tokens:,} output tokens; ${spent:.2f} spent of ${budget:.2f} budget"
    )
    if excluded:
        line += f"; audit excluded {', '.join(excluded)}"
    return line


async def run(args: argparse.Namespace) -> int:
    cfg = _apply_overrides(load_config(args.config), args)
    base_url = args.base_url or os.environ.get("OPENROUTER_BASE_URL") or PUBLIC_BASE_URL
    api_key = os.environ.get("OPENROUTER_API_KEY", "")
    if not args.plan and not api_key:
        raise ConfigError("OPENROUTER_API_KEY is not set: export your OpenRouter key")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url {base_url!r} is not an http(s) URL")
    out_dir = Path(args.out or cfg.out_dir)
    groups = load_all_prompts(cfg, args.prompts)
    if not groups:
        raise ConfigError("no prompts: the config has no datasets and no --prompts was given")

    endpoints = await read_endpoints(base_url, cfg.model)
    slugs_of = provider_slugs(endpoints)
    earlier = earlier_exclusions(out_dir / AUDIT_LOG)
    for name, entry in earlier.items():  # an earlier run's audit verdicts hold for DIR
        slugs = sorted(set(entry["slugs"]) | set(slugs_of.get(name.lower(), [])))
        new = [s for s in slugs if s not in cfg.ignore]
        cfg.ignore = cfg.ignore + new
        log.info(
            "audit: ignoring %s, excluded by an earlier run (%s); see %s",
            ", ".join(slugs) or f"nothing ({name} matches no endpoint)",
            entry["reason"],
            out_dir / AUDIT_LOG,
        )
    allowed = providers.select(endpoints, cfg.native_precision, cfg.ignore, cfg.max_tokens)

    if args.plan:
        ledger = Ledger(out_dir / "ledger.jsonl") if (out_dir / "ledger.jsonl").exists() else None
        done = {}
        if out_dir.is_dir():
            reader = ResultStore(out_dir, readonly=True)
            done = {name: reader.done_ids(name) for name in groups}
        print(plan_text(cfg, endpoints, allowed, groups, done, args.budget, ledger))
        if ledger:
            ledger.close()
        if not allowed:
            raise ConfigError(f"no endpoint of {cfg.model} passes the provider rule (table above)")
        return EXIT_OK
    if not allowed:
        raise ConfigError(
            f"no endpoint of {cfg.model} passes the provider rule: run with --plan to see why"
        )

    acct = await account(base_url, api_key)
    if acct["key_status"] == 401:
        raise ConfigError("OpenRouter rejected the API key (401): check OPENROUTER_API_KEY")

    store = ResultStore(out_dir, fsync_interval=1.0)
    ledger = Ledger(out_dir / "ledger.jsonl")
    try:
        todo, total, done_before = [], 0, 0
        for name, prompts in groups.items():
            done = store.done_ids(name)
            total += len(prompts)
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
        block = providers.provider_block(endpoints, cfg.native_precision, cfg.ignore)
        names = ", ".join(e.provider for e in allowed)
        log.info("allowed providers: %s; rule %s", names, block)
        audit = None
        if args.audit_every > 0 and any(todo):
            audit = make_audit(
                cfg.audit_target, args.audit_every, out_dir / AUDIT_LOG, cfg.audit_device_map
            )
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
            token_budgets={name: token_budget(cfg, name) for name in groups},
            concurrency=cfg.concurrency,
            max_attempts=cfg.max_attempts,
            retry_initial=cfg.retry_initial_s,
            retry_max=cfg.retry_max_s,
            request_timeout=cfg.request_timeout_s,
            grace=cfg.grace_s,
            log_every=cfg.log_every_s,
            audit_log=out_dir / AUDIT_LOG,
            provider_slugs=slugs_of,
            allowed_slugs=[e.tag for e in allowed],
        )
        outcome = await Engine(settings, todo, store, ledger, audit).run()
        spent = ledger.spent_usd + ledger.reserved_usd  # open reservations now are abandoned
        tokens = sum(ledger.tokens.values())
        remaining = total - done_before - outcome.done - outcome.failed
        code = EXIT_OK if remaining == 0 else EXIT_TEMPFAIL
        for line in await stop_messages(
            outcome, remaining, spent, args.budget, base_url, api_key, store, groups
        ):
            print(line, file=sys.stderr)
    finally:
        ledger.close()
        store.close()
    sys.stderr.flush()
    excluded = [*earlier, *(p for p in outcome.excluded if p not in earlier)]
    print(
        summary_line(
            done_before + outcome.done,
            total,
            outcome.failed,
            tokens,
            spent,
            args.budget,
            excluded,
        ),
        flush=True,
    )
    return code


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)  # on the package logger: main() may run twice
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    pkg = logging.getLogger("datagen")
    pkg.addHandler(handler)
    pkg.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return asyncio.run(run(args))
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the engine took over the signals: nothing was sent
        print("error: interrupted before generation started", file=sys.stderr, flush=True)
        return EXIT_TEMPFAIL
    finally:
        pkg.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
