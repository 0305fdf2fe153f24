"""The async requester behind ``python -m datagen.openrouter``: every prompt, within budget.

One asyncio loop, one pooled aiohttp session, ``concurrency`` workers. Each worker takes the next
prompt (datasets interleaved) and generates it turn by turn: every user turn is one request
whose input is the conversation so far, the model's own earlier answers included. Per request:

1. take a concurrency slot from the :class:`~datagen.openrouter.throttle.Throttle` (it shrinks
   on 429s and holds everyone back while a server-requested wait runs, so a 429 storm slows the
   whole client);
2. reserve the request's worst case in the :class:`~datagen.openrouter.ledger.Ledger` (dollars
   and the dataset's output tokens); if it does not fit, wait for in-flight requests to settle,
   and when nothing is in flight any more, stop (budget) or close the dataset (token budget);
   but when a dead run's requests of unknown cost hold the money it lacks, wait for the
   :class:`HeldOrphans` to settle them (a countdown line; ``wait_for_orphans=False``: stop);
3. send; sort the response with :func:`datagen.retry.check`; settle the reservation with
   ``usage.cost`` (billed failures too) or release it; retry, fail the prompt, or stop on 402.

Cost when the outcome is unknown: a client timeout is counted at the reservation (the request
may still run and be billed upstream); HTTP errors, connection drops and unparsable bodies carry
no usage and are taken as not billed (OpenRouter does not bill failed generations). A 200
without ``usage.cost`` is charged at the reservation too, with ``cost_known: false`` and its
generation id, so that a later run settles it at ``GET /generation``'s cost. Every charge
records its cached prompt tokens and ``cache_discount`` (from usage, else cached tokens x the
serving endpoint's prompt minus cache-read price).
A prompt is written (whole conversation, one line) only when its last turn is done.

Provider audit (``--audit-every N``): every written record goes to the :class:`Auditor`; when it
says a check is due, the check runs in a thread (one at a time) while generation goes on. A
provider it flags is added to the rule's ``ignore`` list in place, so every request sent after
that carries it, and the decision (provider, slugs, reason) is appended to ``DIR/audit.jsonl``.

The chat types (:class:`~datagen.transcript.Transcript`, a prompt answered turn by turn, and its
replies) are ``datagen.transcript``'s, shared with ``datagen.local``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from datagen import retry
from datagen.openrouter.ledger import Ledger, Reservation, upper_prompt_tokens, worst_case_usd
from datagen.openrouter.progress import Progress
from datagen.openrouter.providers import Prices, slug_matches
from datagen.openrouter.throttle import MIN_CONCURRENCY, Throttle
from datagen.transcript import Reply, Transcript, parse_reply
from eagle3.data.prompts import Prompt
from eagle3.data.records import ResultStore

log = logging.getLogger(__name__)


@dataclass
class Settings:
    base_url: str
    api_key: str
    model: str
    max_tokens: int
    temperature: float
    reasoning: dict | None
    provider: dict  # the request's provider rule (datagen.openrouter.providers.provider_block)
    prices: Prices  # dearest allowed, USD per token: reservations
    budget: float  # USD for the output directory, all runs
    token_budgets: dict  # dataset -> output tokens (None = unlimited)
    concurrency: int = 2000
    retry_policy: retry.Policy = field(default_factory=retry.Policy)  # attempts and backoff
    request_timeout: float = 900.0
    grace: float = 30.0  # seconds in-flight requests get after Ctrl-C / SIGTERM
    log_every: float = 30.0  # seconds between plain progress lines (not a TTY)
    progress_bar: bool | None = None  # None = when stderr is a TTY
    seed: int | None = None
    # Provider audit: where decisions go, display name (lower case) -> endpoint slugs, and the
    # slugs of the allowed endpoints (when the audit has excluded all of them, the run stops).
    audit_log: Path | None = None
    provider_slugs: dict = field(default_factory=dict)
    allowed_slugs: list = field(default_factory=list)
    # Prompt caching: display name (lower case) -> USD saved per cached prompt token (its
    # prompt price minus its cache-read price), for responses whose usage gives no
    # cache_discount; and the plan's $/M output tokens, shown next to what is paid.
    cache_savings: dict = field(default_factory=dict)
    plan_usd_per_m_out: float | None = None
    done_before: int = 0  # prompts earlier runs finished (progress: already done)
    # The budget is full of a dead run's requests that settle later: wait (True) or stop.
    wait_for_orphans: bool = True


class HeldOrphans(Protocol):
    """What the requester needs of :class:`datagen.openrouter.settle.Settler`."""

    on_change: Callable[[], None] | None  # set by the requester: a try may have freed money

    def could_fit(self, usd: float, budget: float) -> bool: ...  # once they settle

    def poke(self) -> None: ...  # nothing of this run is in flight: try now if safe

    def settle_in_s(self) -> float: ...  # seconds until they can be settled (0: now)

    def waiting_line(self, short: bool = False) -> str: ...  # the countdown

    def held_line(self) -> str: ...  # what holds the budget, when the run stops instead


class Auditor(Protocol):
    """What the requester needs of :class:`datagen.online_audit.OnlineAudit`."""

    def add(self, record: dict) -> bool: ...  # True when a check is due

    def check(self) -> dict[str, str]: ...  # blocking; newly flagged {display name: reason}


@dataclass
class Outcome:
    stop: str | None = None  # "budget" | "orphans" | "credits" | "interrupted" | "audit" | None
    stop_detail: str = ""
    capped: set = field(default_factory=set)  # datasets that hit their token budget
    done: int = 0  # prompts finished in this run
    failed: int = 0
    output_tokens: int = 0  # completion tokens charged in this run
    cost_usd: float = 0.0  # known charges of this run (usage.cost)
    cost_tokens: int = 0  # completion tokens of those charges
    requests: int = 0
    retries: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    length: int = 0  # finished turns with finish_reason length (kept, flagged)
    excluded: dict = field(default_factory=dict)  # provider -> {"slugs", "reason"} (audit)
    audit_failures: int = 0  # audit checks that raised (logged; generation went on)


def interleave(groups: Sequence[Sequence[Prompt]]) -> Iterator[Prompt]:
    """Round-robin over datasets, so they are drained at about the same pace."""
    iters = [iter(g) for g in groups]
    while iters:
        alive = []
        for it in iters:
            p = next(it, None)
            if p is not None:
                alive.append(it)
                yield p
        iters = alive


class Requester:
    def __init__(
        self,
        settings: Settings,
        prompts: Sequence[Sequence[Prompt]],
        store: ResultStore,
        ledger: Ledger,
        audit: Auditor | None = None,
        orphans: HeldOrphans | None = None,
    ):
        self.settings = settings
        self.audit = audit
        self.orphans = orphans
        self._countdown: asyncio.Task | None = None  # while waiting for the orphans
        self._audit_task: asyncio.Task | None = None
        self.store = store
        self.ledger = ledger
        self.total = sum(len(g) for g in prompts)
        self.queue = interleave(prompts)
        self.out = Outcome()
        self.rng = random.Random(settings.seed)
        self.chat_url = settings.base_url.rstrip("/") + "/chat/completions"
        self.headers = {
            "Authorization": f"Bearer {settings.api_key}",
            "Content-Type": "application/json",
            "HTTP-Referer": "https://github.com/eagle3-forge",
            "X-OpenRouter-Title": "eagle3-forge datagen",
        }
        self._stopping = asyncio.Event()
        self._settled = asyncio.Event()
        self._workers: list[asyncio.Task] = []
        self.started = time.monotonic()  # the run's tok/s counts from here

    # ------------------------------------------------------------------ stopping

    def stop(self, reason: str, detail: str = "") -> None:
        if self.out.stop is None:
            self.out.stop, self.out.stop_detail = reason, detail
            log.info(
                "stopping (%s): no new requests; waiting for in-flight ones. %s", reason, detail
            )
        self._stopping.set()
        self._notify_settled()

    def _wait_for_orphans(self) -> None:
        """The budget is full and only a dead run's held requests may free it: show a
        countdown (once per wait) and have the settler try as soon as it may."""
        if self._countdown is None or self._countdown.done():
            self.orphans.poke()
            self._countdown = asyncio.create_task(self._count_down())

    async def _count_down(self) -> None:
        """A live description on a terminal, else a log line every ``log_every`` seconds,
        until a request fits again or the run stops."""
        bar = self.progress.bar
        desc = bar.desc if bar is not None else ""
        last = -math.inf
        try:
            while self.ledger.open == 0 and not self._stopping.is_set():
                if bar is not None:
                    bar.set_description_str(self.orphans.waiting_line(short=True), refresh=True)
                elif time.monotonic() - last >= self.settings.log_every:
                    log.info("%s", self.orphans.waiting_line())
                    last = time.monotonic()
                await asyncio.sleep(1.0)
        finally:
            if bar is not None:
                bar.set_description_str(desc, refresh=False)

    def _on_signal(self, signum: int) -> None:
        if self.out.stop == "interrupted":  # second signal: do not wait any longer
            self._cancel_workers()
            return
        self.stop("interrupted", f"signal {signal.Signals(signum).name}")
        asyncio.get_running_loop().call_later(self.settings.grace, self._cancel_workers)

    def _cancel_workers(self) -> None:
        pending = [t for t in self._workers if not t.done()]
        if pending:
            log.warning(
                "abandoning %d in-flight request(s); counted at worst case in the ledger",
                self.throttle.active,
            )
        for t in pending:
            t.cancel()

    def _notify_settled(self) -> None:
        self._settled.set()
        self._settled = asyncio.Event()

    # ------------------------------------------------------------------ run

    async def run(self) -> Outcome:
        loop = asyncio.get_running_loop()
        self.throttle = Throttle(self.settings.concurrency)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        connector = aiohttp.TCPConnector(limit=self.settings.concurrency, keepalive_timeout=75)
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout)
        progress = self.progress = Progress(
            self.out, self.throttle, self.ledger, self.store, self.settings,
            total=self.total, started=self.started,
        )  # fmt: skip
        if self.orphans is not None:
            self.orphans.on_change = self._notify_settled
        try:
            async with aiohttp.ClientSession(
                connector=connector, timeout=timeout, headers=self.headers
            ) as session:
                self.session = session
                n = max(1, min(self.settings.concurrency, self.total))
                self._workers = [asyncio.create_task(self._worker()) for _ in range(n)]
                ticker = asyncio.create_task(progress.tick())
                results = await asyncio.gather(*self._workers, return_exceptions=True)
                if self._audit_task is not None:  # a check still running: keep its verdict
                    await self._audit_task
                ticker.cancel()
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                        raise r
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if self._countdown is not None:
                self._countdown.cancel()
            progress.close()
        return self.out

    async def _worker(self) -> None:
        while not self._stopping.is_set():
            prompt = next(self.queue, None)
            if prompt is None:
                return
            if prompt.dataset in self.out.capped:
                continue
            await self._generate(prompt)

    async def _generate(self, prompt: Prompt) -> None:
        transcript = Transcript(prompt)
        while transcript.advance():
            reply = await self._request(prompt, transcript.messages)
            if reply is None:
                return  # failed (written to failed.jsonl), stopped, or its dataset is capped
            transcript.add(reply)
        model = next((r.model for r in reversed(transcript.replies) if r.model), None)
        provider = ", ".join(transcript.providers()) or None
        record = transcript.record(model or self.settings.model, provider)
        if self.store.append(prompt.dataset, record):
            self.out.done += 1
            if self.audit is not None and self.audit.add(record) and self._audit_task is None:
                self._audit_task = asyncio.create_task(self._audit_check())

    # ------------------------------------------------------------------ provider audit

    async def _audit_check(self) -> None:
        """One audit check in a thread; exclude what it flags. Never raises: a failed check
        is logged and generation goes on."""
        try:
            flagged = await asyncio.to_thread(self.audit.check)
        except Exception as err:  # the audit is advisory: it must not end a paid run
            self.out.audit_failures += 1
            log.warning("audit: check failed, generation goes on: %s: %s", type(err).__name__, err)
            return
        finally:
            self._audit_task = None
        for provider, reason in flagged.items():
            self.exclude(provider, reason)

    def exclude(self, provider: str, reason: str) -> None:
        """Stop routing to ``provider`` (a display name, as responses report it): add its
        endpoint slugs to the rule's ``ignore`` list in place and record the decision."""
        slugs = list(self.settings.provider_slugs.get(provider.lower(), []))
        ignore = self.settings.provider.setdefault("ignore", [])
        ignore.extend(s for s in slugs if s not in ignore)  # the next payload carries them
        if slugs:
            log.info("audit: excluding %s (%s)", ", ".join(slugs), reason)
        else:
            log.warning(
                "audit: provider %r is flagged but matches no endpoint of %s, so it cannot be "
                "ignored by slug (%s)",
                provider,
                self.settings.model,
                reason,
            )
        self.out.excluded[provider] = {"slugs": slugs, "reason": reason}
        if self.settings.audit_log is not None:
            line = {
                "t": "exclude",
                "provider": provider,
                "slugs": slugs,
                "reason": reason,
                "time": round(time.time(), 3),
            }
            with open(self.settings.audit_log, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        allowed = self.settings.allowed_slugs
        if allowed and all(slug_matches(tag, ignore) for tag in allowed):
            self.stop("audit", "the audit has excluded every allowed provider")

    def _payload(self, conversation: list[dict]) -> bytes:
        body = {
            "model": self.settings.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in conversation],
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
            "stream": False,
            "provider": self.settings.provider,
        }
        if self.settings.reasoning is not None:
            body["reasoning"] = self.settings.reasoning
        return json.dumps(body, ensure_ascii=False).encode("utf-8")

    async def _reserve(self, usd: float, dataset: str) -> Reservation | None:
        """Reserve the worst case; wait while in-flight requests may free room; None = cannot."""
        while True:
            if self._stopping.is_set() or dataset in self.out.capped:
                return None
            res = self.ledger.reserve(
                usd,
                self.settings.max_tokens,
                dataset,
                self.settings.budget,
                self.settings.token_budgets.get(dataset),
            )
            if isinstance(res, Reservation):
                return res
            if res == "budget" and self.ledger.open == 0:
                if self.orphans is not None and self.orphans.could_fit(usd, self.settings.budget):
                    if not self.settings.wait_for_orphans and self.orphans.settle_in_s() > 0:
                        self.stop("orphans", self.orphans.held_line())
                        return None
                    self._wait_for_orphans()  # the settler's try wakes us (_notify_settled)
                    await self._settled.wait()
                    continue
                left = self.settings.budget - self.ledger.spent_usd
                self.stop(
                    "budget",
                    f"${left:.4f} left, a request may cost up to ${usd:.4f} "
                    f"(max_tokens {self.settings.max_tokens} at the dearest allowed price)",
                )
                return None
            if res == "tokens" and self.ledger.open_by_dataset[dataset] == 0:
                if dataset not in self.out.capped:
                    self.out.capped.add(dataset)
                    log.info("%s: output-token budget reached; no new requests for it", dataset)
                return None
            await self._settled.wait()

    async def _post(self, body: bytes) -> tuple[int | None, dict, bytes, str | None]:
        try:
            async with self.session.post(self.chat_url, data=body) as resp:
                raw = await resp.read()
                return resp.status, resp.headers, raw, None
        except TimeoutError:
            return None, {}, b"", "timeout"
        except aiohttp.ClientConnectorError:
            return None, {}, b"", "connect error"
        except aiohttp.ClientError as err:
            return None, {}, b"", f"connection error ({type(err).__name__})"

    async def _request(self, prompt: Prompt, conversation: list[dict]) -> Reply | None:
        """One assistant turn, retried as :mod:`datagen.retry` says; None when the prompt
        failed for good (written to failed.jsonl), the run is stopping or its dataset capped."""
        settings, out = self.settings, self.out
        prices = settings.prices
        worst = worst_case_usd(
            upper_prompt_tokens(conversation),
            settings.max_tokens,
            prices.prompt,
            prices.completion,
            prices.request,
        )

        async def send(attempt: int) -> retry.Attempt | None:
            await self.throttle.acquire()
            try:
                res = await self._reserve(worst, prompt.dataset)
                if res is None:
                    return None
                out.requests += 1
                sent_at = asyncio.get_running_loop().time()
                body = self._payload(conversation)  # now: the audit may have extended ignore
                status, headers, raw, exc = await self._post(body)
            finally:
                self.throttle.release()
            payload = retry.parse_body(raw)
            if exc is not None:
                verdict = retry.Verdict(retry.RETRY, exc)
            else:
                verdict = retry.check(status, payload)
            self._settle(res, prompt, verdict, payload, headers, exc)
            if verdict.action == retry.OK:
                self.throttle.on_success()
            else:
                out.errors[verdict.reason] += 1
            if verdict.action == retry.RETRY and (status == 429 or verdict.reason.endswith("429")):
                hint = retry.server_hint(headers, payload, now=time.time())
                self.throttle.on_rate_limit(hint, sent_at)
            return retry.Attempt(verdict, status, headers, payload)

        def on_retry(attempt: int, last: retry.Attempt, wait: float) -> None:
            out.retries[last.verdict.reason] += 1
            log.debug(
                "%s: attempt %d: %s; retry in %.2fs", prompt.id, attempt, last.verdict.reason, wait
            )

        sent = await retry.send_with_retries(
            send, settings.retry_policy, self.rng, pause=self._pause, on_retry=on_retry
        )
        if sent is None:
            return None
        last, attempts = sent
        verdict = last.verdict
        if verdict.action == retry.OK:
            reply = parse_reply(last.body)
            if reply.finish_reason == "length":
                out.length += 1
            return reply
        if verdict.action == retry.NO_CREDITS:
            self.stop("credits", verdict.detail)
            return None
        gave_up = verdict.action == retry.RETRY
        retry.fail_prompt(
            self.store,
            prompt,
            verdict,
            status=None if gave_up else last.status,
            attempts=attempts,
            gave_up=gave_up,
        )
        out.failed += 1
        return None

    async def _pause(self, seconds: float) -> bool:
        """Wait before a retry; False when the run starts stopping meanwhile (the prompt is
        left for the next run)."""
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        except TimeoutError:
            return True
        return False

    def _settle(self, res, prompt, verdict, payload, headers, exc) -> None:
        usage = payload.get("usage") if payload else None
        gen_id = (payload or {}).get("id") or headers.get("X-Generation-Id")
        provider = (payload or {}).get("provider")
        ok = verdict.action == retry.OK
        cached, discount = self._cache(usage, provider)
        if isinstance(usage, dict) and usage.get("cost") is not None:
            tokens = int(usage.get("completion_tokens") or 0)
            cost = float(usage["cost"])
            self.ledger.charge(
                res,
                cost,
                tokens,
                prompt_id=prompt.id,
                generation_id=gen_id,
                provider=provider,
                ok=ok,
                reason=verdict.reason,
                cached_tokens=cached,
                cache_discount=discount,
            )
            self.out.output_tokens += tokens
            self.out.cost_usd += cost
            self.out.cost_tokens += tokens
        elif ok or exc == "timeout":  # billed, or maybe billed, for an unknown amount
            self.ledger.charge(
                res,
                res.usd,
                res.tokens,
                prompt_id=prompt.id,
                generation_id=gen_id,
                provider=provider,
                ok=ok,
                reason=f"{verdict.reason}; cost unknown, counted at worst case",
                cost_known=False,
                cached_tokens=cached,
                cache_discount=discount,
            )
        else:
            self.ledger.release(res)
        self._notify_settled()

    def _cache(self, usage, provider: str | None) -> tuple[int, float | None]:
        """Cached prompt tokens and the discount they earned: ``usage.cache_discount`` when the
        response gives it, else cached tokens x the serving endpoint's saving per token."""
        if not isinstance(usage, dict):
            return 0, None
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        discount = usage.get("cache_discount")
        if discount is not None:
            return cached, float(discount)
        saving = self.settings.cache_savings.get((provider or "").lower())
        return cached, (cached * saving if cached and saving is not None else None)


# imported from here by the CLI, the report and the tests: the throttle and the progress line
# have modules of their own
__all__ = [
    "MIN_CONCURRENCY",
    "Auditor",
    "HeldOrphans",
    "Outcome",
    "Progress",
    "Requester",
    "Settings",
    "Throttle",
    "interleave",
]
