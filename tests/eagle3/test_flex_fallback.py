"""Choosing flex (eagle3/ttt_attention/): a forward + backward self-test at the real shapes
before "auto" picks it, the fallback to "chunked" when either direction fails (one log line
naming why), kernel options per compute capability, and one compiled graph over many lengths.
On CPU (flex has no CPU backward in torch 2.13) flex itself is replaced by stand-ins that fail
where a GPU build would; the real kernels run in benchmarks/gpu_check.py and the gpu-marked
tests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3 import ttt_attention as ttt_module
from eagle3.ttt_attention import (
    SMALL_SMEM_FLEX_OPTIONS,
    flex_kernel_options,
    flex_self_test,
    ttt_attention,
)
from eagle3.ttt_attention.flex import compiled_flex, plain_block_mask

REPO = Path(__file__).resolve().parents[2]


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
    monkeypatch.setattr(ttt_module, "_FLEX_AGREED", set())


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
    compiled_flex.cache_clear()
    plain_block_mask.cache_clear()
    counters.clear()
    for T in (128, 200, 256, 300, 384, 448, 512, 640, 700, 1000):
        plain_block_mask(T, 2, torch.device("cpu"))
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


# -- whose fault: an out-of-memory is raised (the trainer's one line), a compile error falls back
class OutOfResources(Exception):
    """Stands in for Triton's error (not a RuntimeError: a class of the `triton` package)."""


OutOfResources.__module__ = "triton.runtime.errors"


@pytest.mark.parametrize(
    "oom",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.35 GiB"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"),
    ],
    ids=["OutOfMemoryError", "RuntimeError"],
)
def test_flex_fallback_out_of_memory_reaches_the_trainers_line(monkeypatch, auto_picks_flex, oom):
    """~4 s (imports the trainer): an out-of-memory in flex's real call (its self-test passed)
    is raised as torch.OutOfMemoryError, which the trainer's classifier takes for its one-line
    stop-and-resume; no fallback is recorded, so the next call tries flex again."""
    from train.memory_at_launch import is_out_of_memory

    calls = []

    def flex(q, keys, values, *, scale, segment_ids=None):
        calls.append(q.shape[2])
        if q.shape[2] == 300:  # the real call, not the 256-token self-test
            raise oom
        return chunked(q, keys, values, scale=scale)

    monkeypatch.setattr(ttt_module, "flex_ttt", flex)
    q, keys, values = inputs(T=300)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError) as caught:
            ttt_attention(q, keys, values, scale=0.2)
        assert is_out_of_memory(caught.value) and "out of memory" in str(caught.value)
    assert calls == [256, 300, 300]  # one self-test; flex tried again after the OOM
    assert list(ttt_module._FLEX_VERDICTS.values()) == [None]


def test_flex_fallback_errors_not_flexs_fault_are_raised(monkeypatch, auto_picks_flex):
    """<1 s: an out-of-memory in the self-test, and a TypeError (a bug, not a compile failure),
    are raised rather than answered with "chunked"."""
    q, keys, values = inputs()

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def bug(*args, **kwargs):
        raise TypeError("flex_ttt() got an unexpected keyword argument")

    for flex, error in ((oom, torch.OutOfMemoryError), (bug, TypeError)):
        monkeypatch.setattr(ttt_module, "_FLEX_VERDICTS", {})
        monkeypatch.setattr(ttt_module, "flex_ttt", flex)
        with pytest.raises(error):
            ttt_attention(q, keys, values, scale=0.2)
        assert not ttt_module._FLEX_VERDICTS


