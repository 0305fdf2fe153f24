"""eagle3/ttt_attention/: every TTT attention kernel against one dense reference, forward and
backward, with GQA, MLA-like head dims, packed rows and bf16; the chunked and flash paths'
memory is linear."""

import warnings

import pytest
import torch

from eagle3 import ttt_attention as ttt_module
from eagle3.errors import Eagle3Error
from eagle3.model import Eagle3Draft
from eagle3.ttt_attention import (
    KEY_BLOCK,
    auto_impl,
    flex_ttt,
    ttt_attention,
    ttt_mask,
    ttt_mask_mod,
)
from eagle3.ttt_attention.chunked import row_documents, segment_bounds

# A packed row of 3 documents (lengths 7, 12, 9) and 9 padding positions under an id of their own
PACKED = torch.tensor([0] * 7 + [1] * 12 + [2] * 9 + [-1] * 9)  # T = 37


def inputs(B=2, nh=4, nkv=2, T=37, dqk=24, dv=16, steps=3, dtype=torch.float32):
    """q, keys, values of TTT step `steps`, as leaves that require grad."""
    q = torch.randn(B, nh, T, dqk, dtype=dtype)
    keys = [torch.randn(B, nkv, T, dqk, dtype=dtype) for _ in range(steps + 1)]
    values = [torch.randn(B, nkv, T, dv, dtype=dtype) for _ in range(steps + 1)]
    return [x.requires_grad_() for x in (q, *keys, *values)]


def dense_reference(q, keys, values, scale, segment_ids=None):
    """The module docstring's maths in float64: A(t) as a (query t, step j, key s) mask."""
    B, nh, T, _ = q.shape
    n, rep = len(keys), nh // keys[0].shape[1]
    seg = torch.zeros(B, T, dtype=torch.long) if segment_ids is None else segment_ids
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = torch.zeros(B, T, n, T, dtype=torch.bool)  # (b, query t, step j, key s)
    allowed[:, :, 0] = (s <= t) & (seg[:, :, None] == seg[:, None, :])
    allowed[:, :, 1:] = (s == t)[None, :, None]
    k = torch.stack(keys, 2).double().repeat_interleave(rep, 1)  # (B, nh, n, T, dqk)
    v = torch.stack(values, 2).double().repeat_interleave(rep, 1)  # (B, nh, n, T, dv)
    logits = torch.einsum("bhtd,bhjsd->bhtjs", q.double(), k) * scale  # (B, nh, T, n, T)
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    probs = logits.flatten(-2).softmax(-1).view_as(logits)
    return torch.einsum("bhtjs,bhjsd->bhtd", probs, v)  # (B, nh, T, dv)


def outputs_and_grads(fn, leaves, grad_out):
    """fn's output and the gradients of <output, grad_out> w.r.t. q, every key, every value."""
    out = fn()
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def assert_close(got, want, rtol):
    """Each pair agrees to rtol relative to its largest entry (1 where all are tiny: a T = 1,
    k = 0 row has dq = 0 exactly)."""
    for g, w in zip(got, want):
        err = (g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1.0)
        assert err < rtol, f"relative error {err:.2e} > {rtol:.0e}"


def check_against_reference(
    impl, leaves, steps, scale, segment_ids=None, chunk_size=16, rtol=1e-5, key_block=KEY_BLOCK
):
    q, keys, values = leaves[0], leaves[1 : steps + 2], leaves[steps + 2 :]
    B, nh, T, _ = q.shape
    grad_out = torch.randn(B, nh, T, values[0].shape[-1], dtype=torch.float64)
    want = outputs_and_grads(
        lambda: dense_reference(q, keys, values, scale, segment_ids), leaves, grad_out
    )
    got = outputs_and_grads(
        lambda: ttt_attention(
            q,
            keys,
            values,
            scale=scale,
            impl=impl,
            segment_ids=segment_ids,
            chunk_size=chunk_size,
            key_block=key_block,
        ),
        leaves,
        grad_out,
    )
    assert got[0].dtype == q.dtype and all(g.dtype == x.dtype for g, x in zip(got[1:], leaves))
    assert_close(got, want, rtol)


# (nh, nkv, dqk, dv): GQA with MLA-like head dims (qk wider than v), plain MHA, and values wider
# than queries (the flash path pads whichever is narrower)
LAYOUTS = {
    "gqa-dqk24-dv16": (4, 2, 24, 16),
    "mha-d16": (4, 4, 16, 16),
    "gqa-dqk16-dv24": (4, 2, 16, 24),
}
LINEAR = ["chunked", "flash"]  # the exact linear-memory kernels that run on CPU


