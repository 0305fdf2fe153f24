"""The recipe end to end, as a real CLI on a tiny random Llama target (CPU, W&B disabled)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def test_offline_and_online_reach_the_same_loss_trajectory(
    tmp_path, helpers, tiny_llama_dir, shard_dir, online_run
):
    """One offline CLI run beside the session's online run (31 s measured at load 7
    on 2 cores): the two data paths train the same trajectory, share one draft vocab, and the
    export and metrics carry every field. The only test of offline/online equivalence."""
    off, on = tmp_path / "offline", online_run
    proc = helpers.run_cli(helpers.common_args(tiny_llama_dir, off, **helpers.offline(shard_dir)))
    # the console names the saved config instead of printing it; DeepSpeed, imported by
    # accelerate at the export, warns nothing on this GPU-less process
    assert f"resolved config -> {off / 'config.yaml'}" in proc.stdout
    assert (
        "\noptim:\n" not in proc.stdout and "Setting accelerator" not in proc.stdout + proc.stderr
    )
    off_loss, on_loss = helpers.losses(off), helpers.losses(on)
    assert len(off_loss) == len(on_loss) == 6
    assert off_loss[-1] < off_loss[0]  # it learns
    # fp16 shards vs fp32 hidden states computed in the loop: equal up to rounding
    assert on_loss == pytest.approx(off_loss, rel=2e-3)
    # same draft vocab from the same data, saved with the run and in the SGLang export
    vocab_off = load_file(str(off / "draft_vocab.safetensors"))["d2t"]
    assert vocab_off.equal(load_file(str(on / "draft_vocab.safetensors"))["d2t"])
    assert vocab_off.equal(load_file(str(off / "final" / "model.safetensors"))["d2t"])
    config = json.loads((off / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 200
    # every logged field is there, padding stays low with length grouping
    record = json.loads((off / "metrics.jsonl").read_text().splitlines()[-1])
    for key in [
        "loss_0",
        "acc_6",
        "sim_accept_len",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "peak_mem_gb",
    ]:
        assert key in record
    assert record["padding_frac"] < 0.10
    assert (off / "config.yaml").is_file()


def test_two_processes_and_accumulation_equal_one_big_batch(
    tmp_path, helpers, tiny_llama_dir, shard_dir
):
    """One process with batch 4, one with batch 2 x 2 accumulated and 2 torchrun processes with
    batch 2 each train the same steps (loss, grad norm, acc_0, lr to rel 1e-5) and export the same
    weights: what keeps data parallelism or gradient accumulation from changing a step unnoticed.
    Trained with an LK loss (train.loss=lk-lambda, whose KL share is exactly today's objective
    and whose per-position weight depends on the position alone): every objective of
    eagle3/losses/ is summed over valid positions and divided by the step's all-reduced counts
    the same way. Costs ~25 s (its call: three trainer runs; measured on 2 xdist workers)."""
    # fp32 exports: the final weights compared below are the trained ones, not their bf16
    # roundings (float noise of the gradient sums can flip a bf16 rounding either way)
    data = {**helpers.offline(shard_dir), "train.export_dtype": "fp32", "train.loss": "lk-lambda"}
    one, accum, two = tmp_path / "one", tmp_path / "accum", tmp_path / "two"
    helpers.run_cli(helpers.common_args(tiny_llama_dir, one, **data, **{"data.batch_size": 4}))
    helpers.run_cli(
        helpers.common_args(
            tiny_llama_dir, accum, **data, **{"data.batch_size": 2, "optim.grad_accum": 2}
        )
    )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
    ]
    helpers.run_cli(
        helpers.common_args(tiny_llama_dir, two, **data, **{"data.batch_size": 2}),
        launcher=torchrun,
    )
    for key in ("loss", "grad_norm", "acc_0", "alpha_0", "lr"):
        assert helpers.losses(accum, key) == pytest.approx(helpers.losses(one, key), rel=1e-5)
        assert helpers.losses(two, key) == pytest.approx(helpers.losses(one, key), rel=1e-5)
    final = [load_file(str(d / "final" / "model.safetensors")) for d in (one, two)]
    for name, tensor in final[0].items():
        assert tensor.float().allclose(final[1][name].float(), atol=1e-5), name


def test_eagle2_style_ablation_trains_on_the_last_hidden_state(
    tmp_path, helpers, tiny_llama_dir, shard_dir, records_file
):
    """model.feature=last: fc reads the final hidden state (H wide), offline == online. The only run
    of model.feature=last through the trainer CLI. Costs ~10 s (its call: an offline and an online
    run; measured on 2 xdist workers)."""
    ablation = {"model.feature": "last", "model.ttt_steps": 1}
    off, on = tmp_path / "offline", tmp_path / "online"
    helpers.run_cli(
        helpers.common_args(tiny_llama_dir, off, **helpers.offline(shard_dir), **ablation)
    )
    helpers.run_cli(
        helpers.common_args(tiny_llama_dir, on, **helpers.online(records_file), **ablation)
    )
    off_loss, on_loss = helpers.losses(off), helpers.losses(on)
    assert off_loss[-1] < off_loss[0]
    assert on_loss == pytest.approx(off_loss, rel=2e-3)
    config = json.loads((off / "final" / "config.json").read_text())
    assert config["feature"] == "last"
    assert config["eagle_config"]["use_aux_hidden_state"] is False
    fc = load_file(str(off / "final" / "model.safetensors"))["fc.weight"]
    assert fc.shape[1] == config["target_hidden_size"]  # H, not 3H
    record = json.loads((off / "metrics.jsonl").read_text().splitlines()[-1])
    assert "loss_0" in record and "loss_1" not in record  # ttt_steps 1


def test_validation_counts_every_masked_position_and_keeps_the_best(
    tmp_path, helpers, tiny_llama_dir, shard_dir
):
    """Held-out conversations are validated every eval_every steps and at the end; val acc_k
    counts every loss-masked position (a target token outside the draft vocab is a miss),
    recomputed here from the exported draft; best/ holds the step with the best simulated tau.
    Costs ~4 s (its call: one trainer
    run, then the final validation pass recomputed here; measured on 2 xdist workers)."""
    from eagle3.checkpoint import load_draft
    from eagle3.loss import simulated_acceptance, target_probs
    from eagle3.targets import load_embeddings, load_lm_head
    from train.datasets import load_shards, split_validation

    out = tmp_path / "run"
    args = helpers.common_args(
        tiny_llama_dir,
        out,
        **helpers.offline(shard_dir),
        **{"data.val_fraction": 0.3, "train.eval_every": 2, "train.export_dtype": "fp32"},
        **{"model.draft_vocab_size": 120},  # many target tokens outside the draft vocab
    )
    helpers.run_cli(args)
    val = helpers.metric_lines(out, "val")
    assert [r["step"] for r in val] == [2, 4, 6]
    best = json.loads((out / "best" / "best.json").read_text())
    taus = {r["step"]: r["val/sim_accept_len"] for r in val}
    assert (
        best["step"] == max(taus, key=taus.get) and best["val_sim_accept_len"] == taus[best["step"]]
    )
    assert (out / "best" / "model.safetensors").is_file()

    # recompute the final pass: acc_k = hits / every loss-masked position of step k
    parts, _ = load_shards([str(shard_dir)])
    _, held = split_validation(parts, 0.3, seed=0)
    draft = load_draft(out / "final", embed_weight=load_embeddings(str(tiny_llama_dir)))
    lm_head = load_lm_head(str(tiny_llama_dir))
    K = 7  # common_args' recipe
    hits, masked, in_vocab_positions = [0] * K, [0] * K, [0] * K
    for i in range(len(held[0])):
        r = held[0][i]
        ids, mask = r["input_ids"][None], r["loss_mask"][None]
        probs, in_vocab = target_probs(r["last_hidden"][None].float(), lm_head, draft.t2d)
        with torch.no_grad():
            steps = draft.ttt_forward(ids, r["aux_hidden"][None].float(), K)
        for k, logits in enumerate(steps):
            n = max(ids.shape[1] - k - 2, 0)
            m = mask[:, k + 2 : k + 2 + n].bool()
            hit = logits[:, :n].argmax(-1) == probs[:, k + 1 : k + 1 + n].argmax(-1)
            hits[k] += int((hit & in_vocab[:, k + 1 : k + 1 + n] & m).sum())
            masked[k] += int(m.sum())
            in_vocab_positions[k] += int((m & in_vocab[:, k + 1 : k + 1 + n]).sum())
    assert in_vocab_positions[0] < masked[0]  # the case the denominator is about
    accs = [hits[k] / masked[k] for k in range(K)]
    last = val[-1]
    assert [last[f"val/acc_{k}"] for k in range(K)] == pytest.approx(accs, abs=1e-6)
    assert last["val/sim_accept_len"] == pytest.approx(simulated_acceptance(accs), abs=1e-6)
