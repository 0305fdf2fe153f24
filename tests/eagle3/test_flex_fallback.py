"""Choosing flex (eagle3/ttt_attention/): a forward + backward self-test at the real shapes
before "auto" picks it, the fallback to "chunked" when either direction fails (one log line
naming why), kernel options per compute capability, and one compiled graph over many lengths.
On CPU (flex has no CPU backward in torch 2.13) flex itself is replaced by stand-ins that fail
where a GPU build would; the real kernels run in benchmarks/gpu_check.py and the gpu-marked
tests.
"""

from __future__ import annotations

import logging

import pytest
import torch

from eagle3 import ttt_attention as ttt_module
from eagle3.ttt_attention import (
    SMALL_SMEM_FLEX_OPTIONS,
    flex_kernel_options,
    flex_self_test,
    ttt_attention,
)


def inputs(T=40, nh=4, nkv=4, dqk=24, dv=16, steps=2):
    q = torch.randn(1, nh, T, dqk, requires_grad=True)
    keys = [torch.randn(1, nkv, T, dqk, requires_grad=True) for _ in range(steps + 1)]
    values = [torch.randn(1, nkv, T, dv, requires_grad=True) for _ in range(steps + 1)]
    return q, keys, values


def chunked(q, keys, values, *, scale, segment_ids=None):
    return ttt_attention(q, keys, values, scale=scale, impl="chunked", segment_ids=segment_ids)


class _FailsInBackward(torch.autograd.Function):
    """A flex whose forward compiles and runs but whose backward does not fit the GPU."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("No valid triton configs. OutOfResources: out of resource: shared "
                           "memory, Required: 114688, Hardware limit: 101376")  # fmt: skip


def flex_failing_in_forward(q, keys, values, *, scale, segment_ids=None):
    raise RuntimeError("out of resource: shared memory, Required: 147456, Hardware limit: 101376")


def flex_failing_in_backward(q, keys, values, *, scale, segment_ids=None):
    return _FailsInBackward.apply(chunked(q, keys, values, scale=scale))


@pytest.fixture
def auto_picks_flex(monkeypatch):
    """ "auto" as on a CUDA device: flex first, verdicts of this test only."""
    monkeypatch.setattr(ttt_module, "auto_impl", lambda device, dqk, dv: "flex")
    monkeypatch.setattr(ttt_module, "_FLEX_VERDICTS", {})
    monkeypatch.setattr(ttt_module, "_FLEX_FAILED", [])


@pytest.mark.parametrize(
    "flex, direction",
    [(flex_failing_in_forward, "forward"), (flex_failing_in_backward, "backward")],
    ids=["forward", "backward"],
)
def test_flex_fallback_to_chunked_when_the_self_test_fails(
    monkeypatch, caplog, auto_picks_flex, flex, direction
):
    """<1 s: a flex that fails in the forward, or only in the backward, is caught by the
    self-test before any training step; "auto" runs "chunked" (same numbers, gradients too)
    and logs one line naming the direction and the error, once per shape."""
    monkeypatch.setattr(ttt_module, "flex_ttt", flex)
    q, keys, values = inputs()
    with caplog.at_level(logging.WARNING, logger="eagle3.ttt_attention"):
        out = ttt_attention(q, keys, values, scale=0.2)
        ttt_attention(q, keys, values, scale=0.2)  # the same shape: no second self-test
    want = chunked(q, keys, values, scale=0.2)
    torch.testing.assert_close(out, want)
    out.sum().backward()  # the chosen path's backward runs
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f"({direction}: RuntimeError" in lines[0] and "using 'chunked'" in lines[0]


def test_flex_fallback_not_taken_when_the_self_test_passes(monkeypatch, auto_picks_flex):
    """<1 s: a flex that runs both ways is chosen (its output is what auto returns)."""
    calls = []

    def working_flex(q, keys, values, *, scale, segment_ids=None):
        calls.append(q.shape)
        return chunked(q, keys, values, scale=scale)

    monkeypatch.setattr(ttt_module, "flex_ttt", working_flex)
    q, keys, values = inputs(T=300)
    assert flex_self_test(q, keys, values, 0.2) is None
    ttt_attention(q, keys, values, scale=0.2)
    # the self-test at the real heads and dims, capped at SELF_TEST_TOKENS; then the real call
    assert calls[-2:] == [torch.Size([1, 4, 256, 24]), torch.Size([1, 4, 300, 24])]


def test_flex_fallback_kernel_options_fit_small_shared_memory():
    """<1 s: sm_120 (and sm_86/89) at MLA's head dims get single-stage 32-row tiles; where
    torch's own tiles fit (H100/H200, or head dims <= 128) torch chooses."""
    assert flex_kernel_options((12, 0), 192, 128) == SMALL_SMEM_FLEX_OPTIONS
    assert flex_kernel_options((8, 9), 256, 256) == SMALL_SMEM_FLEX_OPTIONS
    assert flex_kernel_options((12, 0), 128, 128) == {}
    assert flex_kernel_options((9, 0), 192, 128) == {}
    options = SMALL_SMEM_FLEX_OPTIONS
    # forward tiles in bf16 at dqk 256 (192 padded), dv 128, one stage: under 101,376 B
    fwd = 2 * (options["fwd_BLOCK_M"] * 256 + options["fwd_BLOCK_N"] * (256 + 128))
    assert fwd * options["fwd_num_stages"] < 101_376


def test_flex_fallback_block_mask_compiles_once_over_varying_lengths():
    """~25 s: the compiled block-mask builder over 10 sequence lengths compiles at most 2
    graphs (dynamic shapes), well under torch's recompile limit of 8 past which flex would run
    unfused with the whole score matrix."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ttt_module._compiled_flex.cache_clear()
    ttt_module._plain_block_mask.cache_clear()
    counters.clear()
    for T in (128, 200, 256, 300, 384, 448, 512, 640, 700, 1000):
        ttt_module._plain_block_mask(T, 2, torch.device("cpu"))
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