@pytest.mark.parametrize("T", [1, 5, 16, 37])  # chunk_size 16: T < chunk, == chunk, not a multiple
@pytest.mark.parametrize("steps", [0, 1, 2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", LINEAR)
def test_linear_kernels_match_dense_reference_outputs_and_gradients(impl, T, steps, layout):
    nh, nkv, dqk, dv = LAYOUTS[layout]
    leaves = inputs(nh=nh, nkv=nkv, T=T, dqk=dqk, dv=dv, steps=steps)
    check_against_reference(impl, leaves, steps, scale=dqk**-0.5)


# (chunk_size, key_block): several key blocks per chunk, with chunk and block edges that do not
# line up with each other or with T = 37 (and a block narrower than a chunk)
TILES = [(16, 5), (7, 5), (5, 16), (8, 8), (37, 7)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"c{t[0]}-kb{t[1]}")
@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_key_blocks_match_dense_reference(tile, steps, layout):
    nh, nkv, dqk, dv = LAYOUTS[layout]
    leaves = inputs(nh=nh, nkv=nkv, dqk=dqk, dv=dv, steps=steps)
    check_against_reference(
        "chunked", leaves, steps, dqk**-0.5, chunk_size=tile[0], key_block=tile[1]
    )


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"c{t[0]}-kb{t[1]}")
@pytest.mark.parametrize("steps", [0, 2])
def test_packing_key_blocks_and_document_skipping_match_reference(tile, steps):
    segment_ids = torch.stack([PACKED, PACKED.flip(0)])  # the second row: padding first
    check_against_reference(
        "chunked",
        inputs(steps=steps),
        steps,
        0.2,
        segment_ids,
        chunk_size=tile[0],
        key_block=tile[1],
    )


def test_packing_segment_bounds_skip_only_other_documents():
    """Chunks of 8 over documents [0, 7), [7, 19), [19, 28) and padding [28, 37)."""
    lo, clean = segment_bounds(PACKED[None], 37, 8)
    # chunk [a, b) may see keys from the start of row a's document: [0, 8) -> 0, [8, 16) -> 7, ...
    assert lo == [0, 7, 7, 19, 28]
    # ... and from the start of row b-1's document on, rows and keys share one document
    assert clean == [7, 7, 19, 28, 28]
    # two rows: the earliest start and the latest one over the batch
    lo, clean = segment_bounds(torch.stack([PACKED, torch.zeros(37, dtype=torch.long)]), 37, 8)
    assert lo == [0, 0, 0, 0, 0] and clean == [7, 7, 19, 28, 28]
    # an id that comes back (not a packed row): nothing skipped, every block masked
    assert segment_bounds(torch.tensor([[0, 0, 1, 1, 0, 0]]), 6, 4) == ([0, 0], [7, 7])


@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("impl", LINEAR)
def test_packing_non_contiguous_segments_stay_exact(impl, steps):
    segment_ids = torch.randint(0, 3, (2, 37))  # ids returning within a row: no skipping
    check_against_reference(
        impl, inputs(steps=steps), steps, 0.2, segment_ids, chunk_size=8, key_block=5
    )


def test_packing_documents_are_the_runs_of_one_id():
    assert row_documents(None) == ()
    assert row_documents(PACKED[None]) == (((0, 7), (7, 19), (19, 28), (28, 37)),)
    two = row_documents(torch.stack([PACKED, PACKED.flip(0)]))
    assert two[1] == ((0, 9), (9, 18), (18, 30), (30, 37))
    assert row_documents(torch.tensor([[0, 0, 1, 1, 0, 0]])) is None  # an id that returns


@pytest.mark.parametrize("impl", ["sdpa", "split"])
@pytest.mark.parametrize("steps", [0, 3])
def test_dense_references_match_the_dense_reference(impl, steps):
    check_against_reference(impl, inputs(steps=steps), steps, scale=0.2)


@pytest.mark.parametrize("impl", ["chunked", "flash", "sdpa", "split"])
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("chunk_size", [5, 16, 64])
def test_packing_segments_match_the_segment_causal_reference(impl, steps, chunk_size):
    segment_ids = torch.stack([PACKED, PACKED.flip(0)])  # the second row: padding first
    check_against_reference(
        impl, inputs(steps=steps), steps, 0.2, segment_ids=segment_ids, chunk_size=chunk_size
    )


def test_packing_segments_give_each_document_its_own_attention():
    """A packed row's outputs are those of each document run alone (padding included)."""
    steps = 2
    q, *kv = inputs(B=1, steps=steps)
    keys, values = kv[: steps + 1], kv[steps + 1 :]
    with torch.no_grad():
        packed = ttt_attention(q, keys, values, scale=0.2, segment_ids=PACKED[None], chunk_size=8)
        for doc in PACKED.unique():
            at = (PACKED == doc).nonzero().squeeze(-1)
            alone = ttt_attention(
                q[:, :, at],
                [k[:, :, at] for k in keys],
                [v[:, :, at] for v in values],
                scale=0.2,
                chunk_size=8,
            )
            assert torch.allclose(packed[:, :, at], alone, atol=1e-6)


def test_packing_segments_through_ttt_forward_agree_across_impls(tiny_config):
    model = Eagle3Draft(tiny_config())
    ids, aux = torch.randint(0, 50, (2, 37)), torch.randn(2, 37, 96)
    segment_ids = torch.stack([PACKED, PACKED.flip(0)])
    results = {}
    for impl in ("chunked", "flash", "sdpa", "split"):
        model.zero_grad()
        model.midlayer.self_attn.ttt_impl = impl
        logits = model.ttt_forward(ids, aux, 3, segment_ids=segment_ids)
        sum(x.square().mean() for x in logits).backward()
        results[impl] = [*logits, model.midlayer.self_attn.k_proj.weight.grad.clone()]
    for impl in ("chunked", "flash", "split"):
        assert_close(results[impl], results["sdpa"], 1e-5)
    # one segment per row is no segments at all
    with torch.no_grad():
        plain = model.ttt_forward(ids, aux, 3)
        one = model.ttt_forward(ids, aux, 3, segment_ids=torch.zeros(2, 37, dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(plain, one))


@pytest.mark.parametrize("segments", [False, True], ids=["plain", "packing"])
@pytest.mark.parametrize("impl", LINEAR)
def test_linear_kernels_bf16_match_fp32_reference_at_bf16_tolerance(impl, segments):
    steps = 3
    leaves = inputs(steps=steps, dtype=torch.bfloat16)
    check_against_reference(
        impl,
        leaves,
        steps,
        scale=24**-0.5,
        segment_ids=torch.stack([PACKED, PACKED]) if segments else None,
        rtol=3e-2,
    )


@pytest.mark.parametrize("impl", LINEAR)
def test_linear_kernels_gradcheck_float64(impl):
    leaves = inputs(B=1, nh=2, nkv=1, T=6, dqk=3, dv=2, steps=2, dtype=torch.float64)
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])

    def fn(q, *kv):
        return ttt_attention(
            q, kv[:3], kv[3:], scale=0.7, impl=impl, segment_ids=segment_ids, chunk_size=4
        )

    assert torch.autograd.gradcheck(fn, leaves)


