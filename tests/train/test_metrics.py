"""Metric sums with named fields, metrics.jsonl handling and the W&B mode choice (no key ->
offline, never a login prompt)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from eagle3.loss import simulated_acceptance
from eagle3.tracking import wandb_mode
from train.metrics import MetricsLog, MetricSums, peak_memory_gb


class TwoRanks:
    """An accelerator whose other rank summed exactly what this one did."""

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        return tensor * 2


def test_metric_sums_are_named_views_of_one_tensor_reduced_at_once():
    K = 3
    sums = MetricSums(K, torch.device("cpu"))
    m = {}
    for k in range(K):
        m.update({f"loss_{k}": 0.5 + k, f"count_{k}": 10 - k, f"correct_{k}": 4 - k})
        m[f"alpha_{k}"] = 0.6 - 0.1 * k
        m[f"masked_{k}"] = 12 - k
    for _ in range(2):  # two micro-batches
        sums.add(m, {"tokens": 30, "slots": 40})
    assert sums.flat.shape == (5 * K + 2,)  # one all-reduce for everything
    assert sums.ce.tolist() == pytest.approx([10.0, 27.0, 40.0])  # ce_k x count_k
    assert sums.alpha.tolist() == pytest.approx([12.0, 9.0, 6.4])  # alpha_k x count_k
    assert sums.count.tolist() == [20, 18, 16] and sums.masked.tolist() == [24, 22, 20]
    assert sums.correct.tolist() == [8, 6, 4]
    assert (sums.tokens.item(), sums.slots.item()) == (60, 80)

    total = sums.reduced(TwoRanks())
    assert total.tokens.item() == 120 and sums.tokens.item() == 60
    accs = [8 / 24, 6 / 22, 4 / 20]  # over every masked position, not the valid ones
    assert total.summary(0.8) == pytest.approx(
        {
            "loss": 0.5 + 0.8 * 1.5 + 0.64 * 2.5,
            **{f"loss_{k}": 0.5 + k for k in range(K)},
            **{f"acc_{k}": accs[k] for k in range(K)},
            **{f"alpha_{k}": 0.6 - 0.1 * k for k in range(K)},
            "sim_accept_len": simulated_acceptance(accs),
            "sim_accept_len_alpha": simulated_acceptance([0.6, 0.5, 0.4]),
        }
    )
    sums.zero_()
    assert not sums.flat.any() and sums.tokens.item() == 0  # the views follow the tensor


def test_peak_memory_on_the_cpu_is_the_process_rss():
    assert 0 < peak_memory_gb(torch.device("cpu")) < 1024


def test_wandb_mode_without_a_key_is_offline(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    assert wandb_mode("offline") == "offline"


def test_resume_truncates_steps_after_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"st'
    )
    log = MetricsLog(tmp_path, enabled=True, total_steps=10, start_step=3, progress=False)
    log.log(4, {"loss": 2.0, "acc_0": 0.5})
    log.close()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert MetricsLog(tmp_path, enabled=False, total_steps=1, start_step=0).run is None


def test_progress_lines_count_from_the_checkpoint_and_close_before_the_last_words(
    tmp_path, monkeypatch, capsys
):
    """Not a terminal: plain lines (every step here) with done/total, the steps before the
    checkpoint as already done, the last logged figures; the count closes before `done:`."""
    monkeypatch.setattr("eagle3.progress.EVERY_S", 0.0)
    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    log = MetricsLog(tmp_path, enabled=True, total_steps=5, start_step=3)
    for step in (4, 5):
        log.advance()
        log.log(step, {"loss": 2.0 / step, "acc_0": 0.1 * step, "tokens_per_s": 1234.0})
    log.write("done: 5 steps; SGLang draft in x/final")
    log.close()
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "train: 3/5 steps (60%, 3 already done), eta -"
    assert lines[1].startswith("train: 4/5 steps (80%, 3 already done), ")
    assert (
        lines[1].endswith("; step 4: loss 0.500, acc_0 0.40, 1,234 tok/s") and ", eta " in lines[1]
    )
    assert lines[-1].startswith("train: 5/5 steps (100%, 3 already done) in ")
    assert lines[-1].endswith("; step 5: loss 0.400, acc_0 0.50, 1,234 tok/s")
    assert captured.out == "done: 5 steps; SGLang draft in x/final\n"


class Writes:
    """A stream that is not a terminal and keeps every write apart, in one list shared with the
    other stream: a log that takes stdout and stderr as they are written (python -u, or a
    parent reading both pipes) and may interleave them at any write."""

    def __init__(self, writes: list[str]):
        self.writes = writes

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_every_message_is_one_whole_line_in_a_log(tmp_path, monkeypatch):
    """The last validation line and the count's last line never run together in a log (they
    did: `... simulated tau 1.48train: 336/336 steps (100%) in 44m00s`): each is one write,
    its newline included, so no interleaving of stdout and stderr can join two lines."""
    writes: list[str] = []
    monkeypatch.setattr(sys, "stdout", Writes(writes))
    monkeypatch.setattr(sys, "stderr", Writes(writes))
    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    log = MetricsLog(tmp_path, enabled=True, total_steps=2, start_step=0)
    for step in (1, 2):
        log.advance()
        log.log(step, {"loss": 1.0, "acc_0": 0.5, "tokens_per_s": 10.0})
    row = {"loss": 1.0, "acc_0": 0.5, "alpha_0": 0.6, "sim_accept_len": 1.48}
    log.log_eval(2, {**row, "sim_accept_len_alpha": 1.6}, improved=False)
    log.write("done: 2 steps; SGLang draft in x/final")
    log.close("produced")
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in writes), writes
    lines = "".join(writes).splitlines()
    assert lines[-4].startswith("train: 2/2 steps (100%) in ")
    assert lines[-3:] == [
        "validation at step 2: loss 1.000, acc 0.50, simulated tau 1.48, alpha 0.60 (tau 1.60 "
        "sampled)",
        "done: 2 steps; SGLang draft in x/final",
        "produced",
    ]