def test_flex_fallback_classifies_compile_launch_and_memory_errors():
    """<1 s: the table of whose fault an error is."""
    from torch._dynamo.exc import BackendCompilerFailed

    compile_oom = BackendCompilerFailed(print, torch.OutOfMemoryError("CUDA out of memory"), None)
    compile_error = BackendCompilerFailed(print, OutOfResources("out of resource: shared"), None)
    for err, oom, fault in [
        (torch.OutOfMemoryError("CUDA out of memory"), True, False),
        (RuntimeError("CUDA error: out of memory"), True, False),
        (compile_oom, True, False),
        (compile_error, False, True),
        (OutOfResources("out of resource: shared memory, Required: 147456"), False, True),
        (
            torch.AcceleratorError("CUDA error: too many resources requested for launch"),
            False,
            True,
        ),
        (RuntimeError("No valid triton configs. out of resource: shared memory"), False, True),
        (TypeError("bad argument"), False, False),
        (ValueError("shape mismatch"), False, False),
    ]:
        assert (ttt_module.is_out_of_memory(err), ttt_module.is_flex_fault(err)) == (oom, fault), (
            err
        )


def test_flex_fallback_first_call_failure_moves_that_shape_to_chunked(
    monkeypatch, caplog, auto_picks_flex
):
    """<1 s: a flex whose self-test passes but whose first real call fails to compile (a
    Triton error): that call and the next run "chunked" (no second attempt), one log line."""
    calls = []

    def flex(q, keys, values, *, scale, segment_ids=None):
        calls.append(q.shape[2])
        if q.shape[2] == 300:
            raise OutOfResources("out of resource: shared memory, Required: 147456")
        return chunked(q, keys, values, scale=scale)

    monkeypatch.setattr(ttt_module, "flex_ttt", flex)
    q, keys, values = inputs(T=300)
    with caplog.at_level(logging.WARNING, logger="eagle3.ttt_attention"):
        outs = [ttt_attention(q, keys, values, scale=0.2) for _ in range(2)]
    want = chunked(q, keys, values, scale=0.2)
    for out in outs:
        torch.testing.assert_close(out, want)
    assert calls == [256, 300]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "OutOfResources" in lines[0] and "'chunked'" in lines[0]


def test_flex_fallback_chunked_tiles_are_the_devices(monkeypatch):
    """<1 s: "chunked" runs tile_size(device)'s tile unless one is given: the CUDA sizes on a
    GPU (fewer kernel launches), the CPU's 128 x 512 here."""
    assert ttt_module.tile_size(torch.device("cpu")) == (
        ttt_module.CHUNK_SIZE,
        ttt_module.KEY_BLOCK,
    )
    assert ttt_module.tile_size(torch.device("cuda")) == (
        ttt_module.CUDA_CHUNK_SIZE,
        ttt_module.CUDA_KEY_BLOCK,
    )
    seen = []
    real = ttt_module.ChunkedTTT.apply

    def apply(q, segment_ids, scale, chunk_size, key_block, *kv):
        seen.append((chunk_size, key_block))
        return real(q, segment_ids, scale, chunk_size, key_block, *kv)

    monkeypatch.setattr(ttt_module.ChunkedTTT, "apply", apply)
    q, keys, values = inputs()
    monkeypatch.setattr(ttt_module, "tile_size", lambda device: (8, 16))
    ttt_attention(q, keys, values, scale=0.2, impl="chunked")
    ttt_attention(q, keys, values, scale=0.2, impl="chunked", chunk_size=4, key_block=32)
    assert seen == [(8, 16), (4, 32)]