def saved_bytes(impl: str, T: int) -> int:
    """Bytes the autograd graph of one TTT step (k = 3, small-draft heads) keeps for backward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    q, *kv = inputs(B=1, nh=9, nkv=3, T=T, dqk=64, dv=64, steps=3)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_attention(q, kv[:4], kv[4:], scale=0.125, impl=impl)
    return total


@pytest.mark.parametrize("impl", LINEAR)
def test_linear_kernels_saved_memory_is_linear_in_sequence_length(impl):
    ratio = saved_bytes(impl, 2048) / saved_bytes(impl, 512)
    assert 3.9 < ratio < 4.1  # 4x the tokens, 4x the memory
    # the measure can tell: split keeps the (T, T) scores (ratio 16, less its linear part)
    assert saved_bytes("split", 1024) / saved_bytes("split", 256) > 8


def test_flex_mask_mod_is_the_dense_mask():
    T, steps = 37, 3
    segment_ids = torch.stack([PACKED, PACKED.flip(0)])
    q_idx, kv_idx = torch.arange(T)[:, None], torch.arange((steps + 1) * T)[None, :]
    for seg in (None, segment_ids):
        mask_mod = ttt_mask_mod(T, seg)
        for b in range(2):
            got = mask_mod(torch.tensor(b), torch.tensor(0), q_idx, kv_idx)
            want = ttt_mask(T, steps, torch.device("cpu"), seg)[0 if seg is None else b]
            assert torch.equal(got, want)


def test_flex_unfused_reference_forward_on_cpu_matches_chunked():
    """flex's own unfused forward (the only flex that runs on CPU) with our block mask."""
    steps = 2
    q, *kv = [x.detach() for x in inputs(steps=steps, dqk=16)]  # flex refuses CPU leaves
    keys, values = kv[: steps + 1], kv[steps + 1 :]
    segment_ids = torch.stack([PACKED, PACKED.flip(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile"
        for seg in (None, segment_ids):
            got = flex_ttt(q, keys, values, scale=0.25, segment_ids=seg, compile=False)
            want = ttt_attention(q, keys, values, scale=0.25, impl="chunked", segment_ids=seg)
            assert torch.allclose(got, want, atol=1e-5)


def test_unknown_impl_and_flex_on_cpu_are_one_line_errors():
    q, *kv = inputs(steps=0)
    with pytest.raises(Eagle3Error, match="not one of"):
        ttt_attention(q, kv[:1], kv[1:], scale=0.2, impl="flash_attn")
    if not torch.cuda.is_available():
        with pytest.raises(Eagle3Error, match="needs a CUDA device"):
            ttt_attention(q, kv[:1], kv[1:], scale=0.2, impl="flex")


def test_auto_runs_flash_on_cpu_and_chunked_for_mla_or_where_torch_lacks_the_kernel(monkeypatch):
    cpu = torch.device("cpu")
    assert auto_impl(cpu, 64, 64) == "flash"  # torch 2.13 has the kernel
    assert auto_impl(cpu, 192, 128) == "chunked"  # MLA: padded values cost more than it gains
    q, *kv = inputs(steps=2, dqk=16, dv=16)
    flash = ttt_attention(q, kv[:3], kv[3:], scale=0.2, impl="flash")
    monkeypatch.setattr(ttt_module, "FLASH_CPU", None)  # an older torch
    assert auto_impl(cpu, 64, 64) == "chunked"
    chunked = ttt_attention(q, kv[:3], kv[3:], scale=0.2)
    assert_close([chunked], [flash], 1e-5)
    with pytest.raises(Eagle3Error, match="torch's CPU flash-attention kernel"):
        ttt_attention(q, kv[:3], kv[3:], scale=0.2, impl="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "packing"])
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("dims", [(64, 64), (192, 128)], ids=["d64", "mla"])
def test_flex_matches_chunked_on_cuda(dtype, segments, steps, dims):
    T = 300  # not a multiple of flex's 128-row blocks
    packed = torch.cat([torch.zeros(100), torch.ones(150), torch.full((50,), -1)]).long()
    segment_ids = torch.stack([packed, packed.flip(0)]).cuda() if segments else None
    leaves = [
        x.detach().cuda().requires_grad_()
        for x in inputs(nh=8, nkv=2, T=T, dqk=dims[0], dv=dims[1], steps=steps, dtype=dtype)
    ]
    q, keys, values = leaves[0], leaves[1 : steps + 2], leaves[steps + 2 :]
    grad_out = torch.randn(2, 8, T, dims[1], device="cuda", dtype=dtype)
    scale = dims[0] ** -0.5
    got, want = (
        outputs_and_grads(
            lambda impl=impl: ttt_attention(
                q, keys, values, scale=scale, impl=impl, segment_ids=segment_ids
            ),
            leaves,
            grad_out,
        )
        for impl in ("flex", "chunked")
    )
    assert got[0].dtype == dtype
    assert_close(got, want, 2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "packing"])
@pytest.mark.parametrize("steps", [0, 3])
def test_flex_with_sm120_tiles_matches_chunked_on_any_cuda(segments, steps):
    """sm_120's small single-stage tiles (forced on whatever GPU runs this: what
    benchmarks/gpu_check.py --small-smem does) compile and match "chunked" at MLA's head dims
    in bf16, forward and backward."""
    from eagle3.ttt_attention import SMALL_SMEM_FLEX_OPTIONS, forced_kernel_options

    T, (dqk, dv) = 300, (192, 128)
    packed = torch.cat([torch.zeros(100), torch.ones(150), torch.full((50,), -1)]).long()
    segment_ids = torch.stack([packed, packed.flip(0)]).cuda() if segments else None
    leaves = [
        x.detach().cuda().requires_grad_()
        for x in inputs(nh=8, nkv=8, T=T, dqk=dqk, dv=dv, steps=steps, dtype=torch.bfloat16)
    ]
    q, keys, values = leaves[0], leaves[1 : steps + 2], leaves[steps + 2 :]
    grad_out = torch.randn(2, 8, T, dv, device="cuda", dtype=torch.bfloat16)
    with forced_kernel_options(SMALL_SMEM_FLEX_OPTIONS):
        got, want = (
            outputs_and_grads(
                lambda impl=impl: ttt_attention(
                    q, keys, values, scale=dqk**-0.5, impl=impl, segment_ids=segment_ids
                ),
                leaves,
                grad_out,
            )
            for impl in ("flex", "chunked")
        )
    assert_close(got, want, 2e-2)
