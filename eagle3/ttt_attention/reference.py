"""The quadratic-memory references of TTT attention: "sdpa" (one masked SDPA over the dense
mask) and "split" (the causal scores and the diagonal logits softmaxed jointly), and that dense
mask (ttt_mask). The maths is :mod:`eagle3.ttt_attention`'s docstring."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_mask(
    seq_len: int, step: int, device: torch.device, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool (B|1, T, (step+1)*T): step-0 keys causally (within a segment), keys of steps
    1..step on the diagonal."""
    idx = torch.arange(seq_len, device=device)
    causal = (idx[None, :] <= idx[:, None])[None]  # (1, T, T)
    if segment_ids is not None:
        causal = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
    diag = torch.eye(seq_len, dtype=torch.bool, device=device).expand_as(causal)
    return torch.cat([causal] + [diag] * step, dim=2)


def sdpa_ttt(q, keys, values, *, scale, segment_ids=None):
    """One SDPA over all (k+1)*T keys under the dense ttt_mask."""
    mask = ttt_mask(q.shape[2], len(keys) - 1, q.device, segment_ids)[:, None]  # (B|1, 1, T, kT)
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nkv, (k+1)T, d)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )  # (B, nh, T, dv)


def split_ttt(q, keys, values, *, scale, segment_ids=None):
    """Causal (B, nh, T, T) scores and the k diagonal logits, one joint float32 softmax."""
    B, nh, T, _ = q.shape
    rep = nh // keys[0].shape[1]
    k0 = keys[0].repeat_interleave(rep, dim=1)  # (B, nh, T, dqk)
    v0 = values[0].repeat_interleave(rep, dim=1)  # (B, nh, T, dv)
    causal = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, T, T)
    causal = causal.masked_fill(~ttt_mask(T, 0, q.device, segment_ids)[:, None], float("-inf"))
    if len(keys) == 1:
        return causal.float().softmax(-1).to(q.dtype) @ v0
    kd = torch.stack(keys[1:], dim=-2).repeat_interleave(rep, dim=1)  # (B, nh, T, k, dqk)
    vd = torch.stack(values[1:], dim=-2).repeat_interleave(rep, dim=1)  # (B, nh, T, k, dv)
    diag = (q.unsqueeze(-2) * kd).sum(-1) * scale  # (B, nh, T, k)
    probs = torch.cat([causal, diag], dim=-1).float().softmax(-1).to(q.dtype)
    return probs[..., :T] @ v0 + (probs[..., T:].unsqueeze(-1) * vd).sum(-2)  # (B, nh, T, dv)
