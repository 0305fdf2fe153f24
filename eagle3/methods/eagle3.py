"""EAGLE-3 (method "eagle3"): one draft layer, trained with the training-time-test unroll.

What the method is to the rest of the project (eagle3/methods/__init__.py has the registry):

- the draft: eagle3.model.Eagle3Draft, one decoder layer over fused target features; its
  sub-config (DraftConfig.options) is `Eagle3Options` below, EAGLE-3.1's switches, off;
- training: the TTT unroll of model.ttt_steps steps (eagle3.model.TTTModel) scored by
  eagle3.loss.ttt_loss, sum_k step_weight^k * L_k (L the recipe's train.loss, eagle3/losses/); with train.recompute_ttt_steps each step
  under activation checkpointing (`recomputed_ttt_loss` below);
- export: the config.json of eagle3/checkpoint.py with no field of its own;
- decoding: eagle3.decoding.eagle.EagleDrafter, chain or tree.

`Eagle3Method` answers for EAGLE-3; the other methods subclass it and override where they
differ (eagle3_1.py, p_eagle/). `Eagle3Options` is the sub-config every method's extends: the
draft layer reads its switches (eagle3.model.DraftOptions), and P-EAGLE's adds its own fields
(eagle3/methods/p_eagle/draft.py's PEagleOptions).

Recomputing each TTT step (train.recompute_ttt_steps): without it, backward keeps every TTT
step's activations: q/k/v and MLA's latents, the MLP's intermediates, the residual stream and
the step's draft-vocab logits, ~1 MiB a token a step for Kimi's MLA draft
(train/memory_plan.py's ACTIVATION terms), 7.2 MiB a token over 7 steps. With it, each step
(layer, lm_head and its share of the loss: eagle3.loss.step_loss) runs inside
torch.utils.checkpoint (non-reentrant; eagle3.model.Eagle3Draft.ttt_forward), so between the
forward and the backward a step keeps only what the next steps read from it: its input hidden
state and its keys and values (step k attends to step-0 keys causally and to steps 1..k's at
the same position, so the earlier steps' keys and values are kept, never recomputed from a
different graph). Backward runs each step's forward once more, one step's activations at a
time: the same operations on the same inputs, so the loss and the gradients equal the plain
unroll's (tests/train/test_recompute.py). The draft has no dropout; checkpoint restores the
RNG state anyway. The cost is one more forward of each step (~1.3x the step time on CPU:
benchmarks/bench_train.py --recompute).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3.loss import step_loss, ttt_loss, valid_counts
from eagle3.losses import KL, Objective, objective_named
from eagle3.model import DraftConfig, Eagle3Draft, TTTModel


@dataclass(frozen=True)
class Eagle3Options:
    """EAGLE-3's sub-config (DraftConfig.options): EAGLE-3.1's switches (eagle3.model's
    docstring), off for EAGLE-3 and on for EAGLE-3.1; top-level config.json keys, as vLLM reads
    them. Frozen: configs that dataclasses.replace copies share it."""

    fc_norm: bool = False
    norm_output: bool = False


# EAGLE-3.1's switches: Eagle3Options' fields and config.json keys
SWITCHES = tuple(f.name for f in dataclasses.fields(Eagle3Options))

Need = Callable[[bool, str], None]  # train/config.py's problem collector


class Eagle3Method:
    """EAGLE-3: what it builds, how it trains, what it exports, how it decodes."""

    name = "eagle3"
    # trains with the TTT unroll (TTTModel): what train.recompute_ttt_steps checkpoints step by
    # step, train.sequence_parallel shards and benchmarks/bench_train.py times
    ttt_unroll = True
    # what train/memory_plan.py's terms leave out of this method's training (None: nothing)
    unmodelled_memory: str | None = None
    # its drafter drafts trees too (eagle3.decoding.tree), not only one chain a pass
    drafts_trees = True
    # tensors only this method's drafts carry (eagle3.checkpoint checks a file's against them)
    own_tensors: tuple[str, ...] = ()
    # EAGLE-3.1's fc_norm / norm_output: their default, and what a config.json that records
    # this method must set them to (None: the method's own, not checked)
    switches: bool | None = False
    # the draft reads each of the 3 aux states apart (model.feature must be aux)
    reads_each_aux = False
    # its sub-config (DraftConfig.options): its fields are flat config.json keys
    options_type: type[Eagle3Options] = Eagle3Options
    # its GQA config.json names it top-level too (`method`), beside eagle_config.method
    writes_method_key = False

    # -- the draft ------------------------------------------------------------------------
    def options(self, fields: dict[str, Any]) -> Eagle3Options:
        """This method's sub-config from flat fields (config.json's keys; the arguments of
        eagle3.methods.make_draft_config), taking its own out of `fields`: those absent or None
        take its defaults (the switches: this method's). Other methods' fields stay in `fields`
        (the registry's make_draft_config drops or refuses them)."""
        own = {f.name: fields.pop(f.name, None) for f in dataclasses.fields(self.options_type)}
        given = {name: value for name, value in own.items() if value is not None}
        switches = {switch: bool(self.switches) for switch in SWITCHES}
        return self.options_type(**{**switches, **given})

    def check(self, cfg: DraftConfig) -> None:
        """Refuse a config this method cannot build, in one line (run by
        eagle3.methods.make_draft_config): EAGLE-3 builds whatever DraftConfig accepts."""

    def decoder_layers(self, cfg: DraftConfig) -> int:
        """The draft's decoder layers (config.json's num_hidden_layers): one."""
        return 1

    def build(self, cfg: DraftConfig) -> Eagle3Draft:
        """A fresh draft of this method."""
        return Eagle3Draft(cfg)

    # -- training -------------------------------------------------------------------------
    def draft_fields(self, shape: Any, ttt_steps: int, hf_config: Any) -> dict[str, Any]:
        """model.draft (train/config.py's DraftShapeConfig) -> this method's flat fields
        (eagle3.methods.make_draft_config's: `method` and its sub-config's), its nulls derived
        (from the target's hf_config)."""
        return {"method": self.name}

    def check_recipe(self, model: Any, train: Any, need: Need) -> None:
        """This method's problems in a training config's model and train sections (other
        methods' model.draft keys: the registry's check_recipe)."""
        if self.reads_each_aux:
            need(
                model.feature == "aux",
                f"model.draft.method {self.name} reads each aux state (fc_norm / the fused "
                "features): set model.feature=aux",
            )

    def unroll(self, draft_cfg: DraftConfig, model: Any, train: Any) -> TTTUnroll:
        """The training unroll for the model and train config sections."""
        return TTTUnroll(
            depth=model.ttt_steps,
            recompute=train.recompute_ttt_steps,
            objective=objective_named(train.loss, train.loss_eta),
            rollout_weight=train.rollout_weight,
        )

    # -- export ---------------------------------------------------------------------------
    def export_extra(self, draft_cfg: DraftConfig) -> dict[str, Any]:
        """extra_config fields every export of a trained draft carries (eagle3.checkpoint)."""
        return {}

    def served_extra(self) -> dict[str, Any]:
        """What vLLM's --speculative-config adds to {"method": "eagle3", "model", ...} to serve
        this method's drafter (eagle3.engine.server)."""
        return {}

    # -- decoding -------------------------------------------------------------------------
    def drafter(self, draft: Eagle3Draft, cfg: Any, name: str) -> Any:
        """The in-house drafter of a loaded draft for eagle3.decoding's DecodeConfig `cfg`.
        The decoders sit above the methods (they import the model, never the methods): imported
        here, so that loading a checkpoint or training imports no decoding loop."""
        from eagle3.decoding.eagle import EagleDrafter

        return EagleDrafter(draft, cfg, name=name)


EAGLE3 = Eagle3Method()


@dataclass
class TTTUnroll:
    """The TTT unroll of `depth` steps (eagle3.model.TTTModel, eagle3.loss.ttt_loss) as the
    recipe drives it (train/train_drafter.py): module, prepare, counts, loss, summary."""

    depth: int  # TTT steps: the acc_k / loss_k columns
    recompute: bool = False  # train.recompute_ttt_steps: each TTT step checkpointed
    objective: Objective = KL  # train.loss (eagle3/losses/)
    rollout_weight: float = 0.0  # train.rollout_weight (datagen.rollout)

    def module(self, draft: Eagle3Draft) -> nn.Module:
        return TTTModel(draft, self.depth, recompute=self.recompute)

    def prepare(self, mb: dict, step: int | None = None, micro: int = 0, rank: int = 0) -> None:
        """Nothing to draw: every position trains at every step."""

    def counts(self, mb: dict) -> torch.Tensor:
        """Valid label positions per step, as the loss counts them -> (depth,)."""
        return valid_counts(
            mb["in_vocab"], mb["loss_mask"], self.depth, mb["segment_ids"], mb["queries"]
        )

    def summary(self, total: Any, step_weight: float) -> dict[str, float]:
        """The logged metrics of summed micro-batches (train.metrics.MetricSums)."""
        return total.summary(step_weight)

    def loss(
        self, model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and loss of a labelled micro-batch -> (loss, metrics of eagle3.loss's keys)."""
        if self.recompute:  # each step's loss inside the step
            return recomputed_ttt_loss(
                model, mb, step_weight, denominators, self.objective, self.rollout_weight
            )
        # mb["sp"]: this rank's shard under sequence parallelism, else None
        step_logits = model(
            mb["input_ids"], mb["aux"], mb["segment_ids"], mb["position_ids"], mb["sp"]
        )
        labels = ttt_labels(mb, step_weight, denominators, self.objective, self.rollout_weight)
        return ttt_loss(step_logits, **labels)


def ttt_labels(
    mb: dict,
    step_weight: float,
    denominators: list[float] | None,
    objective: Objective = KL,
    rollout_weight: float = 0.0,
) -> dict[str, Any]:
    """The label arguments eagle3.loss.ttt_loss and step_loss take, from a labelled micro-batch
    (mb["queries"]: this rank's shard under sequence parallelism, else None)."""
    return {
        "objective": objective,
        "rollout_weight": rollout_weight,
        "probs": mb["probs"],
        "in_vocab": mb["in_vocab"],
        "loss_mask": mb["loss_mask"],
        "step_weight": step_weight,
        "denominators": denominators,
        "segment_ids": mb["segment_ids"],
        "queries": mb["queries"],
    }


def recomputed_ttt_loss(
    model: nn.Module,
    mb: dict,
    step_weight: float,
    denominators: list[float] | None,
    objective: Objective = KL,
    rollout_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and loss of a labelled micro-batch (TTTUnroll.loss) with each TTT step's loss
    made inside the step (module docstring) -> (loss, metrics), the values eagle3.loss.ttt_loss
    gives for the same micro-batch. `model` is the TTTModel built with recompute=True."""
    labels = ttt_labels(mb, step_weight, denominators, objective, rollout_weight)
    target_top = mb["probs"].argmax(-1)  # (B, T): once, as ttt_loss does
    metrics: dict[str, float] = {}

    def one_step(k: int, logits: torch.Tensor) -> torch.Tensor | None:
        loss_k, step_metrics = step_loss(k, logits, **labels, target_top=target_top)
        metrics.update(step_metrics)  # a recompute in backward writes the same values again
        return loss_k

    losses = model(
        mb["input_ids"],
        mb["aux"],
        mb["segment_ids"],
        mb["position_ids"],
        mb["sp"],
        step_loss=one_step,
    )
    total = mb["probs"].new_zeros((), dtype=torch.float32)
    for loss_k in losses:  # summed in step order, as ttt_loss sums them
        if loss_k is not None:
            total = total + loss_k
    return total, metrics
