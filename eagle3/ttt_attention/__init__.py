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

Modules: ``reference`` ("sdpa", "split", the dense ttt_mask), ``chunked``, ``flash``, ``flex``
(the paths by name). Here: ``ttt_attention`` (which path runs) and "auto"'s choice of flex.
"""

from __future__ import annotations

import logging

import torch

from eagle3.errors import Eagle3Error
from eagle3.ttt_attention.chunked import CHUNK_SIZE, KEY_BLOCK, _ChunkedTTT, _documents
from eagle3.ttt_attention.chunked import _segment_bounds as _segment_bounds  # for the tests
from eagle3.ttt_attention.flash import _FLASH_CPU, _FlashTTT
from eagle3.ttt_attention.flex import (
    SMALL_SMEM_FLEX_OPTIONS,
    SMALL_SMEM_GPUS,
    flex_attention,
    flex_kernel_options,
    flex_ttt,
    ttt_mask_mod,
)
from eagle3.ttt_attention.flex import _compiled_flex as _compiled_flex  # tests, gpu_check.py
from eagle3.ttt_attention.flex import _plain_block_mask as _plain_block_mask  # likewise
from eagle3.ttt_attention.reference import sdpa_ttt, split_ttt, ttt_mask

IMPLS = ("auto", "chunked", "flash", "flex", "sdpa", "split")

log = logging.getLogger(__name__)
_FLEX_FAILED: list[str] = []  # "auto" stops trying flex after its first failure in a process


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


__all__ = [
    "CHUNK_SIZE",
    "IMPLS",
    "KEY_BLOCK",
    "SELF_TEST_TOKENS",
    "SMALL_SMEM_FLEX_OPTIONS",
    "SMALL_SMEM_GPUS",
    "auto_impl",
    "flex_kernel_options",
    "flex_self_test",
    "flex_ttt",
    "flex_verdict",
    "sdpa_ttt",
    "split_ttt",
    "ttt_attention",
    "ttt_mask",
    "ttt_mask_mod",
]
