"""The "flash" TTT attention path (CPU): torch's own flash-attention kernel for the causal step-0
part, one call per document, the diagonal merged by log-sum-exp (:mod:`eagle3.ttt_attention`
says why). FLASH_CPU (the kernel, None on a torch without it) and FlashTTT are what the package
calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.ttt_attention.chunked import acc_dtype, diag_grads, diag_logits, stack_diag

# torch's CPU flash-attention kernel and its backward (torch >= 2.3): the "flash" path
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)

DIAG_ROWS = 256  # rows per pass over the diagonal logits: bounds their (rows, k, d) products


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
    kd, vd = stack_diag(keys), stack_diag(values)  # (B, nkv, T, k, d)
    oc, lc = out_c.view(B, nkv, rep, T, dv), lse_c.view(B, nkv, rep, T)
    out, lse = torch.empty_like(oc), torch.empty_like(lc)
    for a in range(0, T, DIAG_ROWS):
        b = min(a + DIAG_ROWS, T)
        diag = diag_logits(qg[..., a:b, :] * scale, kd, a, b)  # (B, nkv, rep, C, k)
        lse[..., a:b] = torch.logaddexp(lc[..., a:b], diag.logsumexp(-1))
        pd = diag.sub_(lse[..., a:b, None]).exp_()
        causal = oc[..., a:b, :].to(pd.dtype) * (lc[..., a:b] - lse[..., a:b]).exp()[..., None]
        out[..., a:b, :] = causal + (pd.unsqueeze(-1) * vd[:, :, None, a:b].to(pd.dtype)).sum(-2)
    return out.view(B, nh, T, dv), lse.view(B, nh, T)


class FlashTTT(torch.autograd.Function):
    """TTT attention through torch's CPU flash-attention kernel; see the module docstring.

    apply(q, documents, scale, *keys, *values); documents as `row_documents` returns them.
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
            FLASH_CPU,
            documents,
            (qp, kp, vp),
            scale,
            lambda: (
                q.new_empty(B, nh, T, width),
                q.new_empty(B, nh, T, dtype=acc_dtype(q.dtype)),
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
            rep, acc = nh // nkv, acc_dtype(q.dtype)
            dq = dq.contiguous().view(B, nkv, rep, T, dqk)
            qg, dog = q.view(B, nkv, rep, T, dqk), dout.view(B, nkv, rep, T, dv)
            lse_g = lse.view(B, nkv, rep, T)
            D = (dout.to(acc) * out.to(acc)).sum(-1).view(B, nkv, rep, T)
            kd, vd = stack_diag(keys), stack_diag(values)  # (B, nkv, T, k, d)
            dkd, dvd = torch.empty_like(kd), torch.empty_like(vd)
            for a in range(0, T, DIAG_ROWS):
                b = min(a + DIAG_ROWS, T)
                qs = qg[..., a:b, :] * scale
                dq_diag, dkd[:, :, a:b], dvd[:, :, a:b] = diag_grads(
                    qs, kd, vd, dog[..., a:b, :], lse_g, D, a, b
                )
                dq[..., a:b, :] += dq_diag * scale
            dq = dq.view(B, nh, T, dqk)
            dkeys += list(dkd.unbind(-2))
            dvalues += list(dvd.unbind(-2))
        grads = [g.to(x.dtype) for g, x in zip(dkeys + dvalues, kv)]
        return (dq.to(q.dtype), None, None, *grads)
