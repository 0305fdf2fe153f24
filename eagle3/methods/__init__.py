"""The draft methods, one module each, behind one registry.

    eagle3.py     EAGLE-3: one draft layer, the TTT unroll, sum_k w^k CE_k; chain or tree
    eagle3_1.py   EAGLE-3.1: EAGLE-3 with fc_norm and norm_output on
    p_eagle.py    P-EAGLE: more layers, every depth from one forward (vLLM parallel drafting)

A method is an object of its module (EAGLE3, EAGLE3_1, P_EAGLE) answering for what differs:
the draft it builds and the config it accepts (`configure`, `check`, `build`), the training
unroll and its loss (`draft_fields`, `check_recipe`, `unroll`), the export (`config_fields`,
`export_extra`) and the in-house drafter that decodes it (`drafter`), plus the facts others ask
(`parallel`, `switches`). The method is named once, at the config boundary (DraftConfig.method,
model.draft.method in a training recipe, eagle_config.method in a checkpoint); everything
downstream asks `method_of(draft_config)` and never compares names. Adding a method is adding
a module here and a line to METHODS (docs/adding-a-method.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from eagle3.errors import Eagle3Error
from eagle3.methods.eagle3 import EAGLE3, Eagle3Method
from eagle3.methods.eagle3_1 import EAGLE3_1
from eagle3.methods.p_eagle import P_EAGLE
from eagle3.model import DraftConfig, Eagle3Draft

REGISTRY: dict[str, Eagle3Method] = {m.name: m for m in (EAGLE3, EAGLE3_1, P_EAGLE)}
METHODS = tuple(REGISTRY)  # the names, in the order help texts list them
DEFAULT_METHOD = EAGLE3.name  # what a config that names no method trains


def method_named(name: str) -> Eagle3Method:
    """The method called `name`, or one line naming the known ones."""
    if name not in REGISTRY:
        raise Eagle3Error(f"method {name!r} is not one of {METHODS}")
    return REGISTRY[name]


def method_of(cfg: DraftConfig) -> Eagle3Method:
    """The method of a draft config."""
    return method_named(cfg.method)


def draft_for(cfg: DraftConfig) -> Eagle3Draft:
    """A fresh draft of cfg's method (Eagle3Draft, PEagleDraft, ...)."""
    return method_of(cfg).build(cfg)


class Unroll(Protocol):
    """What the training recipe (train/train_drafter.py) asks of a method's unroll:
    eagle3.methods.eagle3.TTTUnroll, eagle3.methods.p_eagle.ParallelUnroll."""

    depth: int  # the acc_k / loss_k columns: TTT steps, or P-EAGLE's parallel depth

    def module(self, draft: Eagle3Draft) -> nn.Module:
        """The module the recipe prepares and trains (its forward is the unroll)."""

    def prepare(self, mb: dict, step: int | None = None, micro: int = 0, rank: int = 0) -> None:
        """Add what the unroll draws per micro-batch (step None: validation)."""

    def counts(self, mb: dict) -> torch.Tensor:
        """Valid label positions per depth, as the loss counts them -> (depth,)."""

    def summary(self, total: Any, step_weight: float) -> dict[str, float]:
        """The logged metrics of summed micro-batches (train.metrics.MetricSums)."""

    def loss(
        self, model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and loss of a labelled micro-batch -> (loss, metrics)."""

    @staticmethod
    def of(cfg: Any, draft_cfg: DraftConfig) -> Unroll:
        """The unroll of draft_cfg's method for a training config (train.config.Config: its
        model and train sections)."""
        return method_of(draft_cfg).unroll(draft_cfg, cfg.model, cfg.train)
