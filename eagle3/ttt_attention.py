"""The training-time-test (TTT) attention of the EAGLE-3 draft, and the kernels that compute it.

The maths. TTT step k (k + 1 = len(keys)) has a query q_t per position t, step-0 keys and values
(k0_s, v0_s) at every position s, and the keys and values of steps 1..k (kj_t, vj_t). Query t
attends to

    A(t) = {(0, s) : s <= t and seg[s] == seg[t]}  U  {(j, t) : j = 1..k}

(the step-0 keys causally within its own document, plus the keys of steps 1..k at its own
position, the "diagonal"), with one joint softmax:

    logit(j, s) = scale * <q_t, kj_s>
    out_t       = sum_{(j, s) in A(t)} softmax_A(t)(logit)_(j, s) * vj_s

This is exactly what the draft sees at inference after k chained steps. `seg` is the optional
(B, T) `segment_ids` of a packed row (several documents in one row, padding under an id of its
own); without it every position is one document. A(t) always holds (0, t), so no row is empty.
q and keys have head dim dqk, values dv (dqk != dv: MLA drafts use 192 vs 128); nh query heads
share nkv key/value heads (GQA, nh a multiple of nkv).

Why each path exists (`ttt_attention(impl=...)`):
- "chunked": exact, linear memory, any device; the CPU path. A flash-attention-style
  autograd.Function over tiles of (chunk of query rows, block of step-0 keys): chunk [a, b)
  scores only k0[lo:b] (causal skipping, about half the FLOPs of a dense T x T; in a packed row
  lo is the start of the chunk's earliest document, so other documents' keys are skipped too,
  not just masked) plus the k diagonal keys, one key block at a time with an online softmax
  (running max and sum rescaled per block). A tile's scores, (rep*C, key_block) per KV head,
  stay in the core's cache where a whole row of 16k keys did not. Matmuls run in the inputs'
  dtype; softmax, LSE and the gradient sums in float32 (bf16 inputs too). Forward saves q,
  keys, values, out and the per-row log-sum-exp (B, nh, T); backward recomputes each tile's
  probabilities from the LSE (dS = P * (dO V^T - rowsum(dO * O))). Transient memory is a
  tile's scores in two or three reused buffers: constant in T.
- "flash": CPU. torch's own fused flash-attention kernel (aten's
  `_scaled_dot_product_flash_attention_for_cpu` and its backward: C++, vectorised, one pass per
  tile with exp and the row sums fused, tiles spread over threads inside one call) for the
  causal step-0 part, one call per document of a packed row; its per-row log-sum-exp merges
  the k diagonal logits (lse = logaddexp(lse_causal, logsumexp(diag))). Backward calls the
  kernel's backward with the *merged* output and LSE (its P = exp(S - lse) and rowsum(dO * O)
  are then the joint softmax's), and adds the diagonal's gradients in closed form, the same
  code as "chunked". SpecForge's flash-attn "fa" backend does this on GPUs; here the kernel is
  torch's, so nothing is installed. Exact and linear in T like "chunked" (the kernel's scratch
  is a tile per thread), and measured faster on CPU (results/README.md, "Long sequences").
  The kernel takes one head dim for q, k and v: MLA's narrower values are zero-padded to the
  qk width (exact; those columns are sliced off). Rows whose segment ids are not contiguous
  runs (never made by packing) go to "chunked".
- "flex": CUDA only. torch's compiled flex_attention (Triton) with a block mask over the step
  keys concatenated along the sequence axis, KV_LEN = (k+1) T, built by the compiled
  create_block_mask from `ttt_mask_mod`: fused, and it skips the blocks the mask empties.
  flex_attention has no CPU backward (torch 2.13); on CPU its mask is checked through flex's
  unfused forward, its kernels by the gpu-marked test.
- "sdpa": one masked SDPA over a dense (T, (k+1) T) mask: quadratic memory, k T^2 wasted scores.
  The reference implementation; the old GPU path.
- "split": the causal (B, nh, T, T) scores and the k diagonal logits softmaxed jointly:
  quadratic memory. The old CPU path; kept as a second reference.
- "auto": "flex" on CUDA when flex attention imports (fused kernels, linear memory); on CPU
  "flash" where this torch has the kernel and q, k and v share a head dim, else "chunked"
  (the portable fallback, and MLA's path: padding its 128-wide values to 192 made "flash"
  slower than "chunked", 51 vs 65 tokens/s for the Kimi MLA draft's step at T = 1k). If flex
  fails its self-test (forward and backward on random tensors of the real heads, dims and
  dtype, once per shape: a torch whose forward fits the GPU's shared memory but whose backward
  does not is caught before training), or raises in a forward later, "auto" logs one line
  naming why and uses "chunked". flex_kernel_options gives the small-shared-memory GPUs
  (sm_86/89/120: 101,376 B a block) single-stage 32-row tiles at MLA's head dims. Flex has not
  yet run on a GPU in this project's tests (none was lent).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error

IMPLS = ("auto", "chunked", "flash", "flex", "sdpa", "split")
# Query rows per chunk and step-0 keys per block of the "chunked" path. Measured on this
# project's 2-core CPU, fp32, forward + backward: before key blocks (a chunk scored every key
# below it at once), 9 heads x 64 (SmolLM2 draft), k = 3, T = 8k: 64 / 128 / 256 / 512 rows
# 3.2-3.7 / 3.1 / 3.3 / 3.5 s; 56 heads x 128 (Kimi layout), k = 6, T = 2k: 2.2 / 2.2 / 3.0 /
# 3.7 s. With key blocks: a (3 x 128, 64) @ (64, w) score matmul runs at ~145 GFLOP/s for w =
# 256-1024 and ~106 at w = 8192 (the block no longer fits the 1 MiB L2); attention alone, 4 TTT
# steps, one thread on a loaded machine, best / median of 2: T = 8k 19.1 / 24.3 s whole rows,
# 16.2 / 24.1 s with 512-key blocks, 17.1 / 20.9 s with 1024; T = 2k (one block or two) 1.24 vs
# 1.21 s. 128 x 512: a (3 x 128) x 512 tile is 0.75 MiB per KV head, within L2 (the Kimi
# layout's 7 x 128 rows make 1.75 MiB; not re-measured with key blocks). The whole training
# step at T = 16k (one thread) did not measurably gain: 122 vs 130 tokens/s (results/README.md).
CHUNK_SIZE = 128
KEY_BLOCK = 512

log = logging.getLogger(__name__)
_FLEX_FAILED: list[str] = []  # "auto" stops trying flex after its first failure in a process

# torch's CPU flash-attention kernel and its backward (torch >= 2.3): the "flash" path
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)

try:  # flex attention: torch >= 2.5; never a reason for this module to fail to import
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - old torch
    create_block_mask = flex_attention = None


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    scale: float,
    impl: str = "auto",
    segment_ids: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """TTT attention of step k = len(keys) - 1 (the module docstring's maths) -> (B, nh, T, dv).

    q (B, nh, T, dqk); keys[j] (B, nkv, T, dqk) and values[j] (B, nkv, T, dv) of steps 0..k;
    segment_ids (B, T) int or None (one document per row).
    """
    if impl == "auto":
        impl = auto_impl(q.device, q.shape[-1], values[0].shape[-1])
        if impl == "flex" and flex_verdict(q, keys, values, scale) is not None:
            impl = "chunked"  # flex failed its self-test at these shapes (logged once)
        if impl == "flex":
            try:
                return flex_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
            except Exception as err:  # noqa: BLE001 - a GPU/Triton build flex cannot compile for
                _FLEX_FAILED.append(repr(err))  # the exact linear-memory path still runs
                log.warning("flex attention failed on this GPU (%s); TTT attention falls back "
                            "to 'chunked' (exact, linear memory, slower)", err)  # fmt: skip
                impl = "chunked"
    if impl == "flash":
        if q.is_cuda or _FLASH_CPU is None:
            raise Eagle3Error(
                "ttt_impl 'flash' is torch's CPU flash-attention kernel (torch >= 2.3, CPU "
                "tensors); use 'auto' (flex on CUDA) or 'chunked'"
            )
        documents = _documents(segment_ids)
        if documents is not None and q.shape[2] > 0:  # else "chunked" masks exactly
            with torch.autocast(q.device.type, enabled=False):
                return _FlashTTT.apply(q, documents, scale, *keys, *values)
        impl = "chunked"
    if impl == "chunked":  # in the inputs' dtype: autocast would recast its matmuls
        with torch.autocast(q.device.type, enabled=False):
            return _ChunkedTTT.apply(q, segment_ids, scale, chunk_size, key_block, *keys, *values)
    if impl == "flex":
        if not q.is_cuda or flex_attention is None:
            raise Eagle3Error(
                "ttt_impl 'flex' needs a CUDA device and torch >= 2.5 (flex attention has no CPU "
                "backward); use 'chunked' or 'auto'"
            )
        return flex_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
    if impl == "sdpa":
        return sdpa_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
    if impl == "split":
        return split_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
    raise Eagle3Error(f"ttt_impl {impl!r} is not one of {', '.join(IMPLS)}")


def auto_impl(device: torch.device, dqk: int, dv: int) -> str:
    """What impl "auto" runs on `device` for query/key head dim dqk and value head dim dv (the
    module docstring says why)."""
    if device.type == "cuda":
        return "flex" if flex_attention is not None and not _FLEX_FAILED else "chunked"
    flash = device.type == "cpu" and _FLASH_CPU is not None and dqk == dv
    return "flash" if flash else "chunked"


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


# -- "sdpa" and "split": quadratic-memory references ------------------------------------------
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


# -- "chunked": exact, linear memory ----------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / LSE / gradient-accumulation dtype: float32 for half types, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# A tile's (G, rep*C, w) blocks live in flat buffers allocated once per call: on CPU a fresh
# block per tile is allocated and page-faulted anew (glibc mmaps allocations over 32 MiB),
# which measured ~25% of the chunked step when a chunk's block spanned every key (T = 8k).
def _view(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return buf[: math.prod(shape)].view(shape)


def _matmul_into(a, b, acc_buf, low_buf):
    """a @ b in the accumulation dtype, written into acc_buf (through low_buf, in the inputs'
    dtype, when that is a half type)."""
    shape = (*a.shape[:-1], b.shape[-1])
    if low_buf is None:
        return torch.matmul(a, b, out=_view(acc_buf, shape))
    return _view(acc_buf, shape).copy_(torch.matmul(a, b, out=_view(low_buf, shape)))


def _cast_into(x, low_buf):
    """x in the inputs' dtype: x itself, or its copy in low_buf (half inputs)."""
    return x if low_buf is None else _view(low_buf, x.shape).copy_(x)


def _add_matmul(acc, a, b, low_buf):
    """acc += a @ b, batched over dim 0; acc in the accumulation dtype, a and b in the inputs'
    (through low_buf when those differ)."""
    if low_buf is None:
        return acc.baddbmm_(a, b)
    return acc.add_(torch.bmm(a, b, out=_view(low_buf, acc.shape)))


def _segment_bounds(segment_ids, T, chunk_size):
    """Per query chunk [a, b): (lo, clean_from). lo: the first step-0 key any of its rows may
    see (keys below it are all another document's: skipped); clean_from: keys and rows at or
    above it are all of one document (no segment mask needed there). Both assume contiguous
    segments, as packed rows have; other segment_ids get (0, T + 1): exact, nothing skipped."""
    starts = range(0, T, chunk_size)
    if segment_ids is None:
        return [0] * len(starts), [0] * len(starts)
    seg = segment_ids.cpu()
    new = torch.ones_like(seg, dtype=torch.bool)  # (B, T): where a segment begins
    new[:, 1:] = seg[:, 1:] != seg[:, :-1]
    if _documents(seg) is None:  # an id that returns: not contiguous
        return [0] * len(starts), [T + 1] * len(starts)
    first = torch.where(new, torch.arange(T), 0).cummax(-1).values  # (B, T): its segment's start
    lo = first[:, list(starts)].amin(0).tolist()  # the chunk's first row has the earliest start
    last = [min(a + chunk_size, T) - 1 for a in starts]
    return lo, first[:, last].amax(0).tolist()


def _block_allowed(a, b, s, e, segment_ids, clean_from, device):
    """Bool (B|1, C, e - s): which step-0 keys [s, e) rows [a, b) may see, or None when all."""
    causal = e > a + 1  # a key above some row: the block reaches the diagonal
    segments = segment_ids is not None and min(s, a) < clean_from
    if not (causal or segments):
        return None
    rows, cols = torch.arange(a, b, device=device), torch.arange(s, e, device=device)
    allowed = (cols[None, :] <= rows[:, None])[None]  # (1, C, w)
    if segments:
        allowed = allowed & (segment_ids[:, a:b, None] == segment_ids[:, None, s:e])  # (B, C, w)
    return allowed


def _stack_diag(xs):
    """Steps 1..k's keys or values [(B, nkv, T, d)] -> (B, nkv, T, k, d), or None when k = 0."""
    return torch.stack(xs[1:], dim=-2) if len(xs) > 1 else None


def _diag_logits(qs, kd, a, b):
    """(B, nkv, rep, C, k) logits of rows [a, b) against their own position's keys of steps 1..k
    (kd (B, nkv, T, k, dqk)), in the accumulation dtype."""
    return (qs.unsqueeze(-2) * kd[:, :, None, a:b]).sum(-1).to(_acc_dtype(qs.dtype))


def _diag_grads(qs, kd, vd, do, lse, D, a, b):
    """Rows [a, b)'s gradients through their diagonal logits, given the joint softmax's LSE and
    D = rowsum(dO * O) (both (B, nkv, rep, T)): qs the rows' scaled queries (B, nkv, rep, C,
    dqk), do their dO (B, nkv, rep, C, dv), kd / vd (B, nkv, T, k, d) ->
    (dq (B, nkv, rep, C, dqk), still to be multiplied by the scale; dkd (B, nkv, C, k, dqk);
    dvd (B, nkv, C, k, dv)), the last two summed over the rep query heads of their KV head."""
    pd = _diag_logits(qs, kd, a, b).sub_(lse[..., a:b, None]).exp_()  # (B, nkv, rep, C, k)
    vdc, kdc = vd[:, :, None, a:b], kd[:, :, None, a:b]  # (B, nkv, 1, C, k, d)
    dsd = (do.unsqueeze(-2) * vdc).sum(-1).to(pd.dtype)  # dP of the diagonal
    dsd = dsd.sub_(D[..., a:b, None]).mul_(pd).to(qs.dtype)  # dS: the logits' gradient
    dq = (dsd.unsqueeze(-1) * kdc).sum(-2)
    dkd = (dsd.unsqueeze(-1) * qs.unsqueeze(-2)).sum(2)
    dvd = (pd.to(qs.dtype).unsqueeze(-1) * do.unsqueeze(-2)).sum(2)
    return dq, dkd, dvd


class _ChunkedTTT(torch.autograd.Function):
    """Flash-attention-style TTT attention over tiles of (query chunk, key block); see the
    module docstring.

    apply(q, segment_ids, scale, chunk_size, key_block, *keys, *values). GQA without repeating
    K/V: q is viewed (B, nkv, rep, T, d) and a chunk's rep*C rows share one matmul with their KV
    head, batched over G = B * nkv.
    """

    @staticmethod
    def forward(ctx, q, segment_ids, scale, chunk_size, key_block, *kv):
        n = len(kv) // 2
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        nkv, dv = keys[0].shape[1], values[0].shape[-1]
        rep, acc, G = nh // nkv, _acc_dtype(q.dtype), B * nkv
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        k0, v0 = keys[0].reshape(G, T, dqk), values[0].reshape(G, T, dv)
        kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
        out = q.new_empty(B, nkv, rep, T, dv)
        lse = q.new_empty(B, nkv, rep, T, dtype=acc)
        tile = G * rep * min(chunk_size, T) * min(key_block, T)  # a tile's scores, at most
        s_buf = q.new_empty(tile, dtype=acc)
        low_buf = q.new_empty(tile) if acc != q.dtype else None
        term_buf = q.new_empty(G * rep * chunk_size * dv) if low_buf is not None else None
        los, clean = _segment_bounds(segment_ids, T, chunk_size)
        for i, a in enumerate(range(0, T, chunk_size)):
            b = min(a + chunk_size, T)
            C, R = b - a, rep * (b - a)
            qs = (qg[..., a:b, :] * scale).contiguous()  # (B, nkv, rep, C, dqk)
            qr = qs.view(G, R, dqk)
            # The running max starts at the self logit (always allowed, so finite): a row whose
            # keys in some block are all masked then never meets exp(-inf - -inf).
            m = (qs * keys[0][:, :, None, a:b]).sum(-1).to(acc)  # (B, nkv, rep, C)
            if n > 1:  # the diagonal keys open the online softmax
                diag = _diag_logits(qs, kd, a, b)  # (B, nkv, rep, C, k)
                m = torch.maximum(m, diag.amax(-1))
                pd = diag.sub_(m[..., None]).exp_()
                denom = pd.sum(-1).view(G, R)
                o = (pd.to(q.dtype).unsqueeze(-1) * vd[:, :, None, a:b]).sum(-2).to(acc)
                o = o.view(G, R, dv)
            else:
                denom, o = q.new_zeros(G, R, dtype=acc), q.new_zeros(G, R, dv, dtype=acc)
            m = m.view(G, R)
            for s in range(los[i], b, key_block):  # online softmax over key blocks
                e = min(s + key_block, b)
                scores = _matmul_into(qr, k0[:, s:e].transpose(1, 2), s_buf, low_buf)
                allowed = _block_allowed(a, b, s, e, segment_ids, clean[i], q.device)
                if allowed is not None:  # (B|1, C, w) over the (G, rep*C, w) scores
                    sv = scores.view(B, nkv, rep, C, e - s)
                    sv.masked_fill_(~allowed[:, None, None], float("-inf"))
                m_new = torch.maximum(m, scores.amax(-1))  # (G, R)
                alpha = (m - m_new).exp_()  # rescales what earlier blocks summed
                p = scores.sub_(m_new[..., None]).exp_()  # (G, R, w)
                denom = denom.mul_(alpha).add_(p.sum(-1))
                o = _add_matmul(
                    o.mul_(alpha[..., None]), _cast_into(p, low_buf), v0[:, s:e], term_buf
                )
                m = m_new
            out[..., a:b, :] = (o / denom[..., None]).view(B, nkv, rep, C, dv)
            lse[..., a:b] = (m + denom.log()).view(B, nkv, rep, C)
        out = out.view(B, nh, T, dv)
        lse = lse.view(B, nh, T)
        ctx.save_for_backward(q, segment_ids, out, lse, *kv)
        ctx.scale, ctx.chunk_size, ctx.key_block, ctx.n = scale, chunk_size, key_block, n
        ctx.bounds = (los, clean)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segment_ids, out, lse, *kv = ctx.saved_tensors
        scale, chunk_size, key_block, n = ctx.scale, ctx.chunk_size, ctx.key_block, ctx.n
        los, clean = ctx.bounds
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        nkv, dv = keys[0].shape[1], values[0].shape[-1]
        rep, acc, G = nh // nkv, _acc_dtype(q.dtype), B * nkv
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        dog = dout.contiguous().view(B, nkv, rep, T, dv)  # (B, nkv, rep, T, dv)
        lse = lse.view(B, nkv, rep, T)
        D = (dout.to(acc) * out.to(acc)).sum(-1).view(B, nkv, rep, T)  # rowsum(dO * O)
        k0, v0 = keys[0].reshape(G, T, dqk), values[0].reshape(G, T, dv)
        kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
        dq = torch.empty_like(qg)
        dk0 = q.new_zeros(G, T, dqk, dtype=acc)
        dv0 = q.new_zeros(G, T, dv, dtype=acc)
        if n > 1:
            dkd = q.new_empty(kd.shape, dtype=acc)  # (B, nkv, T, k, dqk)
            dvd = q.new_empty(vd.shape, dtype=acc)  # (B, nkv, T, k, dv)
        tile = G * rep * min(chunk_size, T) * min(key_block, T)
        p_buf, ds_buf = q.new_empty(tile, dtype=acc), q.new_empty(tile, dtype=acc)
        low_buf = q.new_empty(tile) if acc != q.dtype else None
        # a tile's dK0 / dV0 / dQ terms in the inputs' dtype (half inputs)
        rows = max(rep * min(chunk_size, T), min(key_block, T))
        term_buf = q.new_empty(G * rows * max(dqk, dv)) if low_buf is not None else None
        for i, a in enumerate(range(0, T, chunk_size)):
            b = min(a + chunk_size, T)
            C, R = b - a, rep * (b - a)
            qs = (qg[..., a:b, :] * scale).contiguous()  # (B, nkv, rep, C, dqk)
            qr = qs.view(G, R, dqk)
            do = dog[..., a:b, :]  # (B, nkv, rep, C, dv)
            dor = do.reshape(G, R, dv)
            lse_c = lse[..., a:b].reshape(G, R, 1)
            D_c = D[..., a:b].reshape(G, R, 1)
            dqc = q.new_zeros(G, R, dqk, dtype=acc)
            for s in range(los[i], b, key_block):
                e = min(s + key_block, b)
                scores = _matmul_into(qr, k0[:, s:e].transpose(1, 2), p_buf, low_buf)
                allowed = _block_allowed(a, b, s, e, segment_ids, clean[i], q.device)
                if allowed is not None:
                    sv = scores.view(B, nkv, rep, C, e - s)
                    sv.masked_fill_(~allowed[:, None, None], float("-inf"))
                p = scores.sub_(lse_c).exp_()  # (G, R, w), masked -> 0
                # dV0 of the block sums over the chunk's rows and the rep heads
                _add_matmul(dv0[:, s:e], _cast_into(p, low_buf).transpose(1, 2), dor, term_buf)
                # dS = P * (dP - D), dP = dO V^T: the gradient of the scaled logits
                ds = _matmul_into(dor, v0[:, s:e].transpose(1, 2), ds_buf, low_buf)
                ds = _cast_into(ds.sub_(D_c).mul_(p), low_buf)
                _add_matmul(dqc, ds, k0[:, s:e], term_buf)
                _add_matmul(dk0[:, s:e], ds.transpose(1, 2), qr, term_buf)
            dqc = dqc.view(B, nkv, rep, C, dqk)
            if n > 1:
                dq_diag, dkd[:, :, a:b], dvd[:, :, a:b] = _diag_grads(qs, kd, vd, do, lse, D, a, b)
                dqc += dq_diag
            dq[..., a:b, :] = dqc * scale
        dkeys = [dk0.view(keys[0].shape)]
        dvalues = [dv0.view(values[0].shape)]
        if n > 1:
            dkeys += list(dkd.unbind(-2))
            dvalues += list(dvd.unbind(-2))
        grads = [g.to(x.dtype) for g, x in zip(dkeys + dvalues, kv)]
        return (dq.view(B, nh, T, dqk), None, None, None, None, *grads)


# -- "flash": torch's CPU flash-attention kernel + the diagonal merged by log-sum-exp ----------
DIAG_ROWS = 256  # rows per pass over the diagonal logits: bounds their (rows, k, d) products


def _documents(segment_ids: torch.Tensor | None) -> tuple | None:
    """The documents of packed rows: per batch row a tuple of (start, end). () without
    segment_ids (each row one document: one kernel call for the batch); None when a row's ids
    are not contiguous runs (an id that returns; packing never makes one)."""
    if segment_ids is None:
        return ()
    rows = []
    for row in segment_ids.cpu():
        starts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()]
        if torch.unique(row[starts]).numel() != len(starts):
            return None
        rows.append(tuple(zip(starts, [*starts[1:], row.numel()])))
    return tuple(rows)


