"""OpenRouter's API besides chat: the model's endpoint listing, the key's usage and credits, and
what a generation cost. One aiohttp session serves a run's calls (the chat requests are the
requester's, on a session sized for them)::

    async with OpenRouter(base_url, api_key) as api:
        endpoints = await api.endpoints("moonshotai/kimi-k2.5")
        acct = await api.account()

Whose fault: a listing OpenRouter cannot give (unreachable, an HTTP error, a body that is not a
listing) is a :class:`~eagle3.errors.RemoteError` (exit 69), a rejected key or an unknown model
a :class:`~eagle3.errors.ConfigError` (exit 2). The account and generation lookups are
best-effort: what they cannot read is None or missing, and settlement waits for a later run.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from datagen.openrouter import providers
from eagle3.errors import ConfigError, RemoteError

log = logging.getLogger(__name__)

PUBLIC_BASE_URL = "https://openrouter.ai/api/v1"
LISTING_TIMEOUT = aiohttp.ClientTimeout(total=60)  # per request
ACCOUNT_TIMEOUT = aiohttp.ClientTimeout(total=30)
GENERATION_TIMEOUT = aiohttp.ClientTimeout(total=60)
GENERATION_LOOKUPS = 16  # GET /generation requests in flight at once


def auth(api_key: str) -> dict:
    """The key on every request (the spec declares it for every operation); none when empty
    (``--plan`` without a key reads the public endpoint listing)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def describe(err: BaseException) -> str:
    """An aiohttp error's message on one line (a timeout has none: its type then)."""
    return " ".join(str(err).split()) or type(err).__name__


class OpenRouter:
    """The non-chat calls of one run, on one session (``async with``)."""

    def __init__(self, base_url: str, api_key: str = ""):
        self.base_url = base_url
        self.base = base_url.rstrip("/")
        self.api_key = api_key
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenRouter:
        self.session = aiohttp.ClientSession(headers=auth(self.api_key))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def fetch_json(self, url: str, timeout: aiohttp.ClientTimeout) -> tuple[int, dict]:
        async with self.session.get(url, timeout=timeout) as resp:
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = {}
            return resp.status, body if isinstance(body, dict) else {}

    async def endpoints(self, model: str) -> list[providers.Endpoint]:
        """``GET /models/{model}/endpoints``: who serves ``model``, at which precision and price."""
        url = f"{self.base}/models/{model}/endpoints"
        try:
            status, body = await self.fetch_json(url, LISTING_TIMEOUT)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise RemoteError(
                f"cannot reach OpenRouter at {self.base_url} ({describe(err)}): check the "
                "network and --base-url, then re-run the same command"
            ) from err
        if status == 401 and not self.api_key:
            raise ConfigError(
                f"{self.base_url} wants an API key for the endpoint listing (401): "
                "export OPENROUTER_API_KEY"
            )
        if status == 401:
            raise ConfigError("OpenRouter rejected the API key (401): check OPENROUTER_API_KEY")
        if status == 404:
            raise ConfigError(f"model {model!r} not found on {self.base_url}: check --model")
        if status != 200:
            raise RemoteError(
                f"GET {url} answered HTTP {status}: OpenRouter failed; re-run the same command "
                "later"
            )
        try:
            return providers.parse_endpoints(body)
        except ValueError as err:
            raise RemoteError(
                f"GET {url} gave no endpoint listing ({describe(err)}): check --base-url, or "
                "re-run the same command later"
            ) from err

    async def account(self) -> dict:
        """``/key`` and ``/credits`` facts: status of the key, USD left on it, the key's
        all-time usage in USD (None = unknown)."""
        out: dict = {"key_status": None, "left": None, "usage": None}
        try:
            status, key = await self.fetch_json(self.base + "/key", ACCOUNT_TIMEOUT)
            out["key_status"] = status
            data = key.get("data") or {}
            if status == 200 and data.get("limit_remaining") is not None:
                out["left"] = float(data["limit_remaining"])
            if status == 200 and data.get("usage") is not None:
                out["usage"] = float(data["usage"])
            status, credits = await self.fetch_json(self.base + "/credits", ACCOUNT_TIMEOUT)
            data = credits.get("data") or {}
            if status == 200 and data.get("total_credits") is not None:
                left = float(data["total_credits"]) - float(data.get("total_usage") or 0.0)
                out["left"] = left if out["left"] is None else min(out["left"], left)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            log.debug("account lookup failed: %s", err)
        return out

    async def key_usage(self) -> float | None:
        """``GET /key`` ``data.usage``: the key's all-time usage in USD (None = unknown)."""
        try:
            status, key = await self.fetch_json(self.base + "/key", ACCOUNT_TIMEOUT)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            log.debug("key usage lookup failed: %s", err)
            return None
        usage = (key.get("data") or {}).get("usage") if status == 200 else None
        try:
            return None if usage is None else float(usage)
        except (TypeError, ValueError):
            return None

    async def generation_costs(self, ids: list[str]) -> dict[str, float]:
        """generation id -> ``GET /generation?id=`` ``data.total_cost``, for those it answers."""
        url = self.base + "/generation"
        gate = asyncio.Semaphore(GENERATION_LOOKUPS)
        out: dict[str, float] = {}

        async def one(gen_id: str) -> None:
            async with gate:
                try:
                    async with self.session.get(
                        url, params={"id": gen_id}, timeout=GENERATION_TIMEOUT
                    ) as resp:
                        body = await resp.json(content_type=None) if resp.status == 200 else {}
                except (aiohttp.ClientError, TimeoutError, ValueError) as err:
                    log.debug("GET /generation?id=%s failed: %s", gen_id, err)
                    return
            cost = (body.get("data") or {}).get("total_cost") if isinstance(body, dict) else None
            if cost is not None:
                out[gen_id] = float(cost)

        await asyncio.gather(*(one(i) for i in ids))
        return out
