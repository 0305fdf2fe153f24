"""Retry policy for chat-completion responses, and the one retry loop both clients use.

``check(status, body)`` sorts every response into one of four verdicts, listing the reasons
flatly (OpenRouter documents errors both as HTTP statuses and as an ``error`` inside HTTP 200):

- ``OK``: usable data;
- ``RETRY``: 408/429/5xx, connection errors, timeouts, and HTTP 200 bodies that are failures
  (top-level ``error``, ``finish_reason: "error"``, no ``choices``, empty content with no
  reasoning, think tags out of place (:func:`eagle3.data.chat.split_thinking`: a reply given
  as ``reasoning</think>answer`` is read as its reasoning and answer),
  whitespace-then-nothing bodies);
- ``FAIL``: 400/401/403/404 and other 4xx: retrying cannot help, the prompt is marked failed;
- ``NO_CREDITS``: 402, the account is out of credit: stop sending.

``delay(attempt, headers, body, now, rng)`` is the wait before the next attempt: the server's
hint when it gives one (``Retry-After`` seconds or HTTP date, ``X-RateLimit-Reset`` in epoch
milliseconds, ``error.availability.retry_after``), capped at ``MAX_HINT_S``, else capped
exponential backoff; both with jitter so 2000 waiting requests do not return in lockstep.

These are pure functions. :func:`send_with_retries` is the loop around them that
``datagen.openrouter.requester`` (OpenRouter) and ``datagen.local`` (own servers) share;
sending, waiting and bookkeeping are the caller's callbacks, so each keeps its own throttle,
ledger and stop rules. The retry defaults are the constants below, written once: the OpenRouter
config's ``max_attempts``, ``retry_initial_s`` and ``retry_max_s`` default to them.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3.data.chat import RenderError, split_thinking
from eagle3.data.records import make_failure

if TYPE_CHECKING:
    from eagle3.data.prompts import Prompt
    from eagle3.data.records import ResultStore

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 6  # tries per request in all
INITIAL_DELAY_S = 0.5  # first backoff
MAX_DELAY_S = 8.0  # exponential backoff cap
MAX_HINT_S = 120.0  # longest server-requested wait we honour
JITTER = 0.25  # backoff is scaled by a factor in [1 - JITTER, 1]; hints get up to +JITTER

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504, 524, 529})

OK, RETRY, FAIL, NO_CREDITS = "ok", "retry", "fail", "no_credits"


@dataclass(frozen=True)
class Verdict:
    action: str  # OK | RETRY | FAIL | NO_CREDITS
    reason: str  # short, stable kind used in logs and counters ("http 429", "empty content"...)
    detail: str = ""  # the server's message, when there is one


def parse_body(raw: bytes | str | None) -> dict | None:
    """JSON object of a response body, or None when it is not one (e.g. whitespace only)."""
    if not raw or not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _error_status(error: Any) -> int | None:
    """``error.code`` as an int when it is one ("server_error" and friends give None)."""
    code = error.get("code") if isinstance(error, dict) else None
    try:
        return int(code)
    except (TypeError, ValueError):
        return None


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", ""))[:300]
    return str(error)[:300]


def _from_status(status: int, detail: str) -> Verdict:
    if status == 402:
        return Verdict(NO_CREDITS, "http 402", detail)
    if status in RETRYABLE_STATUS or status >= 500:
        return Verdict(RETRY, f"http {status}", detail)
    return Verdict(FAIL, f"http {status}", detail)


def check(status: int, body: dict | None) -> Verdict:
    """Classify one chat-completion response (``body`` from :func:`parse_body`)."""
    error = body.get("error") if body else None
    if status != 200:
        return _from_status(status, _error_message(error) if error else "")
    if body is None:
        return Verdict(RETRY, "unparsable body")
    if error:  # an error inside HTTP 200 (e.g. code 524): retry unless it is a client error
        code = _error_status(error)
        if code is not None and code != 200:
            verdict = _from_status(code, _error_message(error))
            return Verdict(verdict.action, "200 with " + verdict.reason, verdict.detail)
        return Verdict(RETRY, "200 with error", _error_message(error))
    choices = body.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return Verdict(RETRY, "no choices")
    choice = choices[0]
    if choice.get("finish_reason") == "error" or choice.get("error"):
        return Verdict(RETRY, "finish_reason error", _error_message(choice.get("error", "")))
    message = choice.get("message") or {}
    try:
        reasoning, content = split_thinking(message)
    except RenderError as err:  # another sample may close its tags
        return Verdict(RETRY, err.reason, str(err))
    if not content.strip() and not reasoning.strip():
        return Verdict(RETRY, "empty content")
    if not content.strip() and choice.get("finish_reason") != "length":
        return Verdict(RETRY, "reasoning without answer")
    return Verdict(OK, "ok")


def _hint_seconds(headers: Mapping[str, str], body: dict | None, now: float) -> float | None:
    """Server-requested wait in seconds, if the response carries one. ``now``: epoch seconds."""
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - now)
            except (ValueError, TypeError):
                pass  # neither seconds nor an HTTP date: look for another hint
    reset = headers.get("X-RateLimit-Reset") or headers.get("x-ratelimit-reset")
    if reset:
        try:
            return max(0.0, float(reset) / 1000.0 - now)  # epoch milliseconds
        except ValueError:
            pass
    error = body.get("error") if body else None
    if isinstance(error, dict):
        availability = error.get("availability")
        if isinstance(availability, dict) and availability.get("retry_after") is not None:
            try:
                return max(0.0, float(availability["retry_after"]))
            except (TypeError, ValueError):
                pass
        meta_headers = (error.get("metadata") or {}).get("headers")
        if isinstance(meta_headers, dict) and meta_headers:
            return _hint_seconds({str(k): str(v) for k, v in meta_headers.items()}, None, now)
    return None


def delay(
    attempt: int,
    headers: Mapping[str, str] | None = None,
    body: dict | None = None,
    *,
    now: float,
    rng: random.Random | None = None,
    initial: float = INITIAL_DELAY_S,
    maximum: float = MAX_DELAY_S,
) -> float:
    """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
    r = (rng or random).random()
    hint = _hint_seconds(headers or {}, body, now)
    if hint is not None:
        hint = min(hint, MAX_HINT_S)
        return hint + JITTER * r * max(hint, initial)
    backoff = min(initial * 2 ** (attempt - 1), maximum)
    return backoff * (1.0 - JITTER * r)


