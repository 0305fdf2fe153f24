"""One run of ``python -m datagen.openrouter``, top to bottom: load the prompts, read the
model's endpoints and apply the provider rule (and the audit's earlier exclusions); with
``--plan`` print the plan and stop; else snapshot the key's usage, settle earlier runs (and keep
settling them in the background while generating: a killed run's requests free the budget as
soon as OpenRouter's figures are final), generate what is left with the requester, and report.

Work done is never lost, however the run ends: results and ledger events are appended as they
happen and both files are closed on every way out (a RemoteError from OpenRouter included); the
same command resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from datagen import retry
from datagen.openrouter import exclusions, providers
from datagen.openrouter.client import OpenRouter
from datagen.openrouter.config import GenConfig
from datagen.openrouter.exclusions import AUDIT_LOG
from datagen.openrouter.ledger import Ledger
from datagen.openrouter.plan import plan_text, usd_per_m_out
from datagen.openrouter.report import stop_messages, summary_line
from datagen.openrouter.requester import Requester, Settings
from datagen.openrouter.settle import Settler
from eagle3.cli import EXIT_OK, EXIT_TEMPFAIL
from eagle3.data.prompts import Prompt, dedupe, load_prompts
from eagle3.data.records import ResultStore
from eagle3.errors import ConfigError

log = logging.getLogger(__name__)


async def run(
    cfg: GenConfig,
    *,
    out_dir: Path,
    prompt_files: list[str],
    budget: float,
    base_url: str,
    api_key: str,
    plan: bool,
    audit_every: int,
    wait_for_orphans: bool = True,
) -> int:
    """``plan``: print the plan and send no chat request. Else generate what ``out_dir`` lacks
    within ``budget``: 0 when every prompt is done, 75 with prompts left (re-run to continue)."""
    groups = load_all_prompts(cfg, prompt_files)
    if not groups:
        raise ConfigError("no prompts: the config has no datasets and no --prompts was given")

    async with OpenRouter(base_url, api_key) as api:
        endpoints = await api.endpoints(cfg.model)
        slugs_of = exclusions.provider_slugs(endpoints)
        earlier = exclusions.ignore_earlier_exclusions(cfg, out_dir, slugs_of)
        allowed = providers.select(endpoints, cfg.native_precision, cfg.ignore, cfg.max_tokens)
        if plan:
            return show_plan(cfg, out_dir, endpoints, allowed, groups, budget)
        if not allowed:
            raise ConfigError(
                f"no endpoint of {cfg.model} passes the provider rule: run with --plan to see why"
            )
        acct, read_at = await key_snapshot(api)

        settings = requester_settings(
            cfg,
            endpoints,
            allowed,
            groups,
            budget=budget,
            base_url=base_url,
            api_key=api_key,
            audit_log=out_dir / AUDIT_LOG,
            slugs_of=slugs_of,
            wait_for_orphans=wait_for_orphans,
        )
        total = sum(len(prompts) for prompts in groups.values())
        store = ResultStore(out_dir, fsync_interval=1.0)
        ledger = Ledger(out_dir / "ledger.jsonl")
        try:  # closed on every way out: what was written stays, the same command resumes
            if acct["usage"] is not None:  # the snapshot comes before this run's first request
                ledger.record_key_usage(acct["usage"])
            settler = Settler(ledger, api, cfg.request_timeout_s)
            say(await settler.start(acct["usage"], read_at))
            todo, done_before = prompts_left(store, groups)
            settings.plan_usd_per_m_out = usd_per_m_out(cfg, allowed, dict(zip(groups, todo)))
            settings.done_before = done_before  # progress: already done, not in the rate
            log.info(
                "allowed providers: %s; rule %s",
                ", ".join(e.provider for e in allowed),
                settings.provider,
            )
            audit = provider_audit(cfg, audit_every, out_dir, todo)
            requester = Requester(settings, todo, store, ledger, audit, settler)
            outcome = await generate_while_settling(requester, settler)
            say(await settler.finish(outcome.stop == "interrupted"))
            spent = ledger.spent_usd + ledger.reserved_usd  # open reservations now are abandoned
            tokens = sum(ledger.tokens.values())
            cache = (ledger.cached_tokens, ledger.cache_discount_usd)
            remaining = total - done_before - outcome.done - outcome.failed
            say([settler.pending_line()])
            say(await stop_messages(outcome, remaining, spent, budget, api, store, groups))
        finally:
            ledger.close()
            store.close()
    sys.stderr.flush()
    excluded = [*earlier, *(p for p in outcome.excluded if p not in earlier)]
    done = done_before + outcome.done
    line = summary_line(
        done, total, outcome.failed, tokens, spent, budget, excluded, settler.settled, cache
    )
    print(line, flush=True)
    return EXIT_OK if remaining == 0 else EXIT_TEMPFAIL


async def key_snapshot(api: OpenRouter) -> tuple[dict, float]:
    """(the key's account: its usage and status, the time it was read): the usage holds what
    was billed before that time. A rejected key is a ConfigError."""
    read_at = time.time()
    acct = await api.account()
    if acct["key_status"] == 401:
        raise ConfigError("OpenRouter rejected the API key (401): check OPENROUTER_API_KEY")
    return acct, read_at


def provider_audit(cfg: GenConfig, audit_every: int, out_dir: Path, todo: list):
    """The audit of what the providers answer, every ``audit_every`` results; None when it is
    off or nothing is left to generate (its target model is not loaded then)."""
    if audit_every <= 0 or not any(todo):
        return None
    return exclusions.make_audit(
        cfg.audit_target, audit_every, out_dir / AUDIT_LOG, cfg.audit_device_map
    )


async def generate_while_settling(requester: Requester, settler: Settler):
    """The requester's run, with the settler trying to settle earlier requests meanwhile."""
    settling = asyncio.create_task(settler.run())
    try:
        return await requester.run()
    finally:
        settling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await settling  # (a bug in it surfaces here)


def say(lines: list[str | None]) -> None:
    """Status lines to stderr (the summary alone goes to stdout); empty ones are left out."""
    for line in lines:
        if line:
            print(line, file=sys.stderr, flush=True)


def requester_settings(
    cfg: GenConfig,
    endpoints: list,
    allowed: list,
    groups: dict[str, list[Prompt]],
    *,
    budget: float,
    base_url: str,
    api_key: str,
    audit_log: Path,
    slugs_of: dict[str, list[str]],
    wait_for_orphans: bool,
) -> Settings:
    """The requester's settings: the config's sampling, limits and retries, the provider block
    routing to the allowed endpoints, the dearest allowed price for reservations."""
    return Settings(
        base_url=base_url,
        api_key=api_key,
        model=cfg.model,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        reasoning=cfg.reasoning,
        provider=providers.provider_block(endpoints, cfg.native_precision, cfg.ignore),
        prices=providers.dearest(allowed),
        budget=budget,
        token_budgets={name: cfg.token_budget(name) for name in groups},
        concurrency=cfg.concurrency,
        retry_policy=retry.Policy(cfg.max_attempts, cfg.retry_initial_s, cfg.retry_max_s),
        request_timeout=cfg.request_timeout_s,
        grace=cfg.grace_s,
        log_every=cfg.log_every_s,
        audit_log=audit_log,
        provider_slugs=slugs_of,
        allowed_slugs=[e.tag for e in allowed],
        cache_savings=providers.cache_savings(allowed),
        wait_for_orphans=wait_for_orphans,
    )


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
