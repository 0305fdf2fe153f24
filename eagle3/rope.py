"""Rotary position embeddings of the draft layer, as the target and the engines compute them.

The drafter takes the target's RoPE (theta and scaling) so that its positions mean what the
target's mean at long context. Two layouts:
- Llama's (GQA draft): "half-split", dim i rotates with dim i + d/2 (rotary_cos_sin,
  apply_rotary), as vLLM's and SGLang's Llama EAGLE-3 heads apply it.
- DeepSeek-V3's (MLA draft): "interleaved", dims (2i, 2i+1) rotate together (vLLM's
  `is_neox_style=False`), on the qk_rope_head_dim part only, with DeepSeek's YaRN: the same
  frequencies, a cos/sin magnitude of mscale(f, mscale) / mscale(f, mscale_all_dim) and a
  softmax scale multiplied by mscale(f, mscale_all_dim)^2 (mla_rotary, mla_softmax_scale).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3.errors import Eagle3Error

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # scalings the drafter's rotary implements


def target_rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a target's HF config: transformers 5's `rope_parameters`
    or the older `rope_theta` + `rope_scaling` keys; 10000 and None when it says nothing."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta")
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = (
            getattr(hf_config, "rope_theta", None),
            getattr(hf_config, "rope_scaling", None),
        )
    return float(theta or 10000.0), rope_scaling_for_engines(scaling)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_for_engines(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """A target's rope scaling -> the form the drafter, vLLM and SGLang compute identically.

    None/"default" -> None. "linear" -> {rope_type, factor}. "llama3" (Llama-3.1) -> {rope_type,
    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}. "yarn" ->
    {rope_type, factor, original_max_position_embeddings, beta_fast, beta_slow,
    attention_factor, attn_factor}: the
    cos/sin magnitude factor is resolved once (explicit attention_factor, else DeepSeek's
    mscale / mscale_all_dim ratio, else 0.1 ln(factor) + 1, as transformers and vLLM do) and
    written twice, because vLLM (and transformers) take `attention_factor` as the factor while
    SGLang ignores it and mscale, and multiplies 0.1 ln(factor) + 1 by `attn_factor`.
    Idempotent; other types (dynamic, longrope, ...) raise Eagle3Error.
    """
    if not scaling:
        return None
    s = dict(scaling)
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise Eagle3Error(
            f"rope scaling type {kind!r} is not implemented by the drafter (it has "
            f"{', '.join(ROPE_TYPES)}); set model.draft.rope.scaling to one of them, e.g. "
            "{rope_type: default}"
        )
    factor = s.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise Eagle3Error(f"rope scaling {kind!r} needs a positive 'factor', got {factor!r}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    original = s.get("original_max_position_embeddings")
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": float(factor),
            "low_freq_factor": float(s.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(s.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(original or 8192),
        }
    if not isinstance(original, int) or original <= 0:
        raise Eagle3Error(
            f"yarn rope scaling needs original_max_position_embeddings (an int), got {original!r}"
        )
    attention = s.get("attention_factor")
    if attention is None and s.get("mscale") and s.get("mscale_all_dim"):
        attention = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
    if attention is None:
        attention = _yarn_mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(s.get("beta_fast", 32)),
        "beta_slow": float(s.get("beta_slow", 1)),
        "attention_factor": float(attention),
        "attn_factor": float(attention) / _yarn_mscale(factor),  # SGLang's: see above
        # DeepSeek's own terms, kept for the MLA draft, which vLLM computes from them
        **{k: float(s[k]) for k in ("mscale", "mscale_all_dim") if k in s},
    }


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies (head_dim/2,), cos/sin magnitude factor) for the scaling
    rope_scaling_for_engines returns; YaRN as in transformers' and vLLM's rotary (truncated
    correction range, linear ramp between interpolated and extrapolated frequencies)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if scaling["rope_type"] == "llama3":  # long wavelengths / factor, short kept, smooth between
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0

    def correction_dim(rotations: float) -> float:  # the dim doing `rotations` turns in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: high-frequency dims keep their frequency
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, scaling["attention_factor"]


def rotary_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions (B, S) -> each (B, 1, S, head_dim), Llama's half-split layout."""
    inv_freq, magnitude = rope_inv_freq(head_dim, theta, scaling)
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)  # (B, S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, S, hd)
    cos, sin = emb.cos() * magnitude, emb.sin() * magnitude
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# -- DeepSeek-V3's rotary, for the MLA draft (vLLM's DeepseekV2MLAAttention) -----------------
def mla_mscales(scaling: dict[str, Any] | None) -> tuple[float, float]:
    """-> (cos/sin magnitude, softmax-scale factor) of DeepSeek's YaRN, as vLLM's
    DeepseekScalingRotaryEmbedding and DeepseekV2MLAAttention apply them: mscale(f, mscale) /
    mscale(f, mscale_all_dim) on cos/sin and mscale(f, mscale_all_dim)^2 on the softmax scale,
    with vLLM's defaults mscale = 1, mscale_all_dim = 0. (1, 1) without scaling."""
    if scaling is None:
        return 1.0, 1.0
    factor = scaling["factor"]
    mscale, all_dim = scaling.get("mscale", 1.0), scaling.get("mscale_all_dim", 0.0)
    return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim), _yarn_mscale(
        factor, all_dim
    ) ** 2


def check_mla_rope(scaling: dict[str, Any] | None) -> None:
    """A normalised scaling the MLA draft can take, else a one-line Eagle3Error: none or YaRN
    (vLLM turns any other type into DeepSeek's YaRN for an MLA layer), and without DeepSeek's
    mscale terms no attention_factor other than their default ratio (vLLM's MLA rotary
    ignores attention_factor)."""
    if scaling is None:
        return
    if scaling["rope_type"] != "yarn":
        raise Eagle3Error(
            f"an MLA draft takes no rope scaling or YaRN, not {scaling['rope_type']!r} (vLLM "
            "computes every scaled MLA rotary as DeepSeek's YaRN); set model.draft.rope.scaling"
        )
    magnitude = mla_mscales(scaling)[0]
    deepseek_terms = "mscale" in scaling or "mscale_all_dim" in scaling  # then they decide
    if not deepseek_terms and abs(scaling["attention_factor"] - magnitude) > 1e-6:
        raise Eagle3Error(
            f"rope scaling attention_factor {scaling['attention_factor']} differs from DeepSeek's "
            f"mscale ratio {magnitude} that an MLA draft applies; set mscale / mscale_all_dim "
            "instead of attention_factor"
        )


def deepseek_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The MLA export's rope_scaling: DeepSeek's YaRN keys, without attention_factor (vLLM reads
    attention_factor == 1.0 as "deepseek_llama_scaling", which drops the softmax mscale)."""
    if scaling is None:
        return None
    keys = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    return {
        **{k: scaling[k] for k in keys},
        "mscale": scaling.get("mscale", 1.0),
        "mscale_all_dim": scaling.get("mscale_all_dim", 0.0),
    }


def mla_rotary(
    position_ids: torch.Tensor,
    rope_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions (B, S) -> each (B, 1, S, rope_dim/2), DeepSeek's magnitude in."""
    inv_freq, _ = rope_inv_freq(rope_dim, theta, scaling)  # YaRN's frequencies are DeepSeek's
    magnitude = mla_mscales(scaling)[0]
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)  # (B, S, d/2)
    cos, sin = freqs.cos() * magnitude, freqs.sin() * magnitude
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_2i, x_2i+1) by frequency i: vLLM's is_neox_style=False (rotate_gptj)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
