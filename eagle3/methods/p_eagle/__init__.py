"""P-EAGLE (method "p-eagle"): parallel drafting, K draft tokens from one draft forward.

The package holds the whole method:

    __init__.py   the method object P_EAGLE, its training unroll and loss (this module)
    draft.py      the draft and its maths next to vLLM's (PEagleDraft, ParallelModel), and its
                  sub-config PEagleOptions (DraftConfig.options)
    decoding.py   the in-house drafter (ParallelDrafter), imported only when asked for

What the method is to the rest of the project (eagle3/methods/__init__.py has the registry):

- the draft: draft.PEagleDraft, the EAGLE-3 layer plus num_layers - 1 plain Llama layers and a
  learned `mask_hidden`, GQA over aux features only (what vLLM 0.32 serves); its sub-config
  draft.PEagleOptions: EAGLE-3.1's switches, num_layers, parallel_depth and mask_token_id;
- training: every depth < parallel_depth in one pass over subsampled positions
  (draft.ParallelModel), scored by `parallel_loss` below;
- export: config.json also carries method, num_layers, parallel_depth and mask_token_id, and
  every trained export its speculative_tokens (K);
- decoding: decoding.ParallelDrafter, one chain of K per pass.

Its recipe keys (model.draft in train/config.py): num_layers (null: 3), parallel_depth (null:
model.ttt_steps), mask_token_id (null: the target's pad, else first eos token), keep_rate and
keep_floor.

Subsampling (the P-EAGLE recipe): depth 0 trains at every position; depth d >= 1 at a random
subset of the positions whose depth-0 label is a generated token, about n * keep_rate^d of
the n candidates but never fewer than n * keep_floor, each depth's subset drawn from the one
before (so every depth-d slot has its chain's depths 1..d-1 to attend to). The subsets are
uniform, so each depth's statistics are unbiased estimates of all positions'; the draw is
seeded by (seed, step, micro-batch, rank), so a resumed run draws the same.

Labels, as eagle3.loss's TTT convention: the depth-d slot at anchor t predicts x_{t+d+2}, its
soft label is row t+d+1 of `probs` (the target's distribution of x_{t+d+2}), and it counts when
x_{t+d+2} is a generated token of t's own record whose target argmax is in the draft vocab.

Loss: the soft cross-entropy (KL(target || draft) plus the target's entropy, a constant: the
same gradient) summed over every valid slot of every depth and divided by their count: one
count-normalised mean over the whole subsampled sequence, no per-depth decay.

Metrics (the same keys as eagle3.loss.ttt_loss, so train/metrics.py sums them alike): loss_k,
count_k (valid slots of depth k); correct_k / masked_k are the CHAIN's counts, as a parallel
draft is accepted: masked_k = anchors whose depths 0..k-1 were all right and whose depth k has
a generated label, correct_k = those whose depth k is right too. acc_k = correct_k / masked_k
is then the acceptance at depth k given depths < k accepted, and the simulated tau
1 + sum_k prod_{j<=k} acc_j (eagle3.loss.simulated_acceptance) the mean accepted chain + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3.errors import Eagle3Error
from eagle3.losses import KL, Objective, objective_named, position_loss
from eagle3.methods.eagle3 import Eagle3Method, Need
from eagle3.methods.p_eagle.draft import ParallelModel, PEagleDraft, PEagleOptions
from eagle3.model import DraftConfig, Eagle3Draft

DEFAULT_LAYERS = 3  # model.draft.num_layers null: the EAGLE-3 layer + 2 plain ones
MASK_KEY = "mask_hidden"  # the learned stand-in for the aux states, [1, 3 * H_target]


class PEagleMethod(Eagle3Method):
    """P-EAGLE: Eagle3Method's interface with its own draft, training, export and decoder."""

    name = "p-eagle"
    ttt_unroll = False  # every depth in one pass (ParallelModel)
    unmodelled_memory = "its one-pass depths and dense per-depth masks are not modelled"
    drafts_trees = False  # vLLM's parallel drafting serves one chain a pass
    own_tensors = (MASK_KEY,)
    switches = None  # its own: fc_norm applies to mask_hidden too
    reads_each_aux = True  # fc fuses the 3 aux states, and mask_hidden stands in for them
    options_type = PEagleOptions
    writes_method_key = True

    # -- the draft ------------------------------------------------------------------------
    def check(self, cfg: DraftConfig) -> None:
        problems = []
        own: PEagleOptions = cfg.options
        if cfg.attention != "gqa" or cfg.feature != "aux":
            problems.append("p-eagle needs attention gqa and feature aux (vLLM 0.32 serves it")
            problems[-1] += " for Llama-style drafts only)"
        if own.num_layers < 1 or own.parallel_depth < 2:
            problems.append(
                f"p-eagle needs num_layers >= 1 and parallel_depth >= 2, got "
                f"{own.num_layers} / {own.parallel_depth}"
            )
        if own.mask_token_id is None or not 0 <= own.mask_token_id < cfg.vocab_size:
            problems.append(
                f"p-eagle needs a mask_token_id in [0, {cfg.vocab_size}), got {own.mask_token_id}"
            )
        if problems:
            raise Eagle3Error("; ".join(problems))

    def decoder_layers(self, cfg: DraftConfig) -> int:
        return cfg.options.num_layers

    def build(self, cfg: DraftConfig) -> Eagle3Draft:
        return PEagleDraft(cfg)

    # -- training -------------------------------------------------------------------------
    def draft_fields(self, shape: Any, ttt_steps: int, hf_config: Any) -> dict[str, Any]:
        """model.draft's P-EAGLE fields, nulls derived: the one place they are."""
        mask = shape.mask_token_id
        if mask is None:  # any id works (the slot's hidden state tells it apart): a special one
            eos = getattr(hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) and eos else eos
            mask = next(
                (i for i in (getattr(hf_config, "pad_token_id", None), eos) if i is not None),
                hf_config.vocab_size - 1,
            )
        return {
            "method": self.name,
            "num_layers": shape.num_layers or DEFAULT_LAYERS,
            "parallel_depth": shape.parallel_depth or ttt_steps,
            "mask_token_id": int(mask),
        }

    def check_recipe(self, model: Any, train: Any, need: Need) -> None:
        shape = model.draft
        need(
            model.feature == "aux",
            f"model.draft.method {self.name} reads each aux state (fc_norm / the fused "
            "features): set model.feature=aux",
        )
        need(
            train.sequence_parallel == 1,
            "train.sequence_parallel shards the TTT unroll; p-eagle's one-pass training is not "
            "sharded: set train.sequence_parallel=1",
        )
        need(
            not train.recompute_ttt_steps,
            "train.recompute_ttt_steps checkpoints the TTT unroll's steps; p-eagle trains in one "
            "pass: set train.recompute_ttt_steps=false",
        )
        need(
            shape.attention == "gqa",
            "model.draft.method p-eagle drafts with Llama attention (vLLM 0.32 has no MLA "
            "P-EAGLE): set model.draft.attention=gqa",
        )
        need(
            shape.num_layers is None or shape.num_layers >= 1,
            f"model.draft.num_layers must be >= 1 or null, got {shape.num_layers}",
        )
        need(
            shape.parallel_depth is None or shape.parallel_depth >= 2,
            f"model.draft.parallel_depth must be >= 2 or null, got {shape.parallel_depth}",
        )
        need(
            0 < shape.keep_rate <= 1,
            f"model.draft.keep_rate must be in (0, 1], got {shape.keep_rate}",
        )
        need(
            0 <= shape.keep_floor <= 1,
            f"model.draft.keep_floor must be in [0, 1], got {shape.keep_floor}",
        )

    def unroll(self, draft_cfg: DraftConfig, model: Any, train: Any) -> ParallelUnroll:
        shape = model.draft
        return ParallelUnroll(
            draft_cfg.options.parallel_depth,
            shape.keep_rate,
            shape.keep_floor,
            train.seed,
            objective_named(train.loss, train.loss_eta),
        )

    # -- export ---------------------------------------------------------------------------
    def export_extra(self, draft_cfg: DraftConfig) -> dict[str, Any]:
        return {"speculative_tokens": draft_cfg.options.parallel_depth}

    def served_extra(self) -> dict[str, Any]:
        return {"parallel_drafting": True}  # K drafts from one pass

    # -- decoding -------------------------------------------------------------------------
    def drafter(self, draft: Eagle3Draft, cfg: Any, name: str) -> Any:
        """vLLM's parallel drafting: K drafts from one pass (imported here: Eagle3Method's)."""
        from eagle3.methods.p_eagle.decoding import ParallelDrafter

        return ParallelDrafter(draft, cfg, name=name)