# Two gloo ranks: "auto" picks flex; flex's compile fails on rank 1 only (case "fails") or on
# neither ("works"). A working flex returns chunked + 1, so its output is told from chunked's.
RANK = """
import json, logging, os, sys
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2)
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
from eagle3 import ttt_attention as m

class OutOfResources(Exception):
    pass
OutOfResources.__module__ = "triton.runtime.errors"
m.auto_impl = lambda device, dqk, dv: "flex"
gathers, calls = [], []
real_gather = dist.all_gather_object
def gather(*args, **kwargs):
    gathers.append(1)
    return real_gather(*args, **kwargs)
dist.all_gather_object = gather
failing = False
def flex(q, keys, values, *, scale, segment_ids=None):
    calls.append(q.shape[2])
    if failing and rank == 1:
        raise OutOfResources("out of resource: shared memory, Required: 147456, Hardware limit: 101376")
    return m.ttt_attention(q, keys, values, scale=scale, impl="chunked") + 1
m.flex_ttt = flex
result = {}
for case, nh in (("fails", 4), ("works", 2)):
    failing = case == "fails"
    gathers.clear(); calls.clear()
    torch.manual_seed(0)
    q = torch.randn(1, nh, 40, 24)
    keys = [torch.randn(1, nh, 40, 24) for _ in range(3)]
    values = [torch.randn(1, nh, 40, 16) for _ in range(3)]
    want = m.ttt_attention(q, keys, values, scale=0.2, impl="chunked")
    outs = [m.ttt_attention(q, keys, values, scale=0.2) for _ in range(3)]
    result[case] = {"chunked": [torch.equal(o, want) for o in outs],
                    "flex": [torch.equal(o, want + 1) for o in outs],
                    "gathers": len(gathers), "calls": len(calls)}
if rank == 0:  # a forward without grad on one rank alone (evaluation): decided locally
    gathers.clear()
    with torch.no_grad():
        m.ttt_attention(torch.randn(1, 6, 40, 24), [torch.randn(1, 6, 40, 24)],
                        [torch.randn(1, 6, 40, 16)], scale=0.2)
    result["alone_no_grad_gathers"] = len(gathers)
print("RESULT", json.dumps(result), flush=True)
dist.destroy_process_group()
"""


def test_flex_fallback_compile_failure_on_one_rank_moves_both(tmp_path):
    """~7 s (two gloo processes, ~3 s of imports each): a compile failure on rank 1 moves both
    ranks to "chunked" at that shape (rank 0's working flex output is dropped), with one
    all_gather at the first call and none after; rank 0 logs one line naming the error class
    and the failing rank, rank 1 none. Where flex works on both, both keep it. A forward
    without grad on rank 0 alone (evaluation) decides without a collective (else it hangs)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )  # fmt: skip
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        assert proc.returncode == 0, stderr[-3000:]
        outputs.append(stdout.splitlines())
    for lines in outputs:
        result = json.loads(next(x for x in lines if x.startswith("RESULT"))[len("RESULT") :])
        assert result["fails"]["chunked"] == [True] * 3
        assert result["works"]["flex"] == [True] * 3
        assert result["fails"]["gathers"] == result["works"]["gathers"] == 1
        assert result.get("alone_no_grad_gathers", 0) == 0
    rank0_logs = [x for x in outputs[0] if x.startswith("LOG")]
    rank1_logs = [x for x in outputs[1] if x.startswith("LOG")]
    assert len(rank0_logs) == 1 and not rank1_logs
    assert "OutOfResources" in rank0_logs[0] and "rank(s) 1 of 2" in rank0_logs[0]
    assert "all ranks use 'chunked'" in rank0_logs[0]


def test_flex_fallback_forced_kernel_options_reach_flex_on_any_device(monkeypatch):
    """<1 s: inside forced_kernel_options (gpu_check --small-smem) flex gets those options
    whatever the device (the innermost block wins, and each block restores the one outside);
    outside, a CPU gets none."""
    from eagle3.ttt_attention import flex as flex_module

    seen = []

    def attend(q, k, v, *, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return torch.zeros(q.shape[:-1] + v.shape[-1:])

    monkeypatch.setattr(flex_module, "flex_attention", attend)
    q, keys, values = inputs(T=16)

    def call():
        flex_module.flex_ttt(q, keys, values, scale=0.2, compile=False)

    with ttt_module.forced_kernel_options(SMALL_SMEM_FLEX_OPTIONS):
        call()
        with ttt_module.forced_kernel_options({"fwd_BLOCK_M": 64}):
            call()
        call()
    call()
    assert seen == [SMALL_SMEM_FLEX_OPTIONS, {"fwd_BLOCK_M": 64}, SMALL_SMEM_FLEX_OPTIONS, None]