def _causal_by_document(op, documents, tensors, scale, make_outs):
    """The flash kernel's causal call `op(*tensors, 0.0, True, scale=scale)`: once over whole
    rows (documents == ()), else over each document's slice of every tensor (T is dim 2), the
    results written into the tensors make_outs() returns -> the results."""
    if not documents:
        return op(*tensors, 0.0, True, scale=scale)
    outs = make_outs()
    for b, row in enumerate(documents):
        for s, e in row:
            piece = (slice(b, b + 1), slice(None), slice(s, e))
            for out, got in zip(outs, op(*(x[piece] for x in tensors), 0.0, True, scale=scale)):
                out[piece] = got
    return outs


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x zero-padded on its last dim to `width` (the kernel takes one head dim for q, k, v)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _merge_diagonal(q, keys, values, out_c, lse_c, scale):
    """The causal part's (out, lse) and the keys of steps 1..k at each row's own position ->
    the joint softmax's (out (B, nh, T, dv), lse (B, nh, T)): lse = logaddexp(lse_c,
    logsumexp(diag)), out = exp(lse_c - lse) out_c + sum_j exp(diag_j - lse) v_j."""
    B, nh, T, dqk = q.shape
    nkv, dv = keys[0].shape[1], values[0].shape[-1]
    rep = nh // nkv
    qg = q.view(B, nkv, rep, T, dqk)
    kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
    oc, lc = out_c.view(B, nkv, rep, T, dv), lse_c.view(B, nkv, rep, T)
    out, lse = torch.empty_like(oc), torch.empty_like(lc)
    for a in range(0, T, DIAG_ROWS):
        b = min(a + DIAG_ROWS, T)
        diag = _diag_logits(qg[..., a:b, :] * scale, kd, a, b)  # (B, nkv, rep, C, k)
        lse[..., a:b] = torch.logaddexp(lc[..., a:b], diag.logsumexp(-1))
        pd = diag.sub_(lse[..., a:b, None]).exp_()
        causal = oc[..., a:b, :].to(pd.dtype) * (lc[..., a:b] - lse[..., a:b]).exp()[..., None]
        out[..., a:b, :] = causal + (pd.unsqueeze(-1) * vd[:, :, None, a:b].to(pd.dtype)).sum(-2)
    return out.view(B, nh, T, dv), lse.view(B, nh, T)


class _FlashTTT(torch.autograd.Function):
    """TTT attention through torch's CPU flash-attention kernel; see the module docstring.

    apply(q, documents, scale, *keys, *values); documents as `_documents` returns them.
    """

    @staticmethod
    def forward(ctx, q, documents, scale, *kv):
        n = len(kv) // 2
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        dv = values[0].shape[-1]
        width = max(dqk, dv)
        qp, kp, vp = _padded(q, width), _padded(keys[0], width), _padded(values[0], width)
        out, lse = _causal_by_document(
            _FLASH_CPU,
            documents,
            (qp, kp, vp),
            scale,
            lambda: (
                q.new_empty(B, nh, T, width),
                q.new_empty(B, nh, T, dtype=_acc_dtype(q.dtype)),
            ),
        )
        out = out[..., :dv].contiguous()
        if n > 1:
            out, lse = _merge_diagonal(q, keys, values, out, lse, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.documents, ctx.scale, ctx.n = documents, scale, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        documents, scale, n = ctx.documents, ctx.scale, ctx.n
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        nkv, dv = keys[0].shape[1], values[0].shape[-1]
        width = max(dqk, dv)
        dout = dout.contiguous()
        # The kernel's backward with the joint softmax's output and LSE: its recomputed
        # P = exp(S - lse) and D = rowsum(dO * O) are the joint ones, so its dQ, dK0, dV0 are
        # the step-0 keys' share of the gradients.
        qp, kp, vp = _padded(q, width), _padded(keys[0], width), _padded(values[0], width)
        dop, outp = _padded(dout, width), _padded(out, width)
        dq, dk0, dv0 = _causal_by_document(
            _FLASH_CPU_BACKWARD,
            documents,
            (dop, qp, kp, vp, outp, lse),
            scale,
            lambda: tuple(torch.empty_like(x) for x in (qp, kp, vp)),
        )
        dq, dk0, dv0 = dq[..., :dqk], dk0[..., :dqk], dv0[..., :dv]
        dkeys, dvalues = [dk0], [dv0]
        if n > 1:  # the diagonal's share, in closed form
            rep, acc = nh // nkv, _acc_dtype(q.dtype)
            dq = dq.contiguous().view(B, nkv, rep, T, dqk)
            qg, dog = q.view(B, nkv, rep, T, dqk), dout.view(B, nkv, rep, T, dv)
            lse_g = lse.view(B, nkv, rep, T)
            D = (dout.to(acc) * out.to(acc)).sum(-1).view(B, nkv, rep, T)
            kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
            dkd, dvd = torch.empty_like(kd), torch.empty_like(vd)
            for a in range(0, T, DIAG_ROWS):
                b = min(a + DIAG_ROWS, T)
                qs = qg[..., a:b, :] * scale
                dq_diag, dkd[:, :, a:b], dvd[:, :, a:b] = _diag_grads(
                    qs, kd, vd, dog[..., a:b, :], lse_g, D, a, b
                )
                dq[..., a:b, :] += dq_diag * scale
            dq = dq.view(B, nh, T, dqk)
            dkeys += list(dkd.unbind(-2))
            dvalues += list(dvd.unbind(-2))
        grads = [g.to(x.dtype) for g, x in zip(dkeys + dvalues, kv)]
        return (dq.to(q.dtype), None, None, *grads)


# -- "flex": CUDA, compiled flex_attention ----------------------------------------------------
def ttt_mask_mod(seq_len: int, segment_ids: torch.Tensor | None = None, device=None):
    """flex_attention mask_mod over the step keys concatenated along the sequence axis:
    (kv < T and kv <= q and same segment) or (kv >= T and kv % T == q).

    T is captured as a 0-dim tensor, not an int: compiled kernels then take it as an input
    instead of recompiling for every sequence length."""
    T = torch.tensor(seq_len, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        s = kv_idx % T  # the key's position in its step
        causal = (kv_idx < T) & (s <= q_idx)
        if segment_ids is not None:
            causal = causal & (segment_ids[b, q_idx] == segment_ids[b, s])
        return causal | ((kv_idx >= T) & (s == q_idx))

    return mask_mod


@functools.cache
def _compiled_flex():
    """(flex_attention, create_block_mask), compiled once: the unfused flex materialises the
    scores and an uncompiled create_block_mask the dense (T, (k+1)T) mask. dynamic=True: one
    graph serves every sequence length (each new length would otherwise be a recompile, and
    past torch's recompile limit flex runs unfused, with the whole score matrix)."""
    return (
        torch.compile(flex_attention, dynamic=True),
        torch.compile(create_block_mask, dynamic=True),
    )


# Shared memory per thread block (bytes) of the GPUs whose default flex tiles overflow it at
# head dims over 128: sm_86 / sm_89 (RTX 30/40) and sm_120 / sm_121 (RTX PRO 6000 Blackwell,
# RTX 50). MLA's q/k of 192 are padded to 256; torch's sm_120 table has no 256 entry for bf16
# that fits (its forward needs ~144 KiB, its backward 114,688 B: pytorch issues 180278, 198224).
SMALL_SMEM_GPUS = {(8, 6): 101_376, (8, 9): 101_376, (12, 0): 101_376, (12, 1): 101_376}
# Tiles that fit 101,376 B at head dims 256 / 128 in bf16: one pipeline stage, 32-row blocks
# (forward: q 32 x 256 + k 32 x 256 + v 32 x 128, 2 B each, ~40 KiB; backward's four tiles of
# 16-32 rows likewise), at some speed cost against a two-stage pipeline.
SMALL_SMEM_FLEX_OPTIONS = {
    "fwd_BLOCK_M": 32,
    "fwd_BLOCK_N": 32,
    "fwd_num_stages": 1,
    "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 16,
    "bwd_BLOCK_N1": 32,
    "bwd_BLOCK_M2": 32,
    "bwd_BLOCK_N2": 16,
    "bwd_num_stages": 1,
    "bwd_num_warps": 4,
}


def flex_kernel_options(capability: tuple[int, int], dqk: int, dv: int) -> dict:
    """flex_attention kernel_options for a GPU's compute capability and the head dims: torch's
    own choice ({}) where its tiles fit, small single-stage tiles on the small-shared-memory
    GPUs at head dims over 128."""
    if tuple(capability) in SMALL_SMEM_GPUS and max(dqk, dv) > 128:
        return dict(SMALL_SMEM_FLEX_OPTIONS)
    return {}


# -- choosing flex: a forward + backward self-test at the real shapes, once per shape ----------
_FLEX_VERDICTS: dict[tuple, str | None] = {}  # shape key -> None (flex works) or why not
SELF_TEST_TOKENS = 256  # tiles and shared memory depend on heads and dims, not on T


def flex_self_test(q, keys, values, scale) -> str | None:
    """Run flex forward and backward on random tensors of q/keys/values' heads, dims and dtype
    -> None if both ran, else why not ("forward: ..." or "backward: ...")."""
    B, nh, _, dqk = q.shape
    T, steps = min(q.shape[2], SELF_TEST_TOKENS), len(keys)
    like = dict(device=q.device, dtype=q.dtype)

    def leaf(*shape):
        return torch.randn(*shape, **like).requires_grad_()

    tq = leaf(1, nh, T, dqk)
    tk = [leaf(1, keys[0].shape[1], T, dqk) for _ in range(steps)]
    tv = [leaf(1, values[0].shape[1], T, values[0].shape[-1]) for _ in range(steps)]
    try:
        out = flex_ttt(tq, tk, tv, scale=scale)
    except Exception as err:  # noqa: BLE001 - any compile or launch failure means: not flex
        return f"forward: {_first_line(err)}"
    try:
        out.float().sum().backward()
    except Exception as err:  # noqa: BLE001
        return f"backward: {_first_line(err)}"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def flex_verdict(q, keys, values, scale, self_test=None) -> str | None:
    """Whether flex serves these shapes (None) or why not, self-tested once per (heads, dims,
    dtype, steps); a failure is logged in one line naming why and the path used instead."""
    key = (q.shape[1], keys[0].shape[1], q.shape[-1], values[0].shape[-1], q.dtype, len(keys))
    if key not in _FLEX_VERDICTS:
        with torch.enable_grad():
            why = (self_test or flex_self_test)(q, keys, values, scale)
        _FLEX_VERDICTS[key] = why
        if why is not None:
            log.warning("TTT attention: flex failed its self-test at heads %s/%s, dims %s/%s, "
                        "%s (%s); using 'chunked' (exact, linear memory, slower)", *key[:5], why)  # fmt: skip
    return _FLEX_VERDICTS[key]


@functools.lru_cache(maxsize=16)
def _plain_block_mask(seq_len: int, steps: int, device: torch.device):
    """The block mask without segments depends only on (T, k): built once per shape."""
    build = _compiled_flex()[1]
    mask_mod = ttt_mask_mod(seq_len, device=device)
    return build(mask_mod, None, None, seq_len, (steps + 1) * seq_len, device=device)


def flex_ttt(q, keys, values, *, scale, segment_ids=None, compile: bool = True):
    """flex_attention over the concatenated step keys with the ttt_mask_mod block mask.

    compile=False runs torch's unfused reference of flex (dense scores; forward only on CPU):
    for checking the mask on machines without CUDA. Inside a torch.compile'd model the plain
    functions are used, and the outer compile fuses them.
    """
    B, nh, T, _ = q.shape
    steps = len(keys) - 1
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nkv, (k+1)T, d)
    compiled = compile and not torch.compiler.is_compiling()
    attend, build = _compiled_flex() if compiled else (flex_attention, create_block_mask)
    if segment_ids is None and compiled:
        block_mask = _plain_block_mask(T, steps, q.device)
    else:
        mask_mod = ttt_mask_mod(T, segment_ids, q.device)
        batch = None if segment_ids is None else B
        block_mask = build(mask_mod, batch, None, T, (steps + 1) * T, device=q.device)
    options = {}
    if q.is_cuda:  # tiles that fit this GPU's shared memory at these head dims
        options = flex_kernel_options(
            torch.cuda.get_device_capability(q.device), q.shape[-1], v.shape[-1]
        )
    return attend(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=k.shape[1] != nh,
        kernel_options=options or None,
    )