P_EAGLE = PEagleMethod()


@dataclass
class ParallelUnroll:
    """Every depth < `depth` in one pass over subsampled positions (ParallelModel,
    parallel_loss) as the recipe drives it (eagle3.methods.eagle3.TTTUnroll's interface)."""

    depth: int  # P-EAGLE's parallel depth K: the acc_k / loss_k columns
    keep_rate: float
    keep_floor: float
    seed: int
    objective: Objective = KL  # train.loss (eagle3/losses/)

    def module(self, draft: PEagleDraft) -> nn.Module:
        return ParallelModel(draft)

    def prepare(self, mb: dict, step: int | None = None, micro: int = 0, rank: int = 0) -> None:
        """Draw the micro-batch's anchors (step None: validation, every position)."""
        seed = None if step is None else anchor_seed(self.seed, step, micro, rank)
        mb["anchors"] = batch_anchors(mb, self.depth, self.keep_rate, self.keep_floor, seed)

    def counts(self, mb: dict) -> torch.Tensor:
        """Valid label slots per depth, as the loss counts them -> (depth,)."""
        return valid_counts(mb["in_vocab"], mb["loss_mask"], mb["anchors"], mb["segment_ids"])

    def summary(self, total: Any, step_weight: float) -> dict[str, float]:
        """The logged metrics of summed micro-batches (train.metrics.MetricSums); the loss is
        P-EAGLE's objective, the mean over every valid slot of every depth (not a
        step_weight-weighted sum)."""
        metrics = total.summary(step_weight)
        metrics["loss"] = float(total.ce.sum() / total.count.sum().clamp(min=1))
        return metrics

    def loss(
        self, model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and loss of a labelled micro-batch -> (loss, metrics of eagle3.loss's keys)."""
        logits = model(
            mb["input_ids"], mb["aux"], mb["anchors"], mb["segment_ids"], mb["position_ids"]
        )
        return parallel_loss(
            logits,
            mb["probs"],
            mb["in_vocab"],
            mb["loss_mask"],
            mb["anchors"],
            None if denominators is None else sum(denominators),  # one count, all depths
            mb["segment_ids"],
            self.objective,
        )


def keep_counts(n: int, depth: int, keep_rate: float, keep_floor: float) -> list[int]:
    """Slots of depths 1..depth-1 for n candidate positions: ceil(n * max(keep_rate^d,
    keep_floor)), at least 1 when n > 0 and never more than the depth before."""
    counts, prev = [], n
    for d in range(1, depth):
        want = math.ceil(n * max(keep_rate**d, keep_floor) - 1e-9)
        prev = min(prev, max(want, 1 if n else 0))
        counts.append(prev)
    return counts


def draw_anchors(
    candidates: torch.Tensor,
    depth: int,
    keep_rate: float,
    keep_floor: float,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Nested uniform subsets of `candidates` (ascending positions) for depths 1..depth-1 ->
    ascending int64 tensors, each a subset of the one before (keep_counts sizes them)."""
    pool = candidates.cpu()
    out = []
    for count in keep_counts(pool.numel(), depth, keep_rate, keep_floor):
        pick = torch.randperm(pool.numel(), generator=generator)[:count]
        pool = pool[pick].sort().values
        out.append(pool)
    return [a.to(candidates.device) for a in out]


def candidate_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions t whose depth-0 label x_{t+2} is a generated token in some row (ascending)."""
    rows = torch.zeros(loss_mask.shape[1], dtype=torch.bool, device=loss_mask.device)
    rows[:-2] = loss_mask[:, 2:].bool().any(0)
    return rows.nonzero().squeeze(-1)


def batch_anchors(mb: dict, depth: int, keep_rate: float, keep_floor: float, seed: int | None):
    """The anchors of a labelled micro-batch: drawn (seed an int: training) or every candidate
    at every depth (seed None: validation, the chain measured on all positions)."""
    candidates = candidate_positions(mb["loss_mask"])
    if seed is None:
        return [candidates] * (depth - 1)
    generator = torch.Generator().manual_seed(seed)
    return draw_anchors(candidates, depth, keep_rate, keep_floor, generator)


def anchor_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """One micro-batch's draw: the same on a resumed run, different across steps and ranks."""
    return (seed * 1_000_003 + step) * 4099 + micro * 131 + rank


def depth_labels(
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    positions: torch.Tensor,
    d: int,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth d at anchors `positions` (n,) -> (label rows (n,), masked (B, n): the label is a
    generated token of the anchor's record, valid (B, n): and its target argmax is in the
    draft vocab)."""
    T = loss_mask.shape[1]
    target = positions + d + 2
    inside = target < T
    at = target.clamp(max=T - 1)
    rows = (positions + d + 1).clamp(max=T - 1)
    masked = loss_mask[:, at].bool() & inside[None]
    if segment_ids is not None:
        masked = masked & (segment_ids[:, at] == segment_ids[:, positions])
    return rows, masked, masked & in_vocab[:, rows]


def all_positions(anchors: list[torch.Tensor], T: int, device) -> list[torch.Tensor]:
    """[depth 0's positions (every t), depth 1's anchors, ...]."""
    return [torch.arange(T, device=device), *anchors]


def valid_counts(
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: list[torch.Tensor],
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Valid label slots of each depth, exactly as parallel_loss counts them -> int64 (K,)."""
    positions = all_positions(anchors, loss_mask.shape[1], loss_mask.device)
    return torch.stack(
        [
            depth_labels(in_vocab, loss_mask, p, d, segment_ids)[2].sum()
            for d, p in enumerate(positions)
        ]
    )


def parallel_loss(
    depth_logits: list[torch.Tensor],
    probs: torch.Tensor,
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: list[torch.Tensor],
    denominator: float | None = None,
    segment_ids: torch.Tensor | None = None,
    objective: Objective = KL,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The count-normalised loss over every depth -> (loss, metrics) (module docstring).

    depth_logits from parallel_forward (depth 0 (B, T, Vd), depth d (B, n_d, Vd)); probs
    (B, T, Vd) and in_vocab (B, T) the soft labels; `denominator` replaces the local count of
    valid slots (the whole optimizer step's, over micro-batches and ranks)."""
    T = loss_mask.shape[1]
    positions = all_positions(anchors, T, loss_mask.device)
    counts = valid_counts(in_vocab, loss_mask, anchors, segment_ids)
    denom = denominator if denominator is not None else max(int(counts.sum()), 1)
    target_top = probs.argmax(-1)  # (B, T)
    total = probs.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    chain_ok = None  # (B, n_{d-1}): depths 0..d-1 right at the previous depth's anchors
    for d, (logits, where) in enumerate(zip(depth_logits, positions)):
        rows, masked, valid = depth_labels(in_vocab, loss_mask, where, d, segment_ids)
        ce, alpha, top = position_loss(logits, probs[:, rows], objective)
        total = total + (ce * valid).sum() / max(denom, 1e-8)
        right = (top == target_top[:, rows]) & valid
        if chain_ok is None:
            reached = torch.ones_like(masked)
        else:  # this depth's anchors among the previous depth's (nested subsets)
            reached = chain_ok[:, torch.searchsorted(positions[d - 1], where)]
        offered = reached & masked
        chain_ok = reached & right
        count = int(valid.sum())
        metrics[f"loss_{d}"] = float((ce.detach() * valid).sum()) / max(count, 1)
        metrics[f"alpha_{d}"] = float((alpha * valid).sum()) / max(count, 1)
        metrics[f"count_{d}"] = count
        metrics[f"masked_{d}"] = int(offered.sum())
        metrics[f"correct_{d}"] = int(chain_ok.sum())
        metrics[f"acc_{d}"] = metrics[f"correct_{d}"] / max(metrics[f"masked_{d}"], 1)
    return total, metrics
