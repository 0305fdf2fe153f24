"""The fake OpenRouter's provider table: the Kimi-K2.5 endpoints as OpenRouter lists them
(``/api/v1/models/{author}/{slug}/endpoints``), with their quantizations and prices, and the
providers no request may reach. :mod:`datagen.openrouter.fake_server` serves and routes by it."""

from __future__ import annotations

PER_M = 1_000_000


def endpoint(provider, tag, quant, prompt, completion, cache=None, status=0, uptime=99.0):
    """One listing entry; prices in USD per million tokens (stored as per-token strings).
    ``cache``: the cache-read price (default a quarter of ``prompt``; False = none listed)."""
    entry = {
        "name": f"{provider} | moonshotai/kimi-k2.5",
        "provider_name": provider,
        "tag": tag,
        "quantization": quant,
        "context_length": 262144,
        "max_completion_tokens": 65535,
        "pricing": {
            "prompt": f"{prompt / PER_M:.10f}",
            "completion": f"{completion / PER_M:.10f}",
            "request": "0",
            "input_cache_read": f"{(cache if cache is not None else prompt / 4) / PER_M:.10f}",
            "discount": 0,
        },
        "status": status,
        "uptime_last_30m": uptime,
        "supported_parameters": ["reasoning", "max_tokens", "temperature"],
    }
    if cache is False:
        del entry["pricing"]["input_cache_read"]
    return entry


# The Kimi-K2.5 providers as seen Feb-Aug 2026. Fireworks and BaseTen are made the cheapest on
# purpose: a client that fails to exclude them gets routed there, and the rule check catches it.
KIMI_ENDPOINTS = [
    endpoint("Chutes", "chutes", "int4", 0.45, 2.20, 0.225, uptime=97.2),
    endpoint("DeepInfra", "deepinfra", "unknown", 0.50, 2.50, 0.10, uptime=99.0),
    endpoint("SiliconFlow", "siliconflow", "int4", 0.55, 2.50, uptime=95.6),
    endpoint("AtlasCloud", "atlas-cloud", "int4", 0.50, 2.60, uptime=98.0),
    endpoint("Together", "together", None, 0.60, 2.80, uptime=99.5),
    endpoint("Novita", "novita", "unknown", 0.60, 3.00, uptime=100.0),
    endpoint("Parasail", "parasail", "int4", 0.55, 2.90, uptime=99.1),
    endpoint("Moonshot AI", "moonshotai", "int4", 0.60, 3.00, 0.15, uptime=99.9),
    endpoint("Venice", "venice", "unknown", 0.60, 3.00, uptime=96.0),
    endpoint("Fireworks", "fireworks", "nvfp4", 0.40, 2.00, 0.15, uptime=99.5),
    endpoint("BaseTen", "baseten", "fp4", 0.38, 1.90, status=-5, uptime=0.0),
]
FORBIDDEN = ("fireworks", "baseten")
