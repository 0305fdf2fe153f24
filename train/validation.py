"""Validation of a run: every held-out set (the run's own, data.val_sets, replay's) scored
every train.eval_every steps and at the end, logged as val/* metrics, and best/ exported when
the selection score (train/selection.py) beats the best so far."""

from __future__ import annotations

import torch

from train.batching import read_micro_batch, val_batches
from train.metrics import MetricSums
from train.run import Run
from train.selection import selection_tau


@torch.no_grad()
def validate(run: Run, dataset, lengths: list[int], split: str = "val") -> dict[str, float]:
    """TTT loss, acc_k (over every loss-masked position) and simulated tau on one held-out
    set; every rank takes part. `split` keys its soft labels in the label cache."""
    accelerator, w = run.accelerator, run.cfg.model.step_weight
    sums = MetricSums(run.unroll.depth, accelerator.device)
    run.model.eval()
    for indices, counts in val_batches(
        lengths, run.cfg.data.batch_size, run.layout.data_size, run.layout.data_rank
    ):
        batch = read_micro_batch(dataset, indices)
        batch["index"] = torch.tensor(indices)
        mb = run.micro_batch(batch, split)  # unpacked
        run.unroll.prepare(mb)  # p-eagle: every position at every depth, the chain's tau
        _, m = run.unroll.loss(run.model, mb, w, None)
        if counts:
            sums.add(m, mb)
    run.model.train()
    total = sums.reduced(accelerator)
    return {"tokens": total.tokens.item(), **run.unroll.summary(total, w)}


def validation_sets(run: Run) -> dict[str, tuple]:
    """The held-out sets by name: the run's own ("heldout"), then data.val_sets and replay's."""
    own = (
        {}
        if run.data.val_dataset is None
        else {"heldout": (run.data.val_dataset, run.data.val_lengths)}
    )
    return {**own, **run.data.val_sets}


def validation_step(run: Run, step: int) -> None:
    """Validate every held-out set and log val/* metrics (the run's own set as val/loss,
    val/acc_k, val/sim_accept_len; another as val/<name>/...; with several, val/select_tau);
    export best/ when the selection score (train/selection.py) beats the best so far."""
    results = {
        name: validate(run, dataset, lengths, "val" if name == "heldout" else f"val:{name}")
        for name, (dataset, lengths) in validation_sets(run).items()
    }
    metrics = dict(results.get("heldout", {}))
    for name, result in results.items():
        if name != "heldout":
            metrics.update({f"{name}/{key}": value for key, value in result.items()})
    taus = {name: result["sim_accept_len"] for name, result in results.items()}
    score = selection_tau(taus)
    if len(taus) > 1:
        metrics["select_tau"] = score
    improved = run.checkpoints.improves(score)
    run.logger.log_eval(step, metrics, improved=improved)
    if improved:
        run.checkpoints.save_best(step, score, taus if len(taus) > 1 else None)
    run.accelerator.wait_for_everyone()
