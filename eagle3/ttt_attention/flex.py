"""The "flex" TTT attention path (CUDA): torch's compiled flex_attention with a block mask over
the step keys, and the kernel options that fit small-shared-memory GPUs. Choosing it ("auto"'s
self-test) is :mod:`eagle3.ttt_attention`'s. compiled_flex and plain_block_mask are public for
the GPU check (benchmarks/gpu_check.py), which counts their compiles."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

try:  # flex attention: torch >= 2.5; never a reason for this module to fail to import
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - old torch
    create_block_mask = flex_attention = None


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
def compiled_flex():
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


_FORCED_OPTIONS: list[dict] = []  # forced_kernel_options' stack: the innermost wins


@contextlib.contextmanager
def forced_kernel_options(options: dict) -> Iterator[None]:
    """flex runs with these kernel_options on any GPU inside the block, whatever its compute
    capability: benchmarks/gpu_check.py --small-smem compiles sm_120's tiles on a lent H200
    (and times other tile choices) this way. Each options set compiles its own kernels."""
    _FORCED_OPTIONS.append(dict(options))
    try:
        yield
    finally:
        _FORCED_OPTIONS.pop()


def kernel_options_for(device: torch.device, dqk: int, dv: int) -> dict:
    """The kernel_options flex runs with on `device` at these head dims: the forced ones if
    any, else flex_kernel_options for the GPU's compute capability ({} off CUDA)."""
    if _FORCED_OPTIONS:
        return dict(_FORCED_OPTIONS[-1])
    if device.type != "cuda":
        return {}
    return flex_kernel_options(torch.cuda.get_device_capability(device), dqk, dv)


@functools.lru_cache(maxsize=16)
def plain_block_mask(seq_len: int, steps: int, device: torch.device):
    """The block mask without segments depends only on (T, k): built once per shape."""
    build = compiled_flex()[1]
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
    attend, build = compiled_flex() if compiled else (flex_attention, create_block_mask)
    if segment_ids is None and compiled:
        block_mask = plain_block_mask(T, steps, q.device)
    else:
        mask_mod = ttt_mask_mod(T, segment_ids, q.device)
        batch = None if segment_ids is None else B
        block_mask = build(mask_mod, batch, None, T, (steps + 1) * T, device=q.device)
    options = kernel_options_for(q.device, q.shape[-1], v.shape[-1])  # tiles that fit the GPU
    return attend(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=k.shape[1] != nh,
        kernel_options=options or None,
    )
