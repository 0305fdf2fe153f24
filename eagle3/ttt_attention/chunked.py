"""The "chunked" TTT attention path: exact, linear memory, any device (:mod:`eagle3.ttt_attention`
says why): a flash-attention-style autograd.Function over tiles of (query chunk, key block), and
the helpers the "flash" path shares. Those are public because flash.py and the package use them:
acc_dtype, stack_diag, diag_logits and diag_grads (the diagonal keys' logits and gradients, one
code for both paths), row_documents (a packed row's documents); segment_bounds and ChunkedTTT are
public for the package and its tests."""

from __future__ import annotations

import math

import torch

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
# On CUDA a tile costs its kernel launches more than its arithmetic at the CPU sizes: ~15
# launches forward and ~20 backward (score matmul, mask, max, exp, sums, rescale, PV matmul),
# each ~5-10 us of host time whatever the tile's size. A row of T tokens makes ~T^2 / (2 C W)
# tiles (causal skipping), so at 128 x 512 a 64k step's forward is ~33k tiles, ~0.5M launches,
# seconds of launch overhead per TTT step. At 256 x 2048 it is ~4k tiles. A tile then scores
# nh x 256 x 2048 = 33.5M logits at the Kimi MLA draft's 64 heads (batch 1): ~21 GFLOP of
# matmuls and ~0.8 GB of fp32 elementwise traffic, ~0.2-0.5 ms on an H200 / RTX PRO 6000
# against ~0.1-0.2 ms of launches. Its buffers are constant in T: 6 B a logit forward (fp32
# scores and their bf16 copy), 10 B backward, ~0.2 / ~0.34 GB at 64 heads (1/8 of that at the
# 8 heads a rank holds under 8-way sequence parallelism). Not yet measured on a GPU.
CUDA_CHUNK_SIZE = 256
CUDA_KEY_BLOCK = 2048


def tile_size(device: torch.device) -> tuple[int, int]:
    """(query rows per chunk, step-0 keys per block) of the "chunked" path on `device`."""
    return (CUDA_CHUNK_SIZE, CUDA_KEY_BLOCK) if device.type == "cuda" else (CHUNK_SIZE, KEY_BLOCK)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
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


def row_documents(segment_ids: torch.Tensor | None) -> tuple | None:
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


def segment_bounds(segment_ids, T, chunk_size):
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
    if row_documents(seg) is None:  # an id that returns: not contiguous
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


def stack_diag(xs):
    """Steps 1..k's keys or values [(B, nkv, T, d)] -> (B, nkv, T, k, d), or None when k = 0."""
    return torch.stack(xs[1:], dim=-2) if len(xs) > 1 else None


def diag_logits(qs, kd, a, b):
    """(B, nkv, rep, C, k) logits of rows [a, b) against their own position's keys of steps 1..k
    (kd (B, nkv, T, k, dqk)), in the accumulation dtype."""
    return (qs.unsqueeze(-2) * kd[:, :, None, a:b]).sum(-1).to(acc_dtype(qs.dtype))


def diag_grads(qs, kd, vd, do, lse, D, a, b):
    """Rows [a, b)'s gradients through their diagonal logits, given the joint softmax's LSE and
    D = rowsum(dO * O) (both (B, nkv, rep, T)): qs the rows' scaled queries (B, nkv, rep, C,
    dqk), do their dO (B, nkv, rep, C, dv), kd / vd (B, nkv, T, k, d) ->
    (dq (B, nkv, rep, C, dqk), still to be multiplied by the scale; dkd (B, nkv, C, k, dqk);
    dvd (B, nkv, C, k, dv)), the last two summed over the rep query heads of their KV head."""
    pd = diag_logits(qs, kd, a, b).sub_(lse[..., a:b, None]).exp_()  # (B, nkv, rep, C, k)
    vdc, kdc = vd[:, :, None, a:b], kd[:, :, None, a:b]  # (B, nkv, 1, C, k, d)
    dsd = (do.unsqueeze(-2) * vdc).sum(-1).to(pd.dtype)  # dP of the diagonal
    dsd = dsd.sub_(D[..., a:b, None]).mul_(pd).to(qs.dtype)  # dS: the logits' gradient
    dq = (dsd.unsqueeze(-1) * kdc).sum(-2)
    dkd = (dsd.unsqueeze(-1) * qs.unsqueeze(-2)).sum(2)
    dvd = (pd.to(qs.dtype).unsqueeze(-1) * do.unsqueeze(-2)).sum(2)
    return dq, dkd, dvd


class ChunkedTTT(torch.autograd.Function):
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
        rep, acc, G = nh // nkv, acc_dtype(q.dtype), B * nkv
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        k0, v0 = keys[0].reshape(G, T, dqk), values[0].reshape(G, T, dv)
        kd, vd = stack_diag(keys), stack_diag(values)  # (B, nkv, T, k, d)
        out = q.new_empty(B, nkv, rep, T, dv)
        lse = q.new_empty(B, nkv, rep, T, dtype=acc)
        tile = G * rep * min(chunk_size, T) * min(key_block, T)  # a tile's scores, at most
        s_buf = q.new_empty(tile, dtype=acc)
        low_buf = q.new_empty(tile) if acc != q.dtype else None
        term_buf = q.new_empty(G * rep * chunk_size * dv) if low_buf is not None else None
        los, clean = segment_bounds(segment_ids, T, chunk_size)
        for i, a in enumerate(range(0, T, chunk_size)):
            b = min(a + chunk_size, T)
            C, R = b - a, rep * (b - a)
            qs = (qg[..., a:b, :] * scale).contiguous()  # (B, nkv, rep, C, dqk)
            qr = qs.view(G, R, dqk)
            # The running max starts at the self logit (always allowed, so finite): a row whose
            # keys in some block are all masked then never meets exp(-inf - -inf).
            m = (qs * keys[0][:, :, None, a:b]).sum(-1).to(acc)  # (B, nkv, rep, C)
            if n > 1:  # the diagonal keys open the online softmax
                diag = diag_logits(qs, kd, a, b)  # (B, nkv, rep, C, k)
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
        rep, acc, G = nh // nkv, acc_dtype(q.dtype), B * nkv
        qg = q.view(B, nkv, rep, T, dqk)  # (B, nkv, rep, T, dqk)
        dog = dout.contiguous().view(B, nkv, rep, T, dv)  # (B, nkv, rep, T, dv)
        lse = lse.view(B, nkv, rep, T)
        D = (dout.to(acc) * out.to(acc)).sum(-1).view(B, nkv, rep, T)  # rowsum(dO * O)
        k0, v0 = keys[0].reshape(G, T, dqk), values[0].reshape(G, T, dv)
        kd, vd = stack_diag(keys), stack_diag(values)  # (B, nkv, T, k, d)
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
                dq_diag, dkd[:, :, a:b], dvd[:, :, a:b] = diag_grads(qs, kd, vd, do, lse, D, a, b)
                dqc += dq_diag
            dq[..., a:b, :] = dqc * scale
        dkeys = [dk0.view(keys[0].shape)]
        dvalues = [dv0.view(values[0].shape)]
        if n > 1:
            dkeys += list(dkd.unbind(-2))
            dvalues += list(dvd.unbind(-2))
        grads = [g.to(x.dtype) for g, x in zip(dkeys + dvalues, kv)]
        return (dq.view(B, nh, T, dqk), None, None, None, None, *grads)
