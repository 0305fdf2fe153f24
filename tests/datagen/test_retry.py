"""The retry policy: a table of responses -> verdicts, and delays with mocked time and jitter."""

import asyncio
import email.utils
import random

import pytest

from datagen import retry
from datagen.retry import FAIL, NO_CREDITS, OK, RETRY

GOOD = {"choices": [{"finish_reason": "stop", "message": {"content": "hi", "reasoning": "hm"}}]}


def choice(**kw):
    return {"choices": [{"finish_reason": "stop", "message": {"content": "hi"}, **kw}]}


CASES = [
    # (name, status, raw body, action, reason)
    ("ok", 200, GOOD, OK, "ok"),
    ("length kept", 200, choice(finish_reason="length"), OK, "ok"),
    (
        "reasoning only, cut",
        200,
        {"choices": [{"finish_reason": "length", "message": {"content": "", "reasoning": "x"}}]},
        OK,
        "ok",
    ),
    ("400", 400, {"error": {"code": 400, "message": "bad"}}, FAIL, "http 400"),
    ("401", 401, {"error": {"code": 401, "message": "key"}}, FAIL, "http 401"),
    (
        "403 moderation",
        403,
        {"error": {"code": 403, "metadata": {"reasons": ["x"]}}},
        FAIL,
        "http 403",
    ),
    ("404 no endpoint", 404, {"error": {"code": 404}}, FAIL, "http 404"),
    ("402", 402, {"error": {"code": 402, "message": "can only afford 10"}}, NO_CREDITS, "http 402"),
    ("408", 408, None, RETRY, "http 408"),
    ("429", 429, {"error": {"code": 429}}, RETRY, "http 429"),
    ("500", 500, None, RETRY, "http 500"),
    ("502", 502, {"error": {"code": 502}}, RETRY, "http 502"),
    ("503", 503, None, RETRY, "http 503"),
    ("504", 504, None, RETRY, "http 504"),
    ("524", 524, None, RETRY, "http 524"),
    ("529", 529, None, RETRY, "http 529"),
    ("other 5xx", 599, None, RETRY, "http 599"),
    # failures inside HTTP 200
    (
        "200 top-level error 524",
        200,
        {"error": {"code": 524, "message": "timeout"}},
        RETRY,
        "200 with http 524",
    ),
    (
        "200 error with string code",
        200,
        {"error": {"code": "server_error", "message": "x"}},
        RETRY,
        "200 with error",
    ),
    (
        "200 error with 400 code",
        200,
        {"error": {"code": 400, "message": "x"}},
        FAIL,
        "200 with http 400",
    ),
    (
        "200 finish_reason error",
        200,
        choice(finish_reason="error", error={"code": 502, "message": "x"}),
        RETRY,
        "finish_reason error",
    ),
    ("200 no choices", 200, {"id": "gen-1", "choices": []}, RETRY, "no choices"),
    ("200 choices missing", 200, {"id": "gen-1"}, RETRY, "no choices"),
    (
        "200 empty content",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": ""}}]},
        RETRY,
        "empty content",
    ),
    (
        "200 null content",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": None}}]},
        RETRY,
        "empty content",
    ),
    (
        "200 whitespace content",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": " \n"}}]},
        RETRY,
        "empty content",
    ),
    (
        "200 reasoning, no answer",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": "", "reasoning": "x"}}]},
        RETRY,
        "reasoning without answer",
    ),
    (
        "200 reasoning</think>answer (no reasoning parser)",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": "x</think>4"}}]},
        OK,
        "ok",
    ),
    (
        "200 reasoning</think> and no answer",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": "x</think> "}}]},
        RETRY,
        "reasoning without answer",
    ),
    (
        "200 two </think>",
        200,
        {"choices": [{"finish_reason": "stop", "message": {"content": "x</think>y</think>4"}}]},
        RETRY,
        "unbalanced think tags",
    ),
    (
        "200 </think> beside reasoning_content",
        200,
        {
            "choices": [
                {"finish_reason": "stop", "message": {"content": "x</think>4", "reasoning": "x"}}
            ]
        },
        RETRY,
        "unbalanced think tags",
    ),
]


@pytest.mark.parametrize("name,status,body,action,reason", CASES, ids=[c[0] for c in CASES])
def test_check_table(name, status, body, action, reason):
    verdict = retry.check(status, body)
    assert (verdict.action, verdict.reason) == (action, reason)
    retried = verdict.reason if verdict.action == RETRY else None
    assert retried == (reason if action == RETRY else None)


@pytest.mark.parametrize("raw", [b"", b"   \n\n  ", b'{"choices": [', b"[1, 2]", b"\xff\xfe", None])
def test_unparsable_200_bodies_are_retried(raw):
    assert retry.parse_body(raw) is None
    assert retry.check(200, retry.parse_body(raw)) == retry.Verdict(RETRY, "unparsable body")


class FixedRng:
    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


