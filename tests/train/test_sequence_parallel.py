"""Sequence parallelism (train/sequence_parallel.py, eagle3/ttt_attention/sequence_parallel.py):
a record split over 2 gloo ranks trains the same loss and every parameter gradient as one
process on the whole record, for the GQA and MLA drafts, packed and not; the group layout
of data x sequence parallelism; the shards' halo and padding."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.engine.server import free_port
from eagle3.errors import Eagle3Error
from train.sequence_parallel import (
    check_heads,
    data_layout,
    shard_batch,
    shard_bounds,
    sp_groups,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "train" / "sequence_parallel_worker.py"
CASES = [
    "gqa",
    "gqa-packed",
    "gqa-chunked-1kv-packed",
    "mla",
    "mla-packed",
    "mla-flash-packed",
    "mla-eagle3.1-packed",
    "gqa-recompute",
    "mla-recompute-packed",
]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    """~6 s: two gloo processes run every case of the worker once (each ~2 s of imports)."""
    out = tmp_path_factory.mktemp("sp") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    errors = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        if proc.returncode:
            errors.append(stderr[-3000:])
    assert not errors, "\n".join(errors)
    return json.loads(out.read_text())


def test_sequence_parallel_slice_reads_train_what_whole_rows_train(two_rank_results):
    """(In the 2-rank run above, <1 s of it.) Packed rows of a capture trained on 2 gloo ranks,
    each rank reading its shard of the whole rows (shard_batch) and then its own positions
    alone (train/sequence_slices.py, what training reads): equal shards, and equal loss and
    gradients, bit for bit."""
    got = two_rank_results["slices"]
    assert got["shards_equal"] and got["grads"]
    assert got["queries"] == max(got["rows"]) // 2 + max(got["rows"]) % 2
    assert got["loss_alone"] == got["loss_whole"]
    assert got["grad_max_abs_diff"] == 0.0


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_two_ranks_equal_one_process(two_rank_results, case):
    """The loss, the valid-position counts and every trainable parameter's gradient of a 2-rank
    sequence-parallel step equal one process's on the whole batch (fp32; measured <= 4e-7
    relative to the largest gradient entry). Cases: flash (GQA) and chunked (MLA) kernels by
    "auto", a GQA draft with 1 KV head (repeated to the query heads before the all-to-all),
    MLA through flash, an EAGLE-3.1 MLA draft, each TTT step recomputed in backward
    (train.recompute_ttt_steps: GQA, and MLA packed), packed rows of 3 and 2 records, and a right-padded unpacked row; 45
    tokens, so the shards are padded."""
    got = two_rank_results[case]
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5)
    assert got["counts"] == got["ref_counts"]
    assert not got["grads_missing"]
    worst = max(got["grad_rel"], key=got["grad_rel"].get)
    assert got["grad_rel"][worst] < 1e-5, (worst, got["grad_rel"][worst])


def test_sequence_parallel_groups_and_data_ranks():
    """dp x sp layout as a pure function: consecutive ranks form a group; data ranks count
    groups; a size that does not divide the world is one line."""
    assert sp_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    layout = data_layout(rank=6, world=8, sp=4)
    assert (layout.data_rank, layout.data_size, layout.sp_rank) == (1, 2, 2)
    assert layout.group_ranks == (4, 5, 6, 7)
    assert [data_layout(r, 4, 2).data_rank for r in range(4)] == [0, 0, 1, 1]
    assert data_layout(3, 4, 1).data_rank == 3  # sp 1: plain data parallelism
    with pytest.raises(Eagle3Error, match="must divide the 6 processes"):
        sp_groups(6, 4)
    check_heads(64, 8)  # Kimi's MLA draft on 8 GPUs; its GQA draft's 56 query heads too
    check_heads(56, 8)
    with pytest.raises(Eagle3Error, match="splits the draft's 56 attention heads"):
        check_heads(56, 16)


def test_sequence_parallel_config_is_offline_only_and_positive(tmp_path):
    """<1 s: train.sequence_parallel is checked with the rest of the config, in one line."""
    from eagle3.errors import ConfigError
    from train.config import load_config

    records = tmp_path / "r.jsonl"
    records.write_text("")
    online = ["data.mode=online", f"data.records=[{records}]", "train.sequence_parallel=2"]
    with pytest.raises(ConfigError, match="train.sequence_parallel splits captured records"):
        load_config(None, online)
    with pytest.raises(ConfigError, match="train.sequence_parallel must be >= 1"):
        load_config(None, ["data.shard_dirs=[x]", "train.sequence_parallel=0"], False)
    assert load_config(None, ["data.shard_dirs=[x]"], False).train.sequence_parallel == 1


def test_sequence_parallel_shards_carry_the_halo_and_pad_the_last():
    """Shards: [a, b) of the positions and aux states, [a, b + steps + 1) of what the TTT shift
    and the loss read, global positions, -1 segments on padding, the whole row's segments."""
    assert shard_bounds(45, 2, 0) == (0, 23, 46) and shard_bounds(45, 2, 1) == (23, 46, 46)
    B, T, steps = 2, 45, 3
    batch = {
        "input_ids": torch.arange(T)[None].expand(B, T) + 100,
        "aux_hidden": torch.randn(B, T, 6),
        "loss_mask": torch.ones(B, T, dtype=torch.long),
        "segment_ids": torch.zeros(B, T, dtype=torch.long),
        "in_vocab": torch.ones(B, T, dtype=torch.bool),
        "index": torch.tensor([7, 9]),
    }
    first, last = (shard_batch(batch, r, 2, steps) for r in range(2))
    assert first["queries"] == last["queries"] == 23
    assert first["aux_hidden"].shape == (B, 23, 6)
    assert first["input_ids"][0].tolist() == list(range(100, 100 + 23 + steps + 1))
    assert first["position_ids"][0].tolist() == list(range(23))
    assert last["position_ids"][0, :-1].tolist() == list(range(23, 45))  # then padding
    assert last["input_ids"].shape == (B, 23)  # nothing past the padded row
    assert last["loss_mask"][0, -1] == 0 and last["segment_ids"][0, -1] == -1
    assert not last["in_vocab"][0, -1]
    assert last["sp_segment_ids"].shape == (B, 46)
    assert last["index"].tolist() == [7, 9]


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["records", "packed"])
def test_sequence_parallel_training_equals_one_process(
    tmp_path, helpers, tiny_llama_dir, shard_dir, packed
):
    """~40 s a case: the recipe under torchrun with train.sequence_parallel=2 (2 gloo ranks, one
    data group) logs the losses, gradient norms and accuracies of one process with the same
    batch and exports the same weights (validation too: both ranks share each held-out record)."""
    data = {**helpers.offline(shard_dir), "train.export_dtype": "fp32", "data.batch_size": 2}
    data.update({"data.val_fraction": 0.2, "train.eval_every": 3})
    if packed:
        data.update({"data.packing": "true", "data.pack_length": 100})
    one, two = tmp_path / "one", tmp_path / "two"
    helpers.run_cli(helpers.common_args(tiny_llama_dir, one, **data))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]  # fmt: skip
    helpers.run_cli(
        helpers.common_args(tiny_llama_dir, two, **data, **{"train.sequence_parallel": 2}),
        launcher=torchrun,
    )
    for key in ("loss", "grad_norm", "acc_0", "acc_6"):  # padding_frac: sp pads to a multiple
        assert helpers.losses(two, key) == pytest.approx(helpers.losses(one, key), rel=1e-5), key
    val = [helpers.metric_lines(d, "val") for d in (one, two)]
    assert [r["val/loss"] for r in val[1]] == pytest.approx([r["val/loss"] for r in val[0]])
    final = [load_file(str(d / "final" / "model.safetensors")) for d in (one, two)]
    for name, tensor in final[0].items():
        assert tensor.float().allclose(final[1][name].float(), atol=1e-5), name


