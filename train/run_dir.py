"""What a run keeps in train.out_dir to resume and to deploy:

    checkpoints/step-N/   state/ (accelerate: model, optimizer, scheduler, RNG; only the newest
                          train.keep_last are kept), draft/ (SGLang export: every one is kept),
                          trainer_state.json (written last: the checkpoint is complete)
    final/                the last SGLang draft
    best/                 the draft with the best validation simulated tau; best.json written last

The best score lives in memory (`Checkpoints.best`), read once from best/best.json when the
run starts: every rank decides alike whether a validation pass improved on it, and no rank
reads a file another node may not see. Exports gather ZeRO-3 shards, so every rank calls them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from eagle3.checkpoint import save_draft
from eagle3.errors import ConfigError
from eagle3.methods import draft_for, method_of
from eagle3.model import DraftConfig
from train.config import TrainConfig
from train.selection import RULE

BEST = "best"  # the draft with the best validation simulated tau so far


def find_resume(train: TrainConfig, out_dir: Path) -> Path | None:
    """The complete checkpoint train.resume_from names (latest: the newest), or None for a
    fresh run, which refuses an out_dir that already holds checkpoints."""
    ckpts = sorted((out_dir / "checkpoints").glob("step-*/trainer_state.json"))
    if train.resume_from is None:
        if ckpts:
            raise ConfigError(
                f"{out_dir} already holds checkpoints; pass train.resume_from=latest to continue "
                "or choose another train.out_dir"
            )
        return None
    if train.resume_from == "latest":
        return ckpts[-1].parent if ckpts else None
    path = Path(train.resume_from)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(
            f"train.resume_from: {path} is not a complete checkpoint (no trainer_state.json)"
        )
    return path


def load_checkpoint(accelerator: Accelerator, resume: Path | None) -> int:
    """Restore the prepared model, optimizer, scheduler and RNG from `resume` -> the optimizer
    steps it holds (0 for a fresh run: nothing to restore)."""
    if resume is None:
        return 0
    accelerator.load_state(str(resume / "state"))
    return json.loads((resume / "trainer_state.json").read_text())["step"]


def read_best(out_dir: Path) -> float | None:
    """The validation simulated tau of best/ (None before any best draft)."""
    path = out_dir / BEST / "best.json"
    return json.loads(path.read_text())["val_sim_accept_len"] if path.is_file() else None


def export_extra(facts: dict, ttt_steps: int, total_steps: int, draft_cfg: DraftConfig) -> dict:
    """The config.json fields every exported draft of the run carries."""
    return {
        "target": facts["name"],
        "target_architectures": list(getattr(facts["hf_config"], "architectures", None) or []),
        "ttt_steps": ttt_steps,
        **method_of(draft_cfg).export_extra(draft_cfg),  # P-EAGLE: speculative_tokens
        "train_steps": total_steps,
    }


def export_draft(
    accelerator: Accelerator,
    model: nn.Module,
    draft_cfg: DraftConfig,
    path: Path,
    extra: dict,
    dtype: str,
) -> None:
    """SGLang-format draft, weights in `dtype` (train.export_dtype), from the (possibly ZeRO-3
    sharded) training model; the drafter's own embeddings with it (draft_cfg.own_embeddings:
    frozen, so the start's)."""
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards onto the main process
    if accelerator.is_main_process:
        with torch.device("meta"):
            draft = draft_for(draft_cfg)
        state = {k.removeprefix("draft."): v for k, v in state.items()}
        if not draft_cfg.own_embeddings:  # the target's: never exported, stays on meta
            state.pop("embed_tokens.weight")
        draft.load_state_dict(
            {k: v.detach().cpu() for k, v in state.items()}, strict=False, assign=True
        )
        save_draft(draft, path, extra_config=extra, dtype=dtype)


@dataclass
class Checkpoints:
    """The run's checkpoints and exports: every export of the same model, fields and dtype."""

    accelerator: Accelerator
    model: nn.Module  # the prepared TTTModel
    draft_cfg: DraftConfig
    out_dir: Path
    extra: dict  # export_extra(): config.json fields of every exported draft
    dtype: str  # train.export_dtype
    keep_last: int  # train.keep_last: optimizer states kept
    best: float | None  # the best validation simulated tau so far (read_best at setup)

    @classmethod
    def for_run(
        cls,
        train: TrainConfig,
        accelerator: Accelerator,
        model: nn.Module,
        draft_cfg: DraftConfig,
        extra: dict,
    ) -> Checkpoints:
        """The checkpoints of a run in train.out_dir, with train.export_dtype and keep_last, and
        the best score so far read once: then kept in memory, alike on every rank."""
        out_dir = Path(train.out_dir)
        return cls(
            accelerator=accelerator,
            model=model,
            draft_cfg=draft_cfg,
            out_dir=out_dir,
            extra=extra,
            dtype=train.export_dtype,
            keep_last=train.keep_last,
            best=read_best(out_dir),
        )

    def export(self, path: Path) -> None:
        """The SGLang draft of the model now (every rank calls it; the main process writes)."""
        export_draft(self.accelerator, self.model, self.draft_cfg, path, self.extra, self.dtype)

    def save(self, step: int) -> None:
        """checkpoints/step-N: state (every rank saves its part), the SGLang draft, then
        trainer_state.json; optimizer states older than train.keep_last are dropped."""
        accelerator, checkpoints = self.accelerator, self.out_dir / "checkpoints"
        ckpt = checkpoints / f"step-{step:07d}"
        accelerator.save_state(str(ckpt / "state"))  # model, optimizer, scheduler, RNG (all ranks)
        self.export(ckpt / "draft")
        if accelerator.is_main_process:
            (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))  # last: complete
            done = sorted(checkpoints.glob("step-*/trainer_state.json"))
            for old in done[: -self.keep_last]:  # keep every SGLang export
                shutil.rmtree(old.parent / "state", ignore_errors=True)
        accelerator.wait_for_everyone()

    def improves(self, sim_accept_len: float) -> bool:
        return self.best is None or sim_accept_len > self.best

    def save_best(self, step: int, sim_accept_len: float, sets: dict | None = None) -> None:
        """best/: the draft now, then best.json (written last: the export is complete); with
        several validation sets, `sim_accept_len` is their selection score (train/selection.py)
        and `sets` each one's simulated tau."""
        self.export(self.out_dir / BEST)
        if self.accelerator.is_main_process:
            best = {"step": step, "val_sim_accept_len": sim_accept_len}
            if sets:
                best.update(rule=RULE, sets=sets)
            (self.out_dir / BEST / "best.json").write_text(json.dumps(best))
        self.best = sim_accept_len
