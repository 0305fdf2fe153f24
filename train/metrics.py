"""Training metrics: what is summed (`MetricSums`) and where it goes (`MetricsLog`:
metrics.jsonl always, W&B never with a login prompt, progress as every stage shows it:
eagle3.progress, a bar on a terminal, a line every 30 s in a log).

Only the main process builds an enabled `MetricsLog`; the other ranks get a no-op one, so
nothing is printed or written N times.
"""

from __future__ import annotations

import json
import logging
import resource
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3.loss import simulated_acceptance
from eagle3.progress import Progress
from eagle3.tracking import wandb_mode

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)


class MetricSums:
    """Running sums of micro-batches (the training steps since the last log line, or one
    validation pass), per TTT step k: `ce` (loss_k x count_k: the objective, train.loss),
    `alpha` (alpha_k x count_k: the acceptance probability sum min(p, q)), `correct`, `count`
    (valid positions: the loss) and `masked` (every loss-masked position: the accuracy); then
    `tokens` and `slots` (padding). One float64 tensor underneath, so one all-reduce sums them
    over ranks; the fields are named views into it."""

    ROWS = 5  # ce, alpha, correct, count, masked

    def __init__(self, ttt_steps: int, device: torch.device, flat: torch.Tensor | None = None):
        K = self.ttt_steps = ttt_steps
        R = self.ROWS
        if flat is None:
            flat = torch.zeros(R * K + 2, dtype=torch.float64, device=device)
        self.flat = flat
        self.ce, self.alpha, self.correct, self.count, self.masked = flat[: R * K].view(R, K)
        self.tokens, self.slots = flat[R * K], flat[R * K + 1]  # 0-d views: += writes into flat

    def add(self, m: dict, mb: dict) -> None:
        """One micro-batch: `m` from eagle3.loss.ttt_loss, `mb` the labelled micro-batch."""
        for k in range(self.ttt_steps):
            self.ce[k] += m[f"loss_{k}"] * m[f"count_{k}"]
            self.alpha[k] += m[f"alpha_{k}"] * m[f"count_{k}"]
            self.correct[k] += m[f"correct_{k}"]
            self.count[k] += m[f"count_{k}"]
            self.masked[k] += m[f"masked_{k}"]
        self.tokens += mb["tokens"]
        self.slots += mb["slots"]

    def zero_(self) -> None:
        self.flat.zero_()

    def reduced(self, accelerator: Accelerator) -> MetricSums:
        """The sums over every rank (every rank must call it)."""
        flat = accelerator.reduce(self.flat, reduction="sum")
        return MetricSums(self.ttt_steps, flat.device, flat)

    def summary(self, step_weight: float) -> dict[str, float]:
        """loss (weighted over the steps), loss_k, acc_k and the simulated acceptance length
        (greedy: step k right with probability acc_k); alpha_k, the mean acceptance
        probability sum min(p, q) over step k's valid positions (what the LK losses optimise;
        speculative sampling accepts step k's token with it), and sim_accept_len_alpha, the
        chain length those would give."""
        K, w, R = self.ttt_steps, step_weight, self.ROWS
        ce, alpha, correct, count, masked = self.flat[: R * K].view(R, K).tolist()  # one copy
        losses = [ce[k] / max(count[k], 1) for k in range(K)]
        alphas = [alpha[k] / max(count[k], 1) for k in range(K)]
        accs = [correct[k] / max(masked[k], 1) for k in range(K)]
        return {
            "loss": sum(w**k * losses[k] for k in range(K)),
            **{f"loss_{k}": losses[k] for k in range(K)},
            **{f"acc_{k}": accs[k] for k in range(K)},
            **{f"alpha_{k}": alphas[k] for k in range(K)},
            "sim_accept_len": simulated_acceptance(accs),
            "sim_accept_len_alpha": simulated_acceptance(alphas),
        }


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated on `device`, or on the CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


