"""Which OpenRouter endpoints may serve the model, the request's ``provider`` rule, and what a
budget buys at the allowed prices (``--plan``).

The user's rule: never a provider that quantizes below the model's native precision. Kimi-K2.5's
only public weights are INT4 (QAT), so fp4/nvfp4/mxfp4 (Fireworks, BaseTen) and fp6 are out;
int8/fp8/bf16 can hold the INT4 weights exactly and stay in. ``unknown`` (or a missing field) is
taken as native, since nobody can serve weights that do not exist, and that assumption is
printed. Endpoints that are down (``status < 0``), that cannot produce ``max_tokens`` or whose
provider is in the config's ``ignore`` list are excluded as well.

The rule sent with every request (``provider_block``) makes OpenRouter enforce the same choice:
``ignore`` (config list + every below-native endpoint), ``quantizations`` (allowed values only),
``max_price`` (the dearest allowed endpoint's prices, per million tokens, so the router can never
pick something pricier than the budget math assumed), ``sort: price`` and
``require_parameters: true``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

# Precision ladder: an endpoint is allowed when its rung is >= the native one. Same rung =
# same family of precision; formats that can hold INT4 values exactly sit above it.
QUANT_RANK = {
    "int2": 0,
    "int3": 0,
    "fp4": 1,
    "nvfp4": 1,
    "mxfp4": 1,
    "fp6": 2,
    "int4": 3,
    "int8": 4,
    "fp8": 4,
    "mxfp8": 4,
    "fp16": 5,
    "bf16": 5,
    "fp32": 6,
}
UNKNOWN = "unknown"
# Values OpenRouter's provider.quantizations accepts (the OpenAPI Quantization enum).
REQUEST_QUANTIZATIONS = (
    "int4",
    "int8",
    "fp4",
    "mxfp4",
    "nvfp4",
    "fp6",
    "fp8",
    "mxfp8",
    "fp16",
    "bf16",
    "fp32",
    "unknown",
)
PER_M = 1_000_000
BYTES_PER_TOKEN = 4.0  # expected tokens = bytes / 4 for projections (reservations use bytes)
TOKENS_PER_MESSAGE = 8  # chat-template overhead per message, for projections


@dataclass
class Endpoint:
    name: str
    provider: str  # display name, "DeepInfra"
    tag: str  # provider slug, possibly with an endpoint suffix: "deepinfra/turbo"
    quantization: str  # lower case; "unknown" when missing
    prompt_price: float  # USD per token
    completion_price: float
    cache_read_price: float | None
    request_price: float
    status: int
    uptime: float | None
    max_completion_tokens: int | None
    excluded: list[str] = field(default_factory=list)  # reasons; empty = included
    assumed_native: bool = False  # quantization unknown, taken as native

    @property
    def included(self) -> bool:
        return not self.excluded


def _price(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def parse_endpoints(payload: dict) -> list[Endpoint]:
    """Endpoints of a ``GET /models/{author}/{slug}/endpoints`` response."""
    data = payload.get("data") if isinstance(payload, dict) else None
    raw = data.get("endpoints") if isinstance(data, dict) else None
    if not isinstance(raw, list):
        raise ValueError("the endpoints response has no data.endpoints list")
    out = []
    for e in raw:
        pricing = e.get("pricing") or {}
        tag = str(e.get("tag") or e.get("provider_name") or "").lower()
        cache = pricing.get("input_cache_read")
        out.append(
            Endpoint(
                name=str(e.get("name", tag)),
                provider=str(e.get("provider_name", tag)),
                tag=tag,
                quantization=str(e.get("quantization") or UNKNOWN).lower(),
                prompt_price=_price(pricing.get("prompt")),
                completion_price=_price(pricing.get("completion")),
                cache_read_price=None if cache is None else _price(cache),
                request_price=_price(pricing.get("request")),
                status=int(e.get("status") or 0),
                uptime=e.get("uptime_last_30m"),
                max_completion_tokens=e.get("max_completion_tokens"),
            )
        )
    return out


def slug_matches(tag: str, slugs: Iterable[str]) -> bool:
    """``deepinfra/turbo`` is matched by ``deepinfra`` and by itself."""
    base = tag.split("/")[0]
    return any(s.lower() in (tag, base) for s in slugs)


def quantization_allowed(quantization: str, native: str) -> bool:
    if quantization == UNKNOWN:
        return True
    rank = QUANT_RANK.get(quantization)
    return rank is not None and rank >= QUANT_RANK[native]


def select(
    endpoints: Sequence[Endpoint], native: str, ignore: Iterable[str], max_tokens: int
) -> list[Endpoint]:
    """Mark every endpoint included or excluded (with reasons); return the included ones."""
    ignore = [s.lower() for s in ignore]
    for e in endpoints:
        e.excluded = []
        if slug_matches(e.tag, ignore):
            e.excluded.append("in ignore list")
        if e.quantization not in QUANT_RANK and e.quantization != UNKNOWN:
            e.excluded.append(f"unrecognised quantization {e.quantization}")
        elif not quantization_allowed(e.quantization, native):
            e.excluded.append(f"{e.quantization} is below native {native}")
        if e.status < 0:
            e.excluded.append(f"down (status {e.status})")
        if e.max_completion_tokens and e.max_completion_tokens < max_tokens:
            e.excluded.append(f"max output {e.max_completion_tokens} < max_tokens {max_tokens}")
        e.assumed_native = e.quantization == UNKNOWN
    return [e for e in endpoints if e.included]


@dataclass(frozen=True)
class Prices:
    """USD per token: the dearest allowed (reservations, max_price) or the cheapest (projection)."""

    prompt: float
    completion: float
    request: float = 0.0
    cache_read: float | None = None  # a cached prompt token (projection with caching)


def dearest(allowed: Sequence[Endpoint]) -> Prices:
    return Prices(
        max(e.prompt_price for e in allowed),
        max(e.completion_price for e in allowed),
        max(e.request_price for e in allowed),
    )


def cheapest(allowed: Sequence[Endpoint]) -> Prices:
    """What ``sort: price`` routes to when it is up: the lowest completion price."""
    e = min(allowed, key=lambda e: (e.completion_price, e.prompt_price))
    return Prices(e.prompt_price, e.completion_price, e.request_price)


def with_cache(prices: Prices, allowed: Sequence[Endpoint]) -> tuple[Prices, Endpoint | None]:
    """``prices`` with a cache-read price: that of the cheapest allowed endpoint listing one
    (lowest completion price, as ``sort: price`` would route), never above the prompt price.
    The endpoint is None (and the prices unchanged) when no allowed endpoint lists one."""
    cached = [e for e in allowed if e.cache_read_price is not None]
    if not cached:
        return prices, None
    e = min(cached, key=lambda e: (e.completion_price, e.prompt_price))
    return replace(prices, cache_read=min(e.cache_read_price, prices.prompt)), e


def cache_savings(allowed: Sequence[Endpoint]) -> dict[str, float]:
    """Display name (lower case) -> USD a cached prompt token saves on its endpoint (the most
    conservative of its endpoints), for responses whose usage reports no cache_discount."""
    out: dict[str, float] = {}
    for e in allowed:
        if e.cache_read_price is not None:
            saving = max(0.0, e.prompt_price - e.cache_read_price)
            name = e.provider.lower()
            out[name] = min(saving, out.get(name, saving))
    return out


def provider_block(endpoints: Sequence[Endpoint], native: str, ignore: Iterable[str]) -> dict:
    """The ``provider`` object sent with every chat request."""
    allowed = [e for e in endpoints if e.included]
    below = [e.tag for e in endpoints if not quantization_allowed(e.quantization, native)]
    ignored = sorted({s.lower() for s in ignore} | set(below))
    top = dearest(allowed)
    max_price = {
        "prompt": round(top.prompt * PER_M, 6),
        "completion": round(top.completion * PER_M, 6),
    }
    if top.request > 0:
        max_price["request"] = top.request
    return {
        "ignore": ignored,
        "quantizations": [q for q in REQUEST_QUANTIZATIONS if quantization_allowed(q, native)],
        "max_price": max_price,
        "sort": "price",
        "require_parameters": True,
        "allow_fallbacks": True,
    }


def _per_m(price: float | None) -> str:
    return "-" if price is None else f"{price * PER_M:.3f}"


def format_table(endpoints: Sequence[Endpoint], native: str) -> str:
    rows = [("name", "tag", "quant", "$/M in", "$/M out", "$/M cached", "uptime", "status", "")]
    for e in sorted(endpoints, key=lambda e: (not e.included, e.completion_price, e.tag)):
        if e.excluded:
            decision = "excluded: " + "; ".join(e.excluded)
        else:
            decision = "INCLUDED" + (
                f" (unknown quantization taken as native {native})" if e.assumed_native else ""
            )
        rows.append(
            (
                e.provider,
                e.tag,
                e.quantization,
                _per_m(e.prompt_price),
                _per_m(e.completion_price),
                _per_m(e.cache_read_price),
                "-" if e.uptime is None else f"{float(e.uptime):.1f}%",
                str(e.status),
                decision,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if 3 <= i <= 7 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------------------- projection


def expected_tokens(text: str) -> float:
    return len(text.encode("utf-8")) / BYTES_PER_TOKEN


def conversation_tokens(messages: Sequence[dict], answer_tokens: float) -> tuple[float, float]:
    """Expected (input, output) tokens to generate every user turn of one prompt, each turn's
    input holding the conversation so far including the earlier generated answers."""
    inp = out = 0.0
    context = 0.0
    for m in messages:
        context += expected_tokens(m["content"]) + TOKENS_PER_MESSAGE
        if m["role"] == "user":
            inp += context
            out += answer_tokens
            context += answer_tokens + TOKENS_PER_MESSAGE
    return inp, out


def cacheable_tokens(messages: Sequence[dict], answer_tokens: float) -> float:
    """Expected input tokens of one prompt that a prompt cache can serve: every user turn after
    the first resends the conversation before it (earlier turns and the generated answers)."""
    cached = context = 0.0
    answered = False
    for m in messages:
        if m["role"] == "user" and answered:
            cached += context
        context += expected_tokens(m["content"]) + TOKENS_PER_MESSAGE
        if m["role"] == "user":
            context += answer_tokens + TOKENS_PER_MESSAGE
            answered = True
    return cached


@dataclass
class DatasetDemand:
    name: str
    prompts: int  # prompts not done yet
    input_per_prompt: float  # expected tokens, averaged
    output_per_prompt: float
    token_budget_left: int  # output tokens this dataset may still spend
    cached_per_prompt: float = 0.0  # of input_per_prompt, what a prompt cache can serve


@dataclass
class DatasetProjection:
    name: str
    prompts: int
    wanted_prompts: int  # what the token budget (and the prompt count) asks for
    wanted_tokens: float
    wanted_usd: float
    bought_prompts: float  # what the dollar budget buys of it
    bought_tokens: float
    token_budget_left: int


def project(
    demands: Sequence[DatasetDemand], budget_left: float, prices: Prices
) -> list[DatasetProjection]:
    """What ``budget_left`` buys of each dataset at ``prices`` (with their ``cache_read``
    price, each dataset's cacheable input is billed at it).

    Each dataset wants ``min(prompts, token_budget_left // output_per_prompt)`` prompts. When
    their total cost exceeds the budget, every dataset gets the same fraction of what it wants
    (the run interleaves datasets, so they are drained at about the same pace).
    """
    rows = []
    for d in demands:
        by_tokens = (
            math.floor(d.token_budget_left / d.output_per_prompt)
            if d.output_per_prompt > 0
            else d.prompts
        )
        wanted = max(0, min(d.prompts, by_tokens))
        per_prompt = (
            d.input_per_prompt * prices.prompt
            + d.output_per_prompt * prices.completion
            + prices.request
        )
        if prices.cache_read is not None:  # the resent prefix at the cache-read price
            per_prompt -= d.cached_per_prompt * (prices.prompt - prices.cache_read)
        rows.append(
            DatasetProjection(
                d.name,
                d.prompts,
                wanted,
                wanted * d.output_per_prompt,
                wanted * per_prompt,
                0.0,
                0.0,
                d.token_budget_left,
            )
        )
    total = sum(r.wanted_usd for r in rows)
    fraction = 1.0 if total <= budget_left else max(0.0, budget_left) / total
    for r in rows:
        r.bought_prompts = r.wanted_prompts * fraction
        r.bought_tokens = r.wanted_tokens * fraction
    return rows


def tokens_for_budget(budget: float, input_per_output: float, prices: Prices) -> float:
    """Output tokens ``budget`` buys when each output token drags ``input_per_output`` inputs."""
    per_token = prices.completion + input_per_output * prices.prompt
    return budget / per_token if per_token > 0 else math.inf
