"""Sequence parallelism for the TTT unroll: one record split across the ranks of a group, its
attention exchanged Ulysses-style (all-to-all between a sequence shard of every head and the
whole sequence of a share of the heads).

What runs where. A group of `sp` ranks holds one record (B rows, T tokens), rank r the
contiguous positions [r T/sp, (r+1) T/sp) (train/sequence_parallel.py pads T to a multiple of
sp and cuts the shards). Everything of the draft but attention is per position (fc, norms,
the MLP, the logits, the loss), so it runs on the shard alone. Attention needs other
positions' keys: before it, one all-to-all per tensor turns q, k and v (B, nh, T/sp, d) into
(B, nh/sp, T, d) (`scatter_heads`): rank r then holds the whole record for heads
[r nh/sp, (r+1) nh/sp), and calls the unchanged `ttt_attention` kernel on it. The causal
step-0 part, the TTT diagonal (the keys of steps 1..k at a row's own position), the packed
rows' segments (the whole row's segment ids, not the shard's) and every kernel's linear-memory
tiling are the one-process ones, so exactness comes for free: the same numbers in the same
kernel, only fewer heads. One all-to-all back (`gather_heads`) returns each rank its positions
of every head for o_proj. The backward of each all-to-all is the inverse all-to-all
(`_AllToAll`: gloo and NCCL alike, no functional-collective autograd needed). Keys and values
of a TTT step are exchanged once, when they are made, and kept in the scattered layout for
the later steps' diagonal.

Why Ulysses and not ring attention:
- Memory per rank: activations of the per-position parts fall as 1/sp; attention's saved
  tensors are (nh/sp) heads x T instead of nh x T/sp: the same bytes. Ring attention also
  holds 1/sp, plus two K/V blocks in flight.
- Communication on a PCIe node (no NVLink, ~25 GB/s a card): Ulysses moves each rank's
  q, k, v and output once per TTT step, (sp-1)/sp of (2 dqk + 2 dv) x nh values per local
  token: Kimi's MLA draft (64 heads, 192/128) at sp = 8 and 8,192 tokens a rank is ~0.6 GB
  forward per step, as much again backward, ~8 GB per 7-step micro-step per rank. Ring
  attention circulates every other rank's step-0 K/V at every TTT step, (sp-1) x (dqk + dv) x
  nh values per local token: at sp = 8 for expanded MLA heads ~4x Ulysses' bytes forward and
  ~8x backward (which circulates the K/V gradients too). A ring over MLA's 576-value latent
  would move less, but re-expands kv_b_proj for all T tokens on every rank, and needs a
  log-sum-exp merge of partial attentions with its own backward through each kernel (the CPU
  flash path and flex do not return their LSE).
- Heads: Kimi's MLA draft has 64 (sp = 8: 8 a rank); the GQA draft 56 query / 8 KV heads
  (sp = 8: 7 query heads and their one KV head a rank). Ulysses needs sp | nh; where sp does
  not divide the KV heads, they are repeated to the query heads first (each query head's own
  KV, exact, at nh/nkv times the KV traffic).
- Simplicity: no change to any kernel. Ring attention would be needed past nh ranks (64 for
  Kimi MLA): one node's 8 GPUs never get there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagle3.errors import Eagle3Error


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` of x (sp, ...): chunk j goes to rank j, the result's
    chunk i came from rank i. Its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # gloo and NCCL read and write flat buffers
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # autograd may hand a strided one
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class SequenceParallel:
    """One group's sequence parallelism for a TTT forward: the group, this rank's place in it,
    and the whole (padded) rows' segment ids of packed rows (None: one record per row).

    A plain object, not a tensor container: DDP passes it through forward() untouched."""

    def __init__(self, group, segment_ids: torch.Tensor | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.segment_ids = segment_ids

    def check_heads(self, heads: int) -> None:
        if heads % self.size:
            raise Eagle3Error(
                f"sequence parallelism over {self.size} ranks splits the draft's "
                f"{heads} attention heads between them: choose a group size that divides {heads}"
            )

    def scatter_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """(B, h, T/sp, d), this rank's positions of every head -> (B, h'/sp, T, d), the whole
        sequence of this rank's share of the heads. `heads` (the query heads): KV heads that
        sp does not divide are repeated to them first (GQA's grouping kept: query head i
        reads KV head i // (heads / h))."""
        B, h, t, d = x.shape
        if h % self.size:
            x = x.repeat_interleave((heads or h) // h, dim=1)
            B, h, t, d = x.shape
        self.check_heads(h)
        sp = self.size
        send = x.reshape(B, sp, h // sp, t, d).transpose(0, 1)  # chunk j: heads for rank j
        got = _AllToAll.apply(send.contiguous(), self.group)  # chunk i: rank i's positions
        return got.permute(1, 2, 0, 3, 4).reshape(B, h // sp, sp * t, d)

    def gather_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, h/sp, T, d), the whole sequence of this rank's heads -> (B, h, T/sp, d), this
        rank's positions of every head (scatter_heads' inverse)."""
        B, hs, T, d = y.shape
        sp = self.size
        send = y.reshape(B, hs, sp, T // sp, d).permute(2, 0, 1, 3, 4)  # chunk j: j's positions
        got = _AllToAll.apply(send.contiguous(), self.group)  # chunk i: rank i's heads
        return got.transpose(0, 1).reshape(B, sp * hs, T // sp, d)
