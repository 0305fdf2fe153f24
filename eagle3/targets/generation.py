"""What generating with a target needs: its KV cache across transformers versions (the
argument's name, the returned cache, a new one, entries kept after verification) and EOS ids."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from eagle3.data.chat import end_of_turn_ids


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x called it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any):
    """The KV cache a forward returned: `out.cache` in transformers 5 (whose deprecated
    `out.past_key_values` logs a warning on every run), `out.past_key_values` in 4.x."""
    fields = getattr(out, "__dataclass_fields__", {})
    return out.cache if "cache" in fields else out.past_key_values


def new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def keep_cache_entries(cache, length: int, extra: list[int]) -> None:
    """Cut every layer of a HF cache to entries [0, length) + `extra` (indices), in place."""
    contiguous = extra == list(range(length, length + len(extra)))
    idx = None
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if contiguous:
            n = length + len(extra)
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            continue
        if idx is None or idx.device != layer.keys.device:
            idx = torch.tensor(extra, device=layer.keys.device)
        layer.keys = torch.cat(
            [layer.keys[..., :length, :], layer.keys.index_select(-2, idx)], dim=-2
        )
        layer.values = torch.cat(
            [layer.values[..., :length, :], layer.values.index_select(-2, idx)], dim=-2
        )


def eos_token_ids(target) -> set[int]:
    """Token ids that end a generation: the tokenizer's end-of-turn ids plus the model's
    generation_config EOS (either may be missing)."""
    tok = getattr(target, "tokenizer", None)
    ids = end_of_turn_ids(tok) if tok is not None else set()
    model = getattr(target, "model", None)  # a TargetFiles has its generation_config itself
    gen = getattr(model, "generation_config", None) or getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids
