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
  autograd.Function over chunks of query rows: chunk [a, b) scores only k0[:b] (causal
  skipping, about half the FLOPs of a dense T x T) plus the k diagonal keys. Matmuls run in the
  inputs' dtype; softmax, LSE and the K/V gradient sums in float32 (bf16 inputs too).
  Forward saves q, keys, values, out and the per-row log-sum-exp (B, nh, T); backward recomputes
  each chunk's probabilities from the LSE (dS = P * (dO V^T - rowsum(dO * O))). Transient
  memory is a chunk's scores, (B, nh, chunk_size, T) in two or three reused buffers: linear.
- "flex": CUDA only. torch's compiled flex_attention (Triton) with a block mask over the step
  keys concatenated along the sequence axis, KV_LEN = (k+1) T, built by the compiled
  create_block_mask from `ttt_mask_mod`: fused, and it skips the blocks the mask empties.
  flex_attention has no CPU backward (torch 2.13); on CPU its mask is checked through flex's
  unfused forward, its kernels by the gpu-marked test.
- "sdpa": one masked SDPA over a dense (T, (k+1) T) mask: quadratic memory, k T^2 wasted scores.
  The reference implementation; the old GPU path.
- "split": the causal (B, nh, T, T) scores and the k diagonal logits softmaxed jointly:
  quadratic memory. The old CPU path; kept as a second reference.
- "auto": "flex" on CUDA when flex attention imports (fused kernels, linear memory), else
  "chunked" (the only linear-memory path on CPU, and a portable fallback). If flex raises in
  the forward (a GPU or Triton build it cannot compile for: flash-attn's build, for one, fails
  on the sm_120 RTX PRO 6000), "auto" warns once and uses "chunked" for the rest of the
  process. Flex has not yet run on a GPU in this project's tests (none was lent).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error

IMPLS = ("auto", "chunked", "flex", "sdpa", "split")
# Query rows per chunk of the "chunked" path. Measured on this project's 2-core CPU (forward +
# backward of one step, fp32, best of 3): 9 heads x 64 (SmolLM2 draft), k = 3, T = 8k: 64 / 128 /
# 256 / 512 rows 3.2-3.7 / 3.1 / 3.3 / 3.5 s (equal within noise); 56 heads x 128 (Kimi layout),
# k = 6, T = 2k: 2.2 / 2.2 / 3.0 / 3.7 s (a chunk's scores spill the caches). 128 is the fastest
# for both, and its scratch is small: 9 x 128 x 32k floats = 151 MB per buffer at T = 32k.
CHUNK_SIZE = 128

log = logging.getLogger(__name__)
_FLEX_FAILED: list[str] = []  # "auto" stops trying flex after its first failure in a process

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
) -> torch.Tensor:
    """TTT attention of step k = len(keys) - 1 (the module docstring's maths) -> (B, nh, T, dv).

    q (B, nh, T, dqk); keys[j] (B, nkv, T, dqk) and values[j] (B, nkv, T, dv) of steps 0..k;
    segment_ids (B, T) int or None (one document per row).
    """
    if impl == "auto":
        impl = (
            "flex" if q.is_cuda and flex_attention is not None and not _FLEX_FAILED else "chunked"
        )
        if impl == "flex":
            try:
                return flex_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
            except Exception as err:  # noqa: BLE001 - a GPU/Triton build flex cannot compile for
                _FLEX_FAILED.append(repr(err))  # the exact linear-memory path still runs
                log.warning("flex attention failed on this GPU (%s); TTT attention falls back "
                            "to 'chunked' (exact, linear memory, slower)", err)  # fmt: skip
                impl = "chunked"
    if impl == "chunked":  # in the inputs' dtype: autocast would recast its matmuls
        with torch.autocast(q.device.type, enabled=False):
            return _ChunkedTTT.apply(q, segment_ids, scale, chunk_size, *keys, *values)
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


def _future(chunk_size: int, device: torch.device) -> torch.Tensor:
    """Bool (C, C), True where key s > query t: the masked part of a chunk's diagonal block."""
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu_(1)


# A chunk's (rep*C, b) blocks live in flat buffers allocated once per call: on CPU a fresh
# block per chunk is mmapped (glibc maps allocations over 32 MiB) and page-faulted anew, which
# measured ~25% of the chunked step (9 heads, T = 8k).
def _view(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return buf[: math.prod(shape)].view(shape)


def _matmul_into(a, b, acc_buf, low_buf):
    """a @ b in the accumulation dtype, written into acc_buf (through low_buf, in the inputs'
    dtype, when that is a half type)."""
    shape = (*a.shape[:-1], b.shape[-1])
    if low_buf is None:
        return torch.matmul(a, b, out=_view(acc_buf, shape))
    return _view(acc_buf, shape).copy_(torch.matmul(a, b, out=_view(low_buf, shape)))


def _cast_into(x, dtype, low_buf):
    """x in `dtype`: x itself, or its copy in low_buf."""
    return x if low_buf is None else _view(low_buf, x.shape).copy_(x)


def _chunk_logits(qs, k0, kd, a, b, segment_ids, future, acc_buf, low_buf):
    """Scaled logits of query rows [a, b) -> causal (B, nkv, rep, C, b) over k0[:b], masked
    with -inf (in acc_buf), and diag (B, nkv, rep, C, k) over kd[a:b]; both in the accumulation
    dtype. qs (B, nkv, rep, C, dqk): the chunk's queries times the softmax scale; kd (B, nkv, T,
    k, dqk): the keys of steps 1..k, or None when k = 0; future: _future(>= C)."""
    B, nkv, rep, C, d = qs.shape
    causal = _matmul_into(
        qs.reshape(B, nkv, rep * C, d), k0[:, :, :b].transpose(-1, -2), acc_buf, low_buf
    ).view(B, nkv, rep, C, b)  # (B, nkv, rep, C, b)
    if segment_ids is None:  # keys < a are all allowed: mask the trailing C x C block only
        causal[..., a:].masked_fill_(future[:C, :C], float("-inf"))
    else:
        rows, cols = torch.arange(a, b, device=qs.device), torch.arange(b, device=qs.device)
        allowed = (cols[None, :] <= rows[:, None]) & (
            segment_ids[:, a:b, None] == segment_ids[:, None, :b]
        )  # (B, C, b)
        causal.masked_fill_(~allowed[:, None, None], float("-inf"))
    if kd is None:
        return causal, causal.new_zeros(B, nkv, rep, C, 0)
    diag = (qs.unsqueeze(-2) * kd[:, :, None, a:b]).sum(-1)  # (B, nkv, rep, C, k)
    return causal, diag.to(causal.dtype)


def _stack_diag(xs):
    """Steps 1..k's keys or values [(B, nkv, T, d)] -> (B, nkv, T, k, d), or None when k = 0."""
    return torch.stack(xs[1:], dim=-2) if len(xs) > 1 else None


class _ChunkedTTT(torch.autograd.Function):
    """Flash-attention-style TTT attention over chunks of query rows; see the module docstring.

    apply(q, segment_ids, scale, chunk_size, *keys, *values). GQA without repeating K/V: q is
    viewed (B, nkv, rep, T, d) and a chunk's rep*C rows share one matmul with their KV head.
    """

    @staticmethod
    def forward(ctx, q, segment_ids, scale, chunk_size, *kv):
        n = len(kv) // 2
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        nkv, dv = keys[0].shape[1], values[0].shape[-1]
        rep, acc = nh // nkv, _acc_dtype(q.dtype)
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
        out = q.new_empty(B, nkv, rep, T, dv)
        lse = q.new_empty(B, nkv, rep, T, dtype=acc)
        future = _future(min(chunk_size, T), q.device)
        block = B * nh * min(chunk_size, T) * T  # a chunk's scores, at most
        acc_buf = q.new_empty(block, dtype=acc)
        low_buf = q.new_empty(block) if acc != q.dtype else None
        for a in range(0, T, chunk_size):
            b = min(a + chunk_size, T)
            C = b - a
            qs = qg[..., a:b, :] * scale  # (B, nkv, rep, C, dqk)
            causal, diag = _chunk_logits(
                qs, keys[0], kd, a, b, segment_ids, future, acc_buf, low_buf
            )
            m = causal.amax(-1)  # (B, nkv, rep, C): finite, the self key is always allowed
            if n > 1:
                m = torch.maximum(m, diag.amax(-1))
            p, pd = causal.sub_(m[..., None]).exp_(), diag.sub_(m[..., None]).exp_()
            denom = p.sum(-1) + pd.sum(-1)  # (B, nkv, rep, C)
            p = _cast_into(p.div_(denom[..., None]), q.dtype, low_buf)
            o = p.view(B, nkv, rep * C, b) @ values[0][:, :, :b]  # (B, nkv, rep*C, dv)
            o = o.view(B, nkv, rep, C, dv)
            if n > 1:
                pd = pd.div_(denom[..., None]).to(q.dtype)
                o = o + (pd.unsqueeze(-1) * vd[:, :, None, a:b]).sum(-2)  # (B, nkv, rep, C, dv)
            out[..., a:b, :] = o
            lse[..., a:b] = m + denom.log()
        out = out.view(B, nh, T, dv)
        lse = lse.view(B, nh, T)
        ctx.save_for_backward(q, segment_ids, out, lse, *kv)
        ctx.scale, ctx.chunk_size, ctx.n = scale, chunk_size, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segment_ids, out, lse, *kv = ctx.saved_tensors
        scale, chunk_size, n = ctx.scale, ctx.chunk_size, ctx.n
        keys, values = kv[:n], kv[n:]
        B, nh, T, dqk = q.shape
        nkv, dv = keys[0].shape[1], values[0].shape[-1]
        rep, acc = nh // nkv, _acc_dtype(q.dtype)
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        dog = dout.contiguous().view(B, nkv, rep, T, dv)  # (B, nkv, rep, T, dv)
        lse = lse.view(B, nkv, rep, T)
        D = (dout.to(acc) * out.to(acc)).sum(-1).view(B, nkv, rep, T)  # rowsum(dO * O)
        kd, vd = _stack_diag(keys), _stack_diag(values)  # (B, nkv, T, k, d)
        dq = torch.empty_like(qg)
        dk0 = q.new_zeros(keys[0].shape, dtype=acc)  # (B, nkv, T, dqk)
        dv0 = q.new_zeros(values[0].shape, dtype=acc)  # (B, nkv, T, dv)
        if n > 1:
            dkd = q.new_empty(kd.shape, dtype=acc)  # (B, nkv, T, k, dqk)
            dvd = q.new_empty(vd.shape, dtype=acc)  # (B, nkv, T, k, dv)
        future = _future(min(chunk_size, T), q.device)
        block = B * nh * min(chunk_size, T) * T
        p_buf, ds_buf = q.new_empty(block, dtype=acc), q.new_empty(block, dtype=acc)
        low_buf = q.new_empty(block) if acc != q.dtype else None
        kv_buf = q.new_empty(B * nkv * T * max(dqk, dv))  # a chunk's dK0 / dV0 terms
        for a in range(0, T, chunk_size):
            b = min(a + chunk_size, T)
            C = b - a
            qs = qg[..., a:b, :] * scale  # (B, nkv, rep, C, dqk)
            qs_rows = qs.reshape(B, nkv, rep * C, dqk)
            causal, diag = _chunk_logits(qs, keys[0], kd, a, b, segment_ids, future, p_buf, low_buf)
            p = causal.sub_(lse[..., a:b, None]).exp_()  # (B, nkv, rep, C, b), masked -> 0
            do = dog[..., a:b, :]  # (B, nkv, rep, C, dv)
            do_rows = do.reshape(B, nkv, rep * C, dv)
            p_rows = _cast_into(p, q.dtype, low_buf).view(B, nkv, rep * C, b)
            dv0[:, :, :b] += torch.matmul(  # sums over the rep heads
                p_rows.transpose(-1, -2), do_rows, out=_view(kv_buf, (B, nkv, b, dv))
            )
            # dS = P * (dP - D), dP = dO V^T: the gradient of the scaled logits
            ds = _matmul_into(do_rows, values[0][:, :, :b].transpose(-1, -2), ds_buf, low_buf)
            ds = ds.view(B, nkv, rep, C, b).sub_(D[..., a:b, None]).mul_(p)
            ds_rows = _cast_into(ds, q.dtype, low_buf).view(B, nkv, rep * C, b)
            dqc = (ds_rows @ keys[0][:, :, :b]).view(B, nkv, rep, C, dqk).to(acc)
            dk0[:, :, :b] += torch.matmul(
                ds_rows.transpose(-1, -2), qs_rows, out=_view(kv_buf, (B, nkv, b, dqk))
            )
            if n > 1:
                pd = diag.sub_(lse[..., a:b, None]).exp_()  # (B, nkv, rep, C, k)
                vdc, kdc = vd[:, :, None, a:b], kd[:, :, None, a:b]  # (B, nkv, 1, C, k, d)
                dsd = (do.unsqueeze(-2) * vdc).sum(-1).to(acc)  # dP of the diagonal
                dsd = dsd.sub_(D[..., a:b, None]).mul_(pd).to(q.dtype)  # (B, nkv, rep, C, k)
                dqc += (dsd.unsqueeze(-1) * kdc).sum(-2)
                dkd[:, :, a:b] = (dsd.unsqueeze(-1) * qs.unsqueeze(-2)).sum(2)  # (B, nkv, C, k, d)
                dvd[:, :, a:b] = (pd.to(q.dtype).unsqueeze(-1) * do.unsqueeze(-2)).sum(2)
            dq[..., a:b, :] = dqc * scale
        dkeys, dvalues = [dk0], [dv0]
        if n > 1:
            dkeys += list(dkd.unbind(-2))
            dvalues += list(dvd.unbind(-2))
        grads = [g.to(x.dtype) for g, x in zip(dkeys + dvalues, kv)]
        return (dq.view(B, nh, T, dqk), None, None, None, *grads)


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
    scores and an uncompiled create_block_mask the dense (T, (k+1)T) mask."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


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
    return attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != nh)
