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
  does not is caught before training), or raises in its first real call at that shape, "auto"
  uses "chunked" at that shape. Only flex's own faults fall back (compile and launch errors:
  is_flex_fault); an out-of-memory is raised as torch.OutOfMemoryError, so the trainer stops in
  its one line and resumes, instead of one rank quietly running a slower kernel. Under
  torch.distributed the ranks agree at each shape's first training call (one all_gather of
  the verdicts, never again: the comment above auto_flex says why that is enough): if flex
  failed on any rank, every rank runs "chunked", and rank 0 logs one line naming the error.
  flex_kernel_options gives the small-shared-memory GPUs (sm_86/89/120: 101,376 B a block)
  single-stage 32-row tiles at MLA's head dims (forced_kernel_options overrides them: the GPU
  check compiles sm_120's tiles on another GPU). "chunked" runs larger tiles on CUDA than on
  CPU (tile_size: chunked.py says why). Flex has not yet run on a GPU in this project's tests
  (none was lent).

Modules: ``reference`` ("sdpa", "split", the dense ttt_mask), ``chunked``, ``flash``, ``flex``
(the paths by name). Here: ``ttt_attention`` (which path runs) and "auto"'s choice of flex.
"""

from __future__ import annotations

import logging

import torch

from eagle3.errors import Eagle3Error
from eagle3.ttt_attention.chunked import (
    CHUNK_SIZE,
    CUDA_CHUNK_SIZE,
    CUDA_KEY_BLOCK,
    KEY_BLOCK,
    ChunkedTTT,
    row_documents,
    tile_size,
)
from eagle3.ttt_attention.flash import FLASH_CPU, FlashTTT
from eagle3.ttt_attention.flex import (
    SMALL_SMEM_FLEX_OPTIONS,
    SMALL_SMEM_GPUS,
    flex_attention,
    flex_kernel_options,
    flex_ttt,
    forced_kernel_options,
    kernel_options_for,
    ttt_mask_mod,
)
from eagle3.ttt_attention.reference import sdpa_ttt, split_ttt, ttt_mask

IMPLS = ("auto", "chunked", "flash", "flex", "sdpa", "split")

log = logging.getLogger(__name__)


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    scale: float,
    impl: str = "auto",
    segment_ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    key_block: int | None = None,
) -> torch.Tensor:
    """TTT attention of step k = len(keys) - 1 (the module docstring's maths) -> (B, nh, T, dv).

    q (B, nh, T, dqk); keys[j] (B, nkv, T, dqk) and values[j] (B, nkv, T, dv) of steps 0..k;
    segment_ids (B, T) int or None (one document per row). chunk_size / key_block: the
    "chunked" tile (default: tile_size(q.device), CPU and CUDA sizes differ).
    """
    if impl == "auto":
        impl = auto_impl(q.device, q.shape[-1], values[0].shape[-1])
        if impl == "flex":
            out = auto_flex(q, keys, values, scale, segment_ids)
            if out is not None:
                return out
            impl = "chunked"  # flex failed at these shapes, on this rank or another (logged)
    if impl == "flash":
        if q.is_cuda or FLASH_CPU is None:
            raise Eagle3Error(
                "ttt_impl 'flash' is torch's CPU flash-attention kernel (torch >= 2.3, CPU "
                "tensors); use 'auto' (flex on CUDA) or 'chunked'"
            )
        documents = row_documents(segment_ids)
        if documents is not None and q.shape[2] > 0:  # else "chunked" masks exactly
            with torch.autocast(q.device.type, enabled=False):
                return FlashTTT.apply(q, documents, scale, *keys, *values)
        impl = "chunked"
    if impl == "chunked":  # in the inputs' dtype: autocast would recast its matmuls
        rows, block = tile_size(q.device)
        chunk_size, key_block = chunk_size or rows, key_block or block
        with torch.autocast(q.device.type, enabled=False):
            return ChunkedTTT.apply(q, segment_ids, scale, chunk_size, key_block, *keys, *values)
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
    """What impl "auto" tries first on `device` for query/key head dim dqk and value head dim dv
    (the module docstring says why); on CUDA "flex" then falls back per shape (auto_flex)."""
    if device.type == "cuda":
        return "flex" if flex_attention is not None else "chunked"
    flash = device.type == "cpu" and FLASH_CPU is not None and dqk == dv
    return "flash" if flash else "chunked"


# -- whose fault an error is: flex's (fall back) or not (raise) -------------------------------
def is_out_of_memory(err: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) anywhere in the
    error's chain, or a RuntimeError saying "out of memory" (a CUDA launch's "CUDA error: out
    of memory", or an OOM that inductor wrapped while compiling)."""
    for e in _chain(err):
        if isinstance(e, torch.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True
    return False


def is_flex_fault(err: BaseException) -> bool:
    """A compile or launch failure of flex's kernels, which "chunked" avoids: a RuntimeError
    (dynamo's and inductor's errors, BackendCompilerFailed and InductorError among them, are
    RuntimeErrors, as are CUDA launch errors, torch.AcceleratorError) or one of Triton's own
    (OutOfResources, CompilationError: classes of the `triton` package), other than an
    out-of-memory. Anything else (a TypeError, a ValueError: our bug or bad input) is not."""
    if is_out_of_memory(err):
        return False
    return any(
        isinstance(e, RuntimeError) or type(e).__module__.split(".")[0] == "triton"
        for e in _chain(err)
    )


def raise_unless_flex_fault(err: Exception) -> None:
    """Re-raise `err` unless it is flex's fault; an out-of-memory as torch.OutOfMemoryError,
    the class the trainer's one-line stop-and-resume (train/train_drafter.py) recognises."""
    if is_out_of_memory(err):
        if isinstance(err, torch.OutOfMemoryError):
            raise err
        raise torch.OutOfMemoryError(_first_line(err)) from err
    if not is_flex_fault(err):
        raise err


def _chain(err: BaseException) -> list[BaseException]:
    """err and the errors it was raised from (or while handling), each once."""
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__ or getattr(err, "inner_exception", None)
    return seen


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


# -- choosing flex: a self-test and a first call per shape, agreed across ranks ----------------
# Why once per shape is enough. flex fails where its kernels do not compile or launch for a
# GPU (shared memory, a Triton or inductor bug at some head dims or dtype). Those depend on
# the shape key below, not on the sequence length: dynamic=True compiles one graph for every
# length, and kernel options are fixed per head dims. So the first call at a key (its self-test
# and the real call) is where flex fails if it ever does, and every rank makes that call in
# the same training forward: the TTT unroll runs steps 0..K-1 (one key each) in the same order
# on every rank, and a training forward runs in lockstep (each ends in the gradient
# all-reduce). One collective per key and run (K of them in the first step, none after) then
# suffices; one per call would cost a collective per TTT step. Forwards without grad
# (validation, evaluation) may run on some ranks only, so they decide alone and never call a
# collective; the first training call at the key agrees. A failure after the agreement (a rare
# recompile) falls back on that rank alone, with a warning saying so.
_FLEX_VERDICTS: dict[tuple, str | None] = {}  # shape key -> None (flex works) or why not
_FLEX_AGREED: set[tuple] = set()  # keys whose verdict every rank shares
SELF_TEST_TOKENS = 256  # tiles and shared memory depend on heads and dims, not on T


def flex_shape_key(q, keys, values) -> tuple:
    """What flex's kernels depend on: heads, KV heads, q/k and v head dims, dtype, TTT step."""
    return (q.shape[1], keys[0].shape[1], q.shape[-1], values[0].shape[-1], q.dtype, len(keys))


def auto_flex(q, keys, values, scale, segment_ids=None) -> torch.Tensor | None:
    """ "auto" on CUDA: flex's output, or None where "chunked" runs instead because flex
    failed at these shapes (its self-test or a call), on this rank or, once agreed, on any.
    An out-of-memory, or an error that is not flex's fault, is raised (raise_unless_flex_fault).
    """
    key = flex_shape_key(q, keys, values)
    agree = torch.is_grad_enabled() and key not in _FLEX_AGREED and _world_size() > 1
    if key not in _FLEX_VERDICTS:
        flex_verdict(q, keys, values, scale, log_failure=not agree)
    why, out = _FLEX_VERDICTS[key], None
    if why is None:
        try:
            out = flex_ttt(q, keys, values, scale=scale, segment_ids=segment_ids)
        except Exception as err:  # noqa: BLE001 - only flex's own faults fall back
            raise_unless_flex_fault(err)
            why = f"forward at {q.shape[2]} tokens: {_first_line(err)}"
            if not agree:
                log.warning("TTT attention: flex failed%s (%s); this rank uses 'chunked' at "
                            "heads %s/%s, dims %s/%s, %s from now on (exact, linear memory, "
                            "slower)", " after the ranks agreed on it" if key in _FLEX_AGREED
                            else "", why, *key[:5])  # fmt: skip
    if agree:
        why = _agree(key, why)
        _FLEX_AGREED.add(key)
    _FLEX_VERDICTS[key] = why
    return out if why is None else None


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _agree(key: tuple, why: str | None) -> str | None:
    """Every rank's verdict at `key` (one all_gather_object): None if flex served all of
    them, else the failures, which rank 0 logs in one line."""
    dist = torch.distributed
    whys: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(whys, why)
    failed = {rank: w for rank, w in enumerate(whys) if w is not None}
    if not failed:
        return None
    first = min(failed)
    if dist.get_rank() == 0:
        log.warning("TTT attention: flex failed on rank(s) %s of %s at heads %s/%s, dims %s/%s, "
                    "%s (rank %s: %s); all ranks use 'chunked' (exact, linear memory, slower)",
                    ",".join(map(str, failed)), len(whys), *key[:5], first, failed[first])  # fmt: skip
    return why or f"rank {first}: {failed[first]}"


def flex_self_test(q, keys, values, scale) -> str | None:
    """Run flex forward and backward on random tensors of q/keys/values' heads, dims and dtype
    -> None if both ran, else why not ("forward: ..." or "backward: ..."). An out-of-memory or
    an error that is not flex's fault is raised."""
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
    except Exception as err:  # noqa: BLE001 - a compile or launch failure means: not flex
        raise_unless_flex_fault(err)
        return f"forward: {_first_line(err)}"
    try:
        out.float().sum().backward()
    except Exception as err:  # noqa: BLE001
        raise_unless_flex_fault(err)
        return f"backward: {_first_line(err)}"
    return None


def flex_verdict(q, keys, values, scale, self_test=None, log_failure: bool = True) -> str | None:
    """Whether flex serves these shapes (None) or why not, self-tested once per shape key on
    this rank (flex_shape_key); a failure is logged in one line naming why and the path used
    instead (unless the ranks are about to agree: then rank 0 logs theirs)."""
    key = flex_shape_key(q, keys, values)
    if key not in _FLEX_VERDICTS:
        with torch.enable_grad():
            why = (self_test or flex_self_test)(q, keys, values, scale)
        _FLEX_VERDICTS[key] = why
        if why is not None and log_failure:
            log.warning("TTT attention: flex failed its self-test at heads %s/%s, dims %s/%s, "
                        "%s (%s); using 'chunked' (exact, linear memory, slower)", *key[:5], why)  # fmt: skip
    return _FLEX_VERDICTS[key]


__all__ = [
    "CHUNK_SIZE",
    "CUDA_CHUNK_SIZE",
    "CUDA_KEY_BLOCK",
    "IMPLS",
    "KEY_BLOCK",
    "SELF_TEST_TOKENS",
    "SMALL_SMEM_FLEX_OPTIONS",
    "SMALL_SMEM_GPUS",
    "auto_flex",
    "auto_impl",
    "flex_kernel_options",
    "flex_self_test",
    "flex_shape_key",
    "flex_ttt",
    "flex_verdict",
    "forced_kernel_options",
    "is_flex_fault",
    "is_out_of_memory",
    "kernel_options_for",
    "raise_unless_flex_fault",
    "sdpa_ttt",
    "split_ttt",
    "tile_size",
    "ttt_attention",
    "ttt_mask",
    "ttt_mask_mod",
]