def test_sequence_parallel_long_kimi_recipe_plan_fits_8x96():
    """~6 s: `--plan --gpus 8 --gpu-memory-gib 95` for the 65,536-token Kimi recipe says it fits
    (flex and chunked); a rank holds half of each row with each TTT step recomputed, so its
    activations are a 32k recipe's; without sequence parallelism the same row is refused,
    naming the group size that fits."""
    from train.config import load_config
    from train.memory_at_launch import read_launch_config, recipe_plan
    from train.memory_plan import GIB, Node, check_fits

    long = REPO / "configs/train/kimi-k2.5-offline-long.yaml"
    proc = subprocess.run(
        [sys.executable, "train/train_drafter.py", "--config", str(long), "--plan", "--gpus", "8",
         "--gpu-memory-gib", "95"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fits" in proc.stdout and "SP all-to-all" in proc.stdout

    ds = read_launch_config(REPO / "configs/accelerate/8gpu-zero2.yaml")
    node = Node(8, 95 * GIB)
    cfg = load_config(long, check_paths=False)
    assert cfg.train.sequence_parallel == 2 and cfg.data.max_length == 65536
    assert recipe_plan(cfg, node, ds, "chunked").fits
    whole = recipe_plan(load_config(long, ["train.sequence_parallel=1"], False), node, ds, "flex")
    with pytest.raises(Eagle3Error, match=r"or train.sequence_parallel=2 \(each record split"):
        check_fits(whole, online=False)  # the refusal names the group size that fits
    short = recipe_plan(
        load_config(long, ["train.sequence_parallel=1", "data.max_length=32768"], False),
        node, ds, "flex",
    )  # fmt: skip
    assert recipe_plan(cfg, node, ds, "flex").parts["activations"] == pytest.approx(
        short.parts["activations"]
    )


@pytest.fixture(scope="module")
def one_process_batch_2(tmp_path_factory, helpers, tiny_llama_dir, shard_dir) -> Path:
    """One plain process, two records a step, nothing held out, fp32 export (~10 s): what the
    data-parallel-groups run and the ZeRO-2 run below must both equal, trained once."""
    data = {**helpers.offline(shard_dir), "train.export_dtype": "fp32"}
    data.update({"data.val_fraction": 0, "data.batch_size": 2})
    one = tmp_path_factory.mktemp("sp_reference") / "one"
    helpers.run_cli(helpers.common_args(tiny_llama_dir, one, **data))
    return one


@pytest.mark.slow
def test_sequence_parallel_with_data_parallel_groups_equals_one_process(
    tmp_path, helpers, tiny_llama_dir, shard_dir, one_process_batch_2
):
    """~50 s: 4 gloo ranks as 2 data-parallel groups of 2 sequence-parallel ranks, a record per
    group, log the losses and gradient norms of one process with both records in its batch,
    and export the same weights."""
    data = {**helpers.offline(shard_dir), "train.export_dtype": "fp32", "data.val_fraction": 0}
    one, four = one_process_batch_2, tmp_path / "four"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                "--master_port", str(free_port())]  # fmt: skip
    sp = {"data.batch_size": 1, "train.sequence_parallel": 2}
    helpers.run_cli(helpers.common_args(tiny_llama_dir, four, **data, **sp), launcher=torchrun)
    for key in ("loss", "grad_norm", "acc_0", "acc_6"):
        assert helpers.losses(four, key) == pytest.approx(helpers.losses(one, key), rel=1e-5), key
    final = [load_file(str(d / "final" / "model.safetensors")) for d in (one, four)]
    for name, tensor in final[0].items():
        assert tensor.float().allclose(final[1][name].float(), atol=1e-5), name


@pytest.mark.slow
def test_sequence_parallel_under_deepspeed_zero2_equals_one_process(
    tmp_path, monkeypatch, helpers, tiny_llama_dir, shard_dir, one_process_batch_2
):
    """~150 s (DeepSpeed's imports): the Kimi recipes' launch (8gpu-zero2.yaml: DeepSpeed
    ZeRO-2, here 2 CPU processes on gloo) with train.sequence_parallel=2 logs the losses and
    gradient norms of one plain process: DeepSpeed's gradient mean over the world sums the
    group's partial gradients as DDP's does."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed (pip install -e '.[dev]')")
    data = {**helpers.offline(shard_dir), "train.export_dtype": "fp32", "data.val_fraction": 0}
    data["data.batch_size"] = 2
    one, two = one_process_batch_2, tmp_path / "zero2"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "configs/accelerate/8gpu-zero2.yaml"), "--num_processes", "2",
              "--main_process_port", str(free_port())]  # fmt: skip
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (helpers.env)
    args = helpers.common_args(tiny_llama_dir, two, **data, **{"train.sequence_parallel": 2})
    proc = helpers.run_cli(args, launcher=launch)
    assert "(DEEPSPEED, DeepSpeedEngine, 1 groups of 2 sequence-parallel ranks)" in proc.stdout
    for key in ("loss", "grad_norm", "acc_0", "acc_6"):
        assert helpers.losses(two, key) == pytest.approx(helpers.losses(one, key), rel=1e-5), key