class MetricsLog:
    def __init__(
        self,
        out_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        wandb_cfg: Any = None,
        config: dict[str, Any] | None = None,
        provenance: dict[str, Any] | None = None,
        progress: bool = True,
    ):
        self.enabled = enabled
        self.run = None
        self.progress: Progress | None = None
        if not enabled:
            return
        self.path = Path(out_dir) / "metrics.jsonl"
        # a resumed run rewrites what came after its checkpoint
        _truncate_after(self.path, start_step)
        if wandb_cfg is not None and wandb_mode(wandb_cfg.mode) != "disabled":
            self.run = _init_wandb(Path(out_dir), wandb_cfg, config or {}, provenance or {})
        self.status = ""  # the last logged step's figures, on every progress line
        # steps before a resumed run's checkpoint are "already done": the ETA is this launch's
        self.progress = Progress(
            "train",
            total_steps,
            "steps",
            already=start_step,
            status=lambda: self.status,
            mode=None if progress else "off",
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        self.status = (
            f"step {step}: loss {metrics['loss']:.3f}, acc_0 {metrics['acc_0']:.2f}, "
            f"{metrics.get('tokens_per_s', 0):,.0f} tok/s"
        )
        self.progress.tick()  # a line, when one is due, with these figures

    def log_eval(self, step: int, metrics: dict[str, Any], improved: bool) -> None:
        """One validation pass: a metrics.jsonl line {"step", "split": "val", "val/...": ...}
        (training lines have no "split"), the same keys in W&B, and one printed line."""
        if not self.enabled:
            return
        row = self._split_line(step, "val", metrics)
        if self.run is not None:
            self.run.log(row, step=step)
        accs = [value for key, value in metrics.items() if key.startswith("acc_")]  # in k order
        others = {  # data.val_sets: each set's simulated tau
            key.removesuffix("/sim_accept_len"): value
            for key, value in metrics.items()
            if key.endswith("/sim_accept_len")
        }
        parts = []
        if "loss" in metrics:  # the run's own held-out set
            acc = "/".join(f"{a:.2f}" for a in accs)
            parts.append(
                f"loss {metrics['loss']:.3f}, acc {acc}, simulated tau {metrics['sim_accept_len']:.2f}"
            )
        if "alpha_0" in metrics:  # what the LK losses optimise (sampling's acceptance)
            alphas = [value for key, value in metrics.items() if key.startswith("alpha_")]
            parts.append(
                f"alpha {'/'.join(f'{a:.2f}' for a in alphas)} "
                f"(tau {metrics['sim_accept_len_alpha']:.2f} sampled)"
            )
        parts += [f"{name} simulated tau {tau:.2f}" for name, tau in others.items()]
        self.write(
            f"validation at step {step}: "
            + ", ".join(parts)
            + (
                f"; selected by the mean {metrics['select_tau']:.2f}"
                if "select_tau" in metrics
                else ""
            )
            + (" (best so far: saved to best/)" if improved else "")
        )

    def log_data(self, step: int, metrics: dict[str, Any]) -> None:
        """What this launch trains on: a metrics.jsonl line {"step", "split": "data",
        "data/...": ...} (a resumed launch adds its own) and the same keys in W&B's summary."""
        if not self.enabled:
            return
        row = self._split_line(step, "data", metrics)
        if self.run is not None:
            self.run.summary.update(row)

    def _split_line(self, step: int, split: str, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append {"step", "split", "<split>/<key>": ...} to metrics.jsonl -> the prefixed row."""
        row = {f"{split}/{key}": value for key, value in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "split": split, **row}) + "\n")
        return row

    def advance(self, n: int = 1) -> None:
        """`n` more optimizer steps done (the line waits for their figures: `log`)."""
        if self.progress is not None:
            self.progress.update(n, tick=False)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar (main process only). Once every
        step is done the count closes first, so its last line comes before the run's last
        words (the final validation, where the draft was written)."""
        if not self.enabled:
            return
        if self.progress.finished:
            self.progress.close()
        self.progress.write(text)

    def close(self, produced: str | None = None) -> None:
        """The last progress line, then `produced` (what the run made, where)."""
        if self.progress is not None:
            self.progress.close(produced)
        if self.run is not None:
            self.run.finish()


def _truncate_after(path: Path, step: int) -> None:
    """Keep only records with step <= `step` (0 on a fresh run: start an empty file).

    A killed run can leave a half-written last line; it goes with the rest.
    """
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] > step:
                break
        except json.JSONDecodeError:
            break
        keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))


def _init_wandb(out_dir: Path, cfg: Any, config: dict[str, Any], provenance: dict[str, Any]):
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed; logging to metrics.jsonl only")
        return None
    mode = wandb_mode(cfg.mode)
    run_id_file = out_dir / "wandb_run_id"  # a resumed run continues the same W&B run
    run_id = run_id_file.read_text().strip() if run_id_file.exists() else uuid.uuid4().hex[:8]
    run_id_file.write_text(run_id)
    return wandb.init(
        project=cfg.project,
        name=cfg.name or out_dir.name,
        group=cfg.group,
        tags=list(cfg.tags),
        id=run_id,
        resume="allow",
        mode=mode,
        dir=str(out_dir),
        config={**config, "provenance": provenance},
        settings=wandb.Settings(silent=True),
    )