def server_hint(
    headers: Mapping[str, str] | None, body: dict | None, *, now: float
) -> float | None:
    """The capped server-requested wait alone (used by the shared 429 gate)."""
    hint = _hint_seconds(headers or {}, body, now)
    return None if hint is None else min(hint, MAX_HINT_S)


# ---------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Policy:
    """How many attempts a request gets in all, and the backoff's first wait and cap."""

    max_attempts: int = MAX_ATTEMPTS
    initial: float = INITIAL_DELAY_S
    maximum: float = MAX_DELAY_S


@dataclass(frozen=True)
class Attempt:
    """What one try of a request came back with."""

    verdict: Verdict
    status: int | None = None  # None: no HTTP answer (timeout, connection error) or not sent
    headers: Mapping[str, str] = field(default_factory=dict)
    body: dict | None = None


async def _sleep(seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return True


async def send_with_retries(
    send: Callable[[int], Awaitable[Attempt | None]],
    policy: Policy,
    rng: random.Random,
    *,
    pause: Callable[[float], Awaitable[bool]] = _sleep,
    on_retry: Callable[[int, Attempt, float], None] | None = None,
) -> tuple[Attempt, int] | None:
    """``send(attempt)`` (counting from 1) until its verdict is not RETRY or the attempts run
    out -> (the last attempt, attempts made); gave up when that verdict is still RETRY.

    Between tries ``on_retry(attempt, last, wait)`` runs, then ``pause(wait)``. None when
    ``send`` returns None or ``pause`` returns False: the caller is stopping, nothing to record.
    """
    last, attempt = Attempt(Verdict(RETRY, "not sent")), 0
    while attempt < policy.max_attempts:
        attempt += 1
        sent = await send(attempt)
        if sent is None:
            return None
        last = sent
        if last.verdict.action != RETRY or attempt == policy.max_attempts:
            break
        wait = delay(
            attempt,
            last.headers,
            last.body,
            now=time.time(),
            rng=rng,
            initial=policy.initial,
            maximum=policy.maximum,
        )
        if on_retry is not None:
            on_retry(attempt, last, wait)
        if not await pause(wait):
            return None
    return last, attempt


def fail_prompt(
    store: ResultStore,
    prompt: Prompt,
    verdict: Verdict,
    *,
    status: int | None,
    attempts: int,
    gave_up: bool,
) -> None:
    """Write a prompt that failed for good to DIR/failed.jsonl and log one warning line."""
    reason = (
        f"gave up after {attempts} attempts; last: {verdict.reason}" if gave_up else verdict.reason
    )
    store.append_failed(
        make_failure(prompt, reason, status=status, detail=verdict.detail, attempts=attempts)
    )
    log.warning("%s/%s failed: %s %s", prompt.dataset, prompt.id, reason, verdict.detail)
