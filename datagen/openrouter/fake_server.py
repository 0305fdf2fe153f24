"""A fake OpenRouter on 127.0.0.1 for tests, benchmarks and dry runs.

Serves ``/api/v1/chat/completions``, ``/api/v1/models/{author}/{slug}/endpoints``,
``/api/v1/key``, ``/api/v1/credits`` and ``/api/v1/generation?id=`` with: a provider table (the
Kimi-K2.5 providers with their quantizations and prices, :mod:`datagen.openrouter.fake_endpoints`), routing like ``sort: price`` under the
request's ``provider`` rule, cost from the routed endpoint's prices, prompt caching (a
multi-turn request's prefix, everything before its last user turn, is billed at the endpoint's
``input_cache_read`` price and reported as ``prompt_tokens_details.cached_tokens`` and
``cache_discount``), credits that run out (402, pre-authorising ``max_tokens`` like the real
one), injected faults at set rates, a set latency, reasoning in responses, and a rule check: a
request whose ``provider`` block would let the router reach a forbidden endpoint (default:
Fireworks NVFP4, BaseTen FP4) is counted and rejected with 400.

Billing is upstream's: a request is billed when its generation finishes, even if the client has
gone away meanwhile (aiohttp does not cancel a handler whose client disconnects), and
``/key``'s ``usage`` is everything billed (``stats.bills``: when, and how much), at once. With
``api_key`` set, every route wants ``Authorization: Bearer <api_key>``; others get 401 and are
counted (``stats.unauthorised``).

As a module (tests)::

    server = FakeServerThread(FakeConfig(latency=0.01, faults={"429": 0.1}))
    url = server.start()            # "http://127.0.0.1:PORT/api/v1"
    ...; server.stats.charged_usd; server.stop()

As a command (dry runs, the benchmarks)::

    python -m datagen.openrouter.fake_server --latency 0.2 --faults 429=0.02,truncated=0.01 --credits 5
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import random
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from datagen.openrouter.fake_endpoints import FORBIDDEN, KIMI_ENDPOINTS, PER_M

# no_cost: a good answer whose usage has no cost (billed; /generation knows the cost)
FAULTS = (
    "429",
    "502",
    "524_in_200",
    "no_choices",
    "finish_error",
    "empty",
    "truncated",
    "drop",
    "no_cost",
)


@dataclass
class FakeConfig:
    endpoints: list = field(default_factory=lambda: [dict(e) for e in KIMI_ENDPOINTS])
    forbidden: tuple = FORBIDDEN  # tags no request may be able to reach
    model: str = "moonshotai/kimi-k2.5"
    credits: float = math.inf  # USD on the account; a request it cannot pre-authorise gets 402
    latency: float = 0.0  # seconds per chat request
    faults: dict = field(default_factory=dict)  # kind (see FAULTS) -> rate in [0, 1]
    retry_after: float = 0.05  # Retry-After seconds of injected 429s
    max_inflight: int | None = None  # above this many concurrent chat requests: 429 (a storm)
    completion_tokens: tuple = (20, 200)  # drawn uniformly; >= max_tokens -> finish length
    api_key: str | None = None  # when set, every route needs "Bearer <api_key>"
    cache: bool = True  # multi-turn prefixes billed at the endpoint's input_cache_read
    seed: int = 0


@dataclass
class Stats:
    requests: int = 0
    chat: int = 0
    inflight: int = 0
    max_inflight_seen: int = 0
    statuses: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    providers: Counter = field(default_factory=Counter)  # tag -> requests routed there
    charged_usd: float = 0.0  # everything billed, failures included
    billed: int = 0
    bills: list = field(default_factory=list)  # (time.time(), usd) of every billing, in order
    cached_tokens: int = 0  # prompt tokens billed at the cache-read price
    cache_discount_usd: float = 0.0
    unauthorised: int = 0  # requests rejected for a missing or wrong key
    paths: Counter = field(default_factory=Counter)  # route -> requests
    violations: int = 0
    violation_examples: list = field(default_factory=list)
    ok_contents: Counter = field(
        default_factory=Counter
    )  # hash of the last user turn -> ok answers


def _per_m(price: str) -> float:
    return round(float(price) * PER_M, 6)


def _prompt_tokens(messages) -> int:
    """What the fake bills as prompt tokens: bytes / 4 + 8 per message (real BPE is similar)."""
    n = 0
    for m in messages:
        content = m.get("content") or ""
        n += len(str(content).encode("utf-8")) // 4 + 8
    return n


def _error(status: int, message: str, headers=None, **extra) -> web.Response:
    body = {"error": {"code": status, "message": message, **extra}}
    return web.json_response(body, status=status, headers=headers)


class FakeOpenRouter:
    """The aiohttp application and its state; ``start()`` / ``stop()`` inside a running loop."""

    def __init__(self, config: FakeConfig | None = None):
        self.config = config or FakeConfig()
        self.stats = Stats()
        self.rng = random.Random(self.config.seed)
        self._ids = itertools.count(1)
        self.generations: dict[str, dict] = {}  # id -> GET /generation data (billed ones)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/api/v1/chat/completions", self.chat)
        app.router.add_get("/api/v1/models/{author}/{slug}/endpoints", self.endpoints)
        app.router.add_get("/api/v1/key", self.key)
        app.router.add_get("/api/v1/credits", self.credits)
        app.router.add_get("/api/v1/generation", self.generation)
        app.middlewares.append(self._count_and_authorise)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(4096)
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock, backlog=4096).start()
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ helpers

    def _authorised(self, request: web.Request) -> bool:
        key = self.config.api_key
        return key is None or request.headers.get("Authorization") == f"Bearer {key}"

    @web.middleware
    async def _count_and_authorise(self, request: web.Request, handler):
        """Every route: count it, and with ``api_key`` set reject a request without it."""
        route = request.match_info.route.resource
        self.stats.paths[route.canonical if route is not None else request.path] += 1
        if not self._authorised(request):
            self.stats.unauthorised += 1
            self.stats.requests += 1
            return _error(401, "No auth credentials found")
        return await handler(request)

    @property
    def credits_left(self) -> float:
        return self.config.credits - self.stats.charged_usd

    def reachable(self, provider: dict | None, max_tokens: int) -> list[dict]:
        """Endpoints the request's provider rule lets the router use (down ones included)."""
        provider = provider or {}
        ignore = {s.lower() for s in provider.get("ignore") or []}
        quants = provider.get("quantizations")
        max_price = provider.get("max_price") or {}
        out = []
        for e in self.config.endpoints:
            tag = e["tag"]
            if tag in ignore or tag.split("/")[0] in ignore:
                continue
            if quants is not None and (e.get("quantization") or "unknown") not in quants:
                continue
            p = e["pricing"]
            if "prompt" in max_price and _per_m(p["prompt"]) > float(max_price["prompt"]) + 1e-9:
                continue
            if (
                "completion" in max_price
                and _per_m(p["completion"]) > float(max_price["completion"]) + 1e-9
            ):
                continue
            if e.get("max_completion_tokens") and e["max_completion_tokens"] < max_tokens:
                continue
            out.append(e)
        return out

    # ------------------------------------------------------------------ handlers

    async def endpoints(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        slug = f"{request.match_info['author']}/{request.match_info['slug']}"
        if slug != self.config.model:
            return _error(404, f"model {slug} not found")
        return web.json_response(
            {"data": {"id": slug, "name": slug, "endpoints": self.config.endpoints}}
        )

    async def key(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        limit = None if math.isinf(self.config.credits) else self.config.credits
        remaining = None if limit is None else max(0.0, self.credits_left)
        return web.json_response(
            {
                "data": {
                    "label": "fake",
                    "limit": limit,
                    "limit_remaining": remaining,
                    "usage": self.stats.charged_usd,
                    "is_free_tier": False,
                }
            }
        )

    async def credits(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        total = 1e9 if math.isinf(self.config.credits) else self.config.credits
        return web.json_response(
            {"data": {"total_credits": total, "total_usage": self.stats.charged_usd}}
        )

    async def generation(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        data = self.generations.get(request.query.get("id", ""))
        if data is None:
            return _error(404, "Generation not found")
        return web.json_response({"data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        st = self.stats
        st.requests += 1
        st.chat += 1
        st.inflight += 1
        st.max_inflight_seen = max(st.max_inflight_seen, st.inflight)
        try:
            response = await self._chat(request)
        finally:
            st.inflight -= 1
        st.statuses[response.status] += 1
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """One chat completion as OpenRouter answers it: the provider rule, routing to the
        cheapest live endpoint, credits, the configured faults, then the bill and the body."""
        cfg, st = self.config, self.stats
        try:
            req = await request.json()
        except ValueError:
            return _error(400, "invalid JSON body")
        if req.get("model") != cfg.model:
            return _error(400, f"{req.get('model')} is not a valid model ID")
        messages = req.get("messages") or []
        max_tokens = int(req.get("max_tokens") or 4096)
        route = self._route(req.get("provider"), max_tokens)
        if isinstance(route, web.Response):
            return route
        p_in = float(route["pricing"]["prompt"])
        p_out = float(route["pricing"]["completion"])
        prompt_tokens = _prompt_tokens(messages)
        cached, p_cache = self._cached_prefix(route, messages)

        if cfg.latency:
            await asyncio.sleep(cfg.latency)

        if cfg.max_inflight is not None and st.inflight > cfg.max_inflight:
            st.faults["storm"] += 1
            return self._rate_limited()
        affordable = (self.credits_left - prompt_tokens * p_in) / p_out if p_out else math.inf
        if affordable < max_tokens:
            return _error(
                402,
                f"This request requires more credits, or fewer max_tokens. You requested up to "
                f"{max_tokens} tokens, but can only afford {max(0, int(affordable))}.",
            )

        fault = self._draw_fault()
        if fault:
            st.faults[fault] += 1
        if fault == "429":
            return self._rate_limited()
        if fault == "502":
            return _error(502, "Provider returned error")
        if fault == "drop":
            request.transport.close()
            return web.Response(status=499)
        gen_id = f"gen-{int(time.time())}-{next(self._ids):08d}"
        headers = {"X-Generation-Id": gen_id}
        if fault in ("truncated", "524_in_200", "no_choices"):
            return await self._malformed(fault, request, gen_id, headers)

        usage, finish = self._usage(route, prompt_tokens, cached, p_cache, max_tokens)
        self._bill(gen_id, route, usage, finish)
        if fault == "no_cost":
            del usage["cost"]
        body = {
            "id": gen_id,
            "provider": route["provider_name"],
            "model": cfg.model + "-0127",
            "object": "chat.completion",
            "created": int(time.time()),
            "choices": [self._choice(route, messages, usage, finish, fault)],
            "usage": usage,
        }
        return web.Response(
            body=json.dumps(body).encode(), content_type="application/json", headers=headers
        )

    def _usage(
        self, route: dict, prompt_tokens: int, cached: int, p_cache: float, max_tokens: int
    ) -> tuple[dict, str]:
        """(the response's usage with its cost, the finish reason): a drawn completion length,
        cut at ``max_tokens``; the cached prefix billed at ``p_cache``."""
        p_in = float(route["pricing"]["prompt"])
        p_out = float(route["pricing"]["completion"])
        lo, hi = self.config.completion_tokens
        completion = self.rng.randint(lo, hi)
        finish = "stop"
        if completion >= max_tokens:
            completion, finish = max_tokens, "length"
        discount = cached * (p_in - p_cache)
        cost = prompt_tokens * p_in - discount + completion * p_out
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "cost": cost,
            "is_byok": False,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": completion // 3},
        }
        if cached:
            usage["cache_discount"] = discount
        return usage, finish

    def _route(self, provider: dict | None, max_tokens: int) -> dict | web.Response:
        """The endpoint a request goes to (the cheapest live one its provider rule reaches), or
        the error OpenRouter answers; reaching a forbidden provider is a counted violation."""
        st = self.stats
        reachable = self.reachable(provider, max_tokens)
        forbidden = self.config.forbidden
        bad = sorted({e["tag"] for e in reachable if e["tag"].split("/")[0] in forbidden})
        if bad:
            st.violations += 1
            if len(st.violation_examples) < 5:
                st.violation_examples.append({"provider": provider, "reach": bad})
            return _error(400, f"provider rule violation: the request may route to {bad}")
        live = [e for e in reachable if (e.get("status") or 0) >= 0]
        if not live:
            return _error(404, "No endpoints found matching your data policy and provider rule")
        return min(
            live,
            key=lambda e: (float(e["pricing"]["completion"]), float(e["pricing"]["prompt"])),
        )

    def _cached_prefix(self, route: dict, messages: list[dict]) -> tuple[int, float]:
        """(cached prompt tokens, their price): the conversation before the last user turn was
        sent with the previous turn, so a caching endpoint reads it from its cache."""
        p_in = float(route["pricing"]["prompt"])
        if not self.config.cache or route["pricing"].get("input_cache_read") is None:
            return 0, p_in
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
        if not any(m.get("role") == "assistant" for m in messages[:last]):
            return 0, p_in
        cache_price = min(p_in, float(route["pricing"]["input_cache_read"]))
        return _prompt_tokens(messages[:last]), cache_price

    async def _malformed(
        self, fault: str, request: web.Request, gen_id: str, headers: dict
    ) -> web.StreamResponse:
        """A 200 that carries no answer: a truncated body, an error inside the 200, no choices."""
        if fault == "truncated":
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_type = "application/json"
            await resp.prepare(request)
            await resp.write(b"\n\n   \n")
            await resp.write_eof()
            return resp
        if fault == "524_in_200":
            body = {"error": {"code": 524, "message": "Provider timed out", "metadata": {}}}
            return web.json_response(body, headers=headers)
        body = {"id": gen_id, "object": "chat.completion", "choices": []}
        return web.json_response(body, headers=headers)

    def _bill(self, gen_id: str, route: dict, usage: dict, finish: str) -> None:
        """Charge a generation and keep it for GET /generation, as OpenRouter settles it."""
        st, cost = self.stats, usage["cost"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        discount = usage.get("cache_discount", 0.0)
        st.charged_usd += cost
        st.billed += 1
        st.bills.append((time.time(), cost))
        st.cached_tokens += cached
        st.cache_discount_usd += discount
        self.generations[gen_id] = {
            "id": gen_id,
            "model": self.config.model + "-0127",
            "provider_name": route["provider_name"],
            "total_cost": cost,
            "cache_discount": discount if cached else None,
            "tokens_prompt": usage["prompt_tokens"],
            "tokens_completion": usage["completion_tokens"],
            "native_tokens_prompt": usage["prompt_tokens"],
            "native_tokens_completion": usage["completion_tokens"],
            "native_tokens_cached": cached,
            "native_tokens_reasoning": usage["completion_tokens_details"]["reasoning_tokens"],
            "finish_reason": finish,
            "cancelled": False,
            "is_byok": False,
        }

    def _choice(
        self, route: dict, messages: list[dict], usage: dict, finish: str, fault: str | None
    ) -> dict:
        """The answer: a digest of the last user turn (tests match answers to prompts by it),
        or the empty / errored choice a fault asks for."""
        reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        digest = hashlib.sha1(str(last_user).encode()).hexdigest()[:10]
        answer_tokens = usage["completion_tokens"] - reasoning_tokens
        message = {
            "role": "assistant",
            "content": f"Answer {digest} in {answer_tokens} tokens.",
            "reasoning": f"Thinking about {digest} for {reasoning_tokens} tokens.",
        }
        choice = {"index": 0, "finish_reason": finish, "native_finish_reason": finish}
        if fault == "empty":
            message = {"role": "assistant", "content": ""}
        elif fault == "finish_error":
            choice["finish_reason"] = "error"
            choice["error"] = {"code": 502, "message": "upstream stream error"}
        else:
            self.stats.providers[route["tag"]] += 1
            self.stats.ok_contents[digest] += 1
        choice["message"] = message
        return choice

    def _draw_fault(self) -> str | None:
        faults = self.config.faults
        if not faults:
            return None
        r = self.rng.random()
        for kind, rate in faults.items():
            if r < rate:
                return kind
            r -= rate
        return None

    def _rate_limited(self) -> web.Response:
        wait = self.config.retry_after
        reset_ms = int((time.time() + wait) * 1000)
        headers = {
            "Retry-After": f"{wait:g}",
            "X-RateLimit-Limit": "100",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": str(reset_ms),
        }
        return _error(429, "Rate limit exceeded", headers=headers, metadata={"headers": headers})


class FakeServerThread:
    """Runs a :class:`FakeOpenRouter` on its own event loop in a daemon thread."""

    def __init__(self, config: FakeConfig | None = None):
        self.server = FakeOpenRouter(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def stats(self) -> Stats:
        return self.server.stats

    @property
    def config(self) -> FakeConfig:
        return self.server.config

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    def __enter__(self) -> FakeServerThread:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _parse_faults(text: str) -> dict:
    faults = {}
    for item in filter(None, text.split(",")):
        kind, _, rate = item.partition("=")
        if kind not in FAULTS:
            raise SystemExit(f"error: unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
        faults[kind] = float(rate)
    return faults


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m datagen.openrouter.fake_server", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds per chat request")
    ap.add_argument("--faults", default="", help=f"kind=rate,... kinds: {', '.join(FAULTS)}")
    ap.add_argument("--credits", type=float, default=math.inf, help="USD before 402s")
    ap.add_argument("--max-inflight", type=int, default=None, help="429 above this concurrency")
    ap.add_argument("--completion-tokens", default="20,200", help="min,max drawn per response")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.completion_tokens.split(","))
    config = FakeConfig(
        credits=args.credits,
        latency=args.latency,
        faults=_parse_faults(args.faults),
        max_inflight=args.max_inflight,
        completion_tokens=(lo, hi),
        api_key=args.api_key,
        seed=args.seed,
    )

    async def serve() -> None:
        server = FakeOpenRouter(config)
        url = await server.start(args.port)
        print(f"fake OpenRouter listening on {url}", flush=True)
        done = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, done.set)
        try:
            await done.wait()
        finally:
            await server.stop()
            s = server.stats
            print(
                f"chat requests {s.chat}, billed {s.billed}, charged ${s.charged_usd:.4f}, "
                f"violations {s.violations}, faults {dict(s.faults)}",
                flush=True,
            )

    asyncio.run(serve())


if __name__ == "__main__":
    main()
