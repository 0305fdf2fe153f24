"""The EAGLE-3 draft model: one Llama-style decoder layer over fused target features.

Definition (the EAGLE-3 paper; parameter names as in SGLang's LlamaForCausalLMEagle3):

    h_0   = fc(concat(aux_low, aux_mid, aux_high))                   3*H_target -> H
    x     = concat(input_layernorm(embed(token)), hidden_norm(h))     2H, into q/k/v
    h'    = h + o_proj(attn(x))
    out   = h' + mlp(post_attention_layernorm(h'))                    passed to the next step
    logits = lm_head(norm(out))                                       over the draft vocab

Two ways to run it:
- `forward`: incremental decoding with a KV cache and an optional explicit attention mask
  (speculative decoding, chain or tree drafting).
- `ttt_forward`: the training-time test unroll. Step k at position t reads token x_{t+k+1}
  and the hidden state the draft itself produced at step k-1 (step 0: fc over the target's
  aux states). Its query attends to step-0 keys at positions <= t and to the keys of steps
  1..k at position t only, which is exactly what the draft sees at inference after k steps.
  Its attention kernels (linear-memory "chunked" on CPU, "flex" on CUDA, and the dense
  references) live in eagle3/ttt_attention.py. `TTTModel` is that unroll as `forward()`, the
  module training wraps (DDP, DeepSpeed).

Parameter names match SGLang's `LlamaForCausalLMEagle3` so checkpoints load there unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.errors import Eagle3Error
from eagle3.ttt_attention import ttt_attention

FEATURES = ("aux", "last")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # scalings the drafter's rotary implements
# Kimi-class (MLA) targets have no Llama head shape to copy: 64 heads of 112 (hidden / heads)
# or of 64 (qk_rope_head_dim), neither of which every attention backend serves. Their draft
# layer defaults to SpecForge's DeepSeek-V3 EAGLE-3 shape instead: heads of 128, 8 KV heads.
MLA_HEAD_DIM = 128
MLA_KV_HEADS = 8


@dataclass
class DraftConfig:
    hidden_size: int  # H; equals the target hidden size (the embeddings are the target's)
    intermediate_size: int  # SwiGLU width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # fc input is 3 * target_hidden_size (feature "aux")
    aux_layer_ids: list[int] = field(
        default_factory=list
    )  # SGLang eagle_aux_hidden_state_layer_ids
    # "aux": EAGLE-3, fc fuses the 3 aux layers. "last": the EAGLE-1/2 feature, the target's
    # final post-norm hidden state alone (fc is H -> H); kept for the ablation, SGLang and vLLM
    # load only "aux" drafters.
    feature: str = "aux"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE), or {"rope_type": "linear", "factor"} or {"rope_type": "yarn", ...}: see
    # rope_scaling_for_engines; from_target_config copies the target's (theta too)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_for_engines(self.rope_scaling)
        if self.hidden_act != "silu":
            raise Eagle3Error(f"hidden_act {self.hidden_act!r} is not supported; use 'silu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3Error(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3Error(
                f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocab "
                f"{self.vocab_size}; choose draft_vocab_size <= {self.vocab_size}"
            )
        if self.feature not in FEATURES:
            raise Eagle3Error(f"feature {self.feature!r} is not one of {FEATURES}")
        if len(self.aux_layer_ids) != 3:
            raise Eagle3Error(f"EAGLE-3 fuses exactly 3 aux layers, got {self.aux_layer_ids}")

    @property
    def feature_size(self) -> int:
        """Width of the target features the fc layer takes."""
        return (3 if self.feature == "aux" else 1) * self.target_hidden_size

    @classmethod
    def from_target_config(
        cls, hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any
    ) -> DraftConfig:
        """Size the draft layer like one decoder layer of the target (the usual choice), with
        the target's RoPE (theta and scaling); `overrides` replace any field (None = derive).

        MLA targets (DeepSeek-V3, Kimi-K2.5) get heads of MLA_HEAD_DIM with MLA_KV_HEADS KV
        heads where the hidden size divides (Kimi: 56 x 128, 8 KV heads), else hidden / heads.
        """
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        hidden = hf_config.hidden_size
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        if getattr(hf_config, "kv_lora_rank", None):  # MLA: its head_dim is not a Llama one
            head_dim = hidden // heads
            if hidden % MLA_HEAD_DIM == 0 and (hidden // MLA_HEAD_DIM) % MLA_KV_HEADS == 0:
                head_dim, heads, kv_heads = MLA_HEAD_DIM, hidden // MLA_HEAD_DIM, MLA_KV_HEADS
            else:
                kv_heads = heads
        theta, scaling = target_rope(hf_config)
        # MoE configs (DeepSeek-V3) carry the dense-layer width in intermediate_size too.
        values = dict(
            hidden_size=hidden,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        in_dim = 2 * cfg.hidden_size  # concat(embed, hidden)
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.ttt_impl = "auto"  # "auto" | "chunked" | "flex" | "sdpa" | "split": see attend_ttt

    def qkv(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, 2H) -> q (B, nh, S, hd), k and v (B, nkv, S, hd), rotary applied."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(
            position_ids, self.head_dim, self.cfg.rope_theta, q.dtype, self.cfg.rope_scaling
        )
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend_ttt(
        self,
        q: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """TTT step k = len(keys) - 1: q (B, nh, T, hd) over step-0 keys causally (within a
        segment) and the keys of steps 1..k on the diagonal -> (B, T, H). self.ttt_impl picks
        the kernel (eagle3/ttt_attention.py says what each is for)."""
        B, nh, T, hd = q.shape
        out = ttt_attention(
            q, keys, values, scale=hd**-0.5, impl=self.ttt_impl, segment_ids=segment_ids
        )  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nh * hd))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, nh, S, hd) over k/v (B, nkv, P, hd) with bool mask (B|1, S, P) -> (B, S, H)."""
        B, _, S, _ = q.shape
        if mask is not None:
            mask = mask[:, None]  # (B|1, 1, S, P), broadcast over heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
        )  # (B, nh, S, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The draft's single layer ("midlayer"): attention input is 2H wide."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out  # residual is the incoming hidden state, not the 2H input
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        # Frozen copy of the target's token embeddings; never saved in the checkpoint.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.feature_size, H, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # Identity mapping until a draft vocab is installed with set_vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    # -- setup --------------------------------------------------------------------------
    def set_embeddings(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise Eagle3Error(
                f"target embeddings have shape {tuple(weight.shape)}, the draft expects "
                f"{tuple(self.embed_tokens.weight.shape)}: the drafter was built for another target"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise Eagle3Error(
                f"draft vocab shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"the model's {tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    # -- running ------------------------------------------------------------------------
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, 3*Ht), or (B, T, Ht) for feature "last" -> (B, T, H)."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One incremental call: S new tokens after P cached ones.

        input_ids (B, S), hidden (B, S, H), position_ids (B, S); past (K, V) each
        (B, nkv, P, hd); attention_mask bool (B|1, S, P+S), True = may attend. Without a mask
        the new tokens attend to the whole cache and causally among themselves.
        Returns (out_hidden (B, S, H), logits (B, S, Vd), new cache including these tokens).
        """
        layer = self.midlayer
        x = layer.attn_input(self.embed_tokens(input_ids).to(hidden.dtype), hidden)
        q, k, v = layer.self_attn.qkv(x, position_ids)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], dim=2)
            v = torch.cat([past_key_values[1], v], dim=2)
        S, P_total = q.shape[2], k.shape[2]
        if attention_mask is None:
            P = P_total - S
            rows = torch.arange(S, device=q.device)[:, None] + P
            attention_mask = (torch.arange(P_total, device=q.device)[None, :] <= rows)[None]
        out = layer.finish(hidden, layer.self_attn.attend(q, k, v, attention_mask))
        return out, self.compute_logits(out), (k, v)

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        ttt_steps: int,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test unroll -> per-step draft logits, each (B, T, Vd).

        Step k at position t consumes token x_{t+k+1} (0 past the end; those positions carry
        no loss) and predicts x_{t+k+2}. Rotary position is t+k, as at inference.
        Packed rows (train/packing.py): segment_ids (B, T) keeps attention inside each record
        and position_ids (B, T) restarts positions per record (rotary position_ids + k); the
        token shift does cross a record's end, whose predictions the loss drops
        (eagle3.loss.step_targets).
        """
        B, T = input_ids.shape
        layer = self.midlayer
        hidden = self.project(aux_hidden)  # (B, T, H)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        positions = position_ids
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        step_logits = []
        for k in range(ttt_steps):
            ids = F.pad(input_ids[:, k + 1 :], (0, min(k + 1, T)))  # (B, T): x_{t+k+1}
            x = layer.attn_input(self.embed_tokens(ids).to(hidden.dtype), hidden)
            q, key, value = layer.self_attn.qkv(x, positions + k)
            keys.append(key)
            values.append(value)
            attn = layer.self_attn.attend_ttt(q, keys, values, segment_ids)
            hidden = layer.finish(hidden, attn)
            step_logits.append(self.compute_logits(hidden))
        return step_logits


class TTTModel(nn.Module):
    """Routes the TTT unroll through forward(): DDP and DeepSpeed only hook forward()."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        return self.draft.ttt_forward(
            input_ids,
            aux_hidden,
            self.ttt_steps,
            segment_ids=segment_ids,
            position_ids=position_ids,
        )