NOW = 1_750_000_000.0  # mocked epoch seconds
DELAYS = [
    # (name, attempt, headers, body, rng value, expected seconds)
    ("first backoff, no jitter", 1, {}, None, 0.0, 0.5),
    ("first backoff, full jitter", 1, {}, None, 1.0, 0.5 * (1 - retry.JITTER)),
    ("doubling", 3, {}, None, 0.0, 2.0),
    ("capped", 10, {}, None, 0.0, retry.MAX_DELAY_S),
    ("Retry-After seconds", 1, {"Retry-After": "3"}, None, 0.0, 3.0),
    ("Retry-After with jitter", 1, {"Retry-After": "4"}, None, 1.0, 4.0 * (1 + retry.JITTER)),
    ("Retry-After lower case", 1, {"retry-after": "2.5"}, None, 0.0, 2.5),
    (
        "Retry-After HTTP date",
        1,
        {"Retry-After": email.utils.formatdate(NOW + 7, usegmt=True)},
        None,
        0.0,
        7.0,
    ),
    ("Retry-After capped", 1, {"Retry-After": "9999"}, None, 0.0, retry.MAX_HINT_S),
    (
        "X-RateLimit-Reset epoch ms",
        1,
        {"X-RateLimit-Reset": str(int((NOW + 5) * 1000))},
        None,
        0.0,
        5.0,
    ),
    (
        "X-RateLimit-Reset in the past",
        1,
        {"X-RateLimit-Reset": str(int((NOW - 5) * 1000))},
        None,
        0.0,
        0.0,
    ),
    (
        "availability.retry_after",
        2,
        {},
        {"error": {"code": 429, "availability": {"retry_after": 6}}},
        0.0,
        6.0,
    ),
    (
        "metadata.headers echo",
        1,
        {},
        {
            "error": {
                "code": 429,
                "metadata": {"headers": {"X-RateLimit-Reset": int((NOW + 4) * 1000)}},
            }
        },
        0.0,
        4.0,
    ),
    ("garbage hint falls back to backoff", 2, {"Retry-After": "soon-ish"}, None, 0.0, 1.0),
]


@pytest.mark.parametrize("name,attempt,headers,body,r,expected", DELAYS, ids=[d[0] for d in DELAYS])
def test_delay_table(name, attempt, headers, body, r, expected):
    got = retry.delay(attempt, headers, body, now=NOW, rng=FixedRng(r))
    assert got == pytest.approx(expected, abs=1e-6)


def test_delay_custom_scale_and_jitter_spread():
    rng = random.Random(0)
    waits = [retry.delay(2, now=NOW, rng=rng, initial=0.01, maximum=0.05) for _ in range(200)]
    assert all(0.02 * (1 - retry.JITTER) - 1e-12 <= w <= 0.02 for w in waits)
    assert len({round(w, 9) for w in waits}) > 100  # jittered, not in lockstep
    assert retry.delay(9, now=NOW, rng=FixedRng(0.0), initial=0.01, maximum=0.05) == 0.05


def test_server_hint_alone():
    assert retry.server_hint({"Retry-After": "2"}, None, now=NOW) == 2.0
    assert retry.server_hint({}, None, now=NOW) is None
    assert retry.server_hint({"Retry-After": "1e6"}, None, now=NOW) == retry.MAX_HINT_S


# ---------------------------------------------------------------------------- the loop


def run_loop(verdicts, max_attempts=4, go_on=True):
    """send_with_retries over scripted verdicts -> (result, waits paused, retries reported)."""
    script = iter(verdicts)
    waits, retried = [], []

    async def send(attempt):
        action = next(script)
        return None if action is None else retry.Attempt(retry.Verdict(action, action))

    async def pause(wait):
        waits.append(wait)
        return go_on

    policy = retry.Policy(max_attempts, initial=1.0, maximum=4.0)
    result = asyncio.run(
        retry.send_with_retries(
            send, policy, FixedRng(0.0), pause=pause, on_retry=lambda a, _, w: retried.append(a)
        )
    )
    return result, waits, retried


@pytest.mark.parametrize(
    "verdicts, max_attempts, action, attempts, waits",
    [
        ([OK], 4, OK, 1, []),
        ([RETRY, RETRY, OK], 4, OK, 3, [1.0, 2.0]),
        ([RETRY, FAIL], 4, FAIL, 2, [1.0]),
        ([NO_CREDITS], 4, NO_CREDITS, 1, []),
        ([RETRY] * 4, 4, RETRY, 4, [1.0, 2.0, 4.0]),  # gave up: no wait after the last
        ([], 0, RETRY, 0, []),  # no attempt allowed: "not sent"
    ],
)
def test_send_with_retries_table(verdicts, max_attempts, action, attempts, waits):
    (last, made), paused, retried = run_loop(verdicts, max_attempts)
    assert (last.verdict.action, made, paused) == (action, attempts, waits)
    assert retried == list(range(1, len(waits) + 1))


def test_send_with_retries_stops_when_the_caller_does():
    assert run_loop([None])[0] is None  # send: nothing sent (stopping, or out of budget)
    result, paused, _ = run_loop([RETRY, OK], go_on=False)  # pause: stopping while waiting
    assert result is None and paused == [1.0]
