"""The draft's building blocks: RMSNorm, the two attention kinds (Llama's GQA and DeepSeek-V3's
MLA) with their training-time-test and incremental paths, the SwiGLU MLP, and the decoder layer
that joins them. eagle3.model assembles them into the draft (its docstring gives the
definition); P-EAGLE's plain layers (eagle3.methods.p_eagle.draft) reuse the GQA attention and
the MLP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.rope import (
    apply_rotary,
    apply_rotary_interleaved,
    mla_mscales,
    mla_rotary,
    rotary_cos_sin,
)
from eagle3.ttt_attention import ttt_attention
from eagle3.ttt_attention.sequence_parallel import SequenceParallel

if TYPE_CHECKING:  # the layers read a DraftConfig's fields; eagle3.model imports this module
    from eagle3.model import DraftConfig


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


class DraftAttention(nn.Module):
    """What the two attention kinds share: given q, keys and values (qkv), the TTT attention
    and the incremental one, then o_proj. Subclasses set n_heads, scale, o_proj and qkv()."""

    n_heads: int
    scale: float
    o_proj: nn.Linear
    ttt_impl = "auto"  # "auto" | "chunked" | "flash" | "flex" | "sdpa" | "split": ttt_attention/

    def attend_ttt(
        self,
        q: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        segment_ids: torch.Tensor | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """TTT step k = len(keys) - 1: q (B, nh, T, dqk) over step-0 keys causally (within a
        segment) and the keys of steps 1..k on the diagonal -> (B, T, H). self.ttt_impl picks
        the kernel (eagle3.ttt_attention says what each is for). With `sequence_parallel`, q,
        keys and values hold the whole record for this rank's heads (its scatter_heads) and
        the output returns to this rank's positions before o_proj."""
        out = ttt_attention(
            q, keys, values, scale=self.scale, impl=self.ttt_impl, segment_ids=segment_ids
        )  # (B, nh, T, dv)
        if sequence_parallel is not None:
            out = sequence_parallel.gather_heads(out)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, nh, S, dqk) over k (B, nkv, P, dqk), v (B, nkv, P, dv) with bool mask
        (B|1, S, P) -> (B, S, H)."""
        B, _, S, _ = q.shape
        if mask is not None:
            mask = mask[:, None]  # (B|1, 1, S, P), broadcast over heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
        )  # (B, nh, S, dv)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class Attention(DraftAttention):
    """Llama's grouped-query attention over the 2H input (LlamaForCausalLMEagle3's layer)."""

    def __init__(self, cfg: DraftConfig, in_dim: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        # concat(embed, hidden) for the EAGLE-3 layer; H for P-EAGLE's plain layers
        in_dim = in_dim or 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

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


class MLAAttention(DraftAttention):
    """DeepSeek-V3's multi-head latent attention over the 2H input, as vLLM 0.32's
    DeepseekV2MLAAttention computes it in Eagle3DeepseekV3ForCausalLM's layer
    (vllm/model_executor/models/deepseek_v2.py, layers/mla.py), per token x (2H):

        c_q          = q_a_layernorm(q_a_proj(x))                  (q_lora_rank)
        [q_n | q_r]  = q_b_proj(c_q), per head                     (nope | rope); q_lora_rank 0:
                                                                   q_proj(x) instead
        [c_kv | k_r] = kv_a_proj_with_mqa(x)                       (kv_lora_rank | rope)
        [k_n | v]    = kv_b_proj(kv_a_layernorm(c_kv)), per head   (nope | v_head_dim)
        q = [q_n | rot(q_r)], k = [k_n | rot(k_r)]                 k_r shared by every head
        out          = o_proj(softmax(scale * q k^T) v)            (nh * v_head_dim -> H)

    rot is DeepSeek's interleaved rotary at the token's position (eagle3.rope.mla_rotary:
    YaRN frequencies, cos/sin times mscale(f, mscale) / mscale(f, mscale_all_dim)), and scale
    = (nope + rope)^-0.5 * mscale(f, mscale_all_dim)^2, vLLM's `self.scaling` for
    "deepseek_yarn". Keys and values are expanded per head here (nkv = nh), for training and
    the in-house decoder; vLLM caches the kv_lora_rank + rope latent (576 values a token for
    Kimi) and absorbs kv_b_proj into the query: the same function.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        in_dim, nh = 2 * cfg.hidden_size, cfg.num_attention_heads
        self.n_heads = self.n_kv = nh
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.scale = (self.nope + self.rope) ** -0.5 * mla_mscales(cfg.rope_scaling)[1]
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * (self.nope + self.rope), bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, cfg.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, S, 2H) -> q and k (B, nh, S, nope + rope), v (B, nh, S, v_head_dim)."""
        B, S, _ = x.shape
        nh, nope, rope = self.n_heads, self.nope, self.rope
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, S, nh, nope + rope).transpose(1, 2)  # (B, nh, S, nope + rope)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, S, nh, nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([nope, self.v_dim], dim=-1)  # (B, nh, S, .)
        cos, sin = mla_rotary(
            position_ids, rope, self.cfg.rope_theta, q.dtype, self.cfg.rope_scaling
        )  # (B, 1, S, rope / 2)
        q_rope = apply_rotary_interleaved(q[..., nope:], cos, sin)
        k_rope = apply_rotary_interleaved(k_rope[:, None], cos, sin)  # (B, 1, S, rope)
        q = torch.cat([q[..., :nope], q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, nh, S, rope)], dim=-1)
        return q, k, v.contiguous()


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
        self.self_attn = MLAAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out  # residual is the incoming hidden state, not the 2H input
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
