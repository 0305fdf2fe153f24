"""The training-time-test (TTT) objective of EAGLE-3.

Alignment (one convention for the whole project; see Eagle3Draft.ttt_forward):
- target row j of `probs` is the target's next-token distribution after x_0..x_j, i.e. the
  distribution of x_{j+1}, restricted to the draft vocab and renormalised (soft labels);
- step k's logits at position t predict x_{t+k+2}, so their label is row t+k+1, and the
  position counts when x_{t+k+2} is a generated token (loss_mask) and the target's own
  argmax at row t+k+1 lies in the draft vocab (otherwise the draft cannot match it).
Loss = sum_k w^k * L_k, each L_k a mean over its valid positions of the recipe's objective
(train.loss, eagle3/losses/: the soft cross-entropy CE_k by default, or an LK loss).
Packed rows (train/packing.py) pass `segment_ids` (B, T): then step k at position t also needs
x_{t+k+2} in t's own record; a prediction across a record boundary never counts.
Rollout shards (datagen.rollout) mark each verification root x_{s+1} with 1 + the draft depths
its verification judged from entry s; `rollout_weight` adds that much weight to those (entry,
step) pairs, the states the drafter's own decoding reached (judged_depths).
Sequence-parallel shards (train/sequence_parallel.py) pass `queries`: the shard's positions,
the first `queries` of its tensors, which run on past them by the TTT depth + 1 (the labels
and loss mask its last positions read from the next shard's positions).
"""

from __future__ import annotations

import torch

from eagle3.compute import matmul_dtype
from eagle3.losses import KL, Objective, position_loss

# What step_loss reports of each step k (as "<key>_<k>"); P-EAGLE's loss the same per depth
METRIC_KEYS = ("loss", "alpha", "acc", "count", "masked", "correct")


def step_targets(
    loss_mask: torch.Tensor,
    k: int,
    segment_ids: torch.Tensor | None = None,
    queries: int | None = None,
) -> torch.Tensor:
    """bool (B, n), n = T - k - 2 (at most `queries`): step k's prediction at position t is
    of a generated token (loss_mask[t+k+2]) of t's own record (same segment, when packed)."""
    n = max(loss_mask.shape[1] - k - 2, 0)
    if queries is not None:
        n = min(n, queries)
    masked = loss_mask[:, k + 2 : k + 2 + n].bool()
    if segment_ids is not None:
        masked = masked & (segment_ids[:, k + 2 : k + 2 + n] == segment_ids[:, :n])
    return masked


def judged_depths(loss_mask: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) long: the draft depths a rollout's verification judged from entry t < n (its
    root x_{t+1} carries 1 + that many in the loss mask, datagen.rollout), 0 where none."""
    return (loss_mask[:, 1 : 1 + n] - 1).clamp(min=0)


def step_labels(
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    k: int,
    segment_ids: torch.Tensor | None = None,
    queries: int | None = None,
) -> tuple[slice, torch.Tensor]:
    """TTT step k's labels (the alignment in the module docstring) -> (rows, valid).

    Step k's logits at positions t < n, n = T - k - 2, take their label from row t+k+1, so
    `rows` picks those n rows of `probs` / `in_vocab`; `valid` bool (B, n) marks the positions
    that count. n is 0 when the sequence is too short for step k.
    """
    masked = step_targets(loss_mask, k, segment_ids, queries)
    rows = slice(k + 1, k + 1 + masked.shape[1])
    return rows, masked & in_vocab[:, rows]


def valid_counts(
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_steps: int,
    segment_ids: torch.Tensor | None = None,
    queries: int | None = None,
) -> torch.Tensor:
    """Valid label positions of each TTT step, exactly as ttt_loss counts them -> int64 (K,)."""
    out = torch.zeros(ttt_steps, dtype=torch.long, device=loss_mask.device)
    for k in range(ttt_steps):
        out[k] = step_labels(in_vocab, loss_mask, k, segment_ids, queries)[1].sum()
    return out


def label_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The rows of `probs` some TTT step reads -> bool (B, T): row j is step k's label for
    position j-k-1 and counts only when x_{j+1} is a generated token (step_labels), so row j
    is needed iff loss_mask[j+1]. Prompt and padding rows are never read."""
    rows = torch.zeros_like(loss_mask, dtype=torch.bool)
    rows[:, :-1] = loss_mask[:, 1:].bool()
    return rows


@torch.no_grad()
def target_probs(
    last_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    t2d: torch.Tensor,
    chunk_size: int = 512,
    rows: torch.Tensor | None = None,
    with_probs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Soft labels from the target's final hidden states, one chunk of rows at a time.

    last_hidden (B, T, H), lm_head_weight (V, H), t2d bool (V,) ->
    probs float32 (B, T, Vd), in_vocab bool (B, T). Full-vocab logits exist only for one
    chunk of rows (chunk_size x V), so a 163840-token vocab never sits in memory per step.
    `rows` bool (B, T) (label_rows(loss_mask)): compute only those rows, the others are 0 /
    False: on chat data most tokens are prompt, and this full-vocab lm_head is the training
    step's dearest matmul after the draft's own passes.

    Every chunk is padded to chunk_size rows, so each matmul has one shape and a row's labels
    are the same bits whatever batch it came in (BLAS picks other kernels for other shapes:
    on MKL a 7-row product differs from a 512-row one in the last bit). That keeps a resumed
    run and the label cache (train/label_cache.py) exact.

    with_probs=False: in_vocab alone (probs None), the same bits, no (B, T, Vd) tensor: what the
    trainer needs of every micro-batch of a step before the first one's forward.

    The product runs in the hidden states' dtype, or in float32 on a CPU that would only
    emulate it (eagle3.compute.matmul_dtype: bf16 labels without avx512_bf16 / AMX ran 3.7x
    slower than float32 ones on an AVX2 EPYC).
    """
    B, T, H = last_hidden.shape
    draft_ids = t2d.nonzero().squeeze(-1)  # ascending, matches d2t order
    dtype = matmul_dtype(last_hidden.dtype, last_hidden.device)
    flat = last_hidden.reshape(B * T, H).to(dtype)
    weight = lm_head_weight.to(device=flat.device, dtype=dtype)
    t2d = t2d.to(flat.device)
    if rows is None:
        index = torch.arange(B * T, device=flat.device)
    else:
        index = rows.to(flat.device).reshape(B * T).nonzero().squeeze(-1)
    probs = None
    if with_probs:
        probs = torch.zeros(B * T, draft_ids.numel(), dtype=torch.float32, device=flat.device)
    in_vocab = torch.zeros(B * T, dtype=torch.bool, device=flat.device)
    chunk = flat.new_zeros(chunk_size, H)
    for start in range(0, index.numel(), chunk_size):
        at = index[start : start + chunk_size]
        chunk[: at.numel()] = flat[at]
        chunk[at.numel() :] = 0
        logits = (chunk @ weight.T)[: at.numel()].float()  # (rows, V)
        in_vocab[at] = t2d[logits.argmax(-1)]
        if with_probs:
            probs[at] = logits[:, draft_ids].softmax(-1)
    return (probs.view(B, T, -1) if with_probs else None), in_vocab.view(B, T)


def soft_cross_entropy(
    logits: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft-label cross-entropy of logits (B, T, V) against probs (B, n, V) (n <= T: the first
    n positions) -> (ce float32 (B, n), the logits' argmax (B, n)): the "kl" objective's
    position_loss (eagle3/losses/chunks.py: in chunks, backward over the logits). The same
    values as F.cross_entropy(logits[:, :n].float(), probs) row by row."""
    ce, _, top = position_loss(logits, probs, KL)
    return ce, top


def ttt_loss(
    step_logits: list[torch.Tensor],
    probs: torch.Tensor,
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    step_weight: float = 0.8,
    denominators: list[float] | None = None,
    segment_ids: torch.Tensor | None = None,
    queries: int | None = None,
    objective: Objective = KL,
    rollout_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum of per-step losses (`objective`'s, eagle3/losses/) -> (loss, metrics).

    metrics holds loss_k (over the valid positions), alpha_k (the mean acceptance probability
    sum_x min(p, q) there, whatever the objective), acc_k (draft argmax == target argmax,
    over *every* loss-masked position: one whose target token is outside the draft vocab is a
    miss, as it is when decoding, so acc_k is the acceptance a chain would see; SpecForge counts
    the same way), and count_k (valid) / masked_k / correct_k for exact aggregation across
    batches and ranks. `denominators`
    replaces the local valid-position counts (e.g. counts all-reduced over data-parallel
    ranks, divided by world size) so N ranks reproduce one rank with an N-times batch.
    `segment_ids`: packed rows, `queries`: a sequence-parallel shard (step_targets).
    `rollout_weight`: the extra weight of the (entry, step) pairs a rollout's verification
    judged (module docstring); the denominators stay the position counts. After backward,
    `step_logits` hold their gradients (eagle3/losses/chunks.py).
    """
    total = probs.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    target_top = probs.argmax(-1)  # (B, T): the target's token at every label row, once
    for k, logits in enumerate(step_logits):
        loss_k, step_metrics = step_loss(
            k, logits, probs, in_vocab, loss_mask, step_weight, denominators, segment_ids,
            queries, target_top, objective, rollout_weight,
        )  # fmt: skip
        metrics.update(step_metrics)
        if loss_k is not None:
            total = total + loss_k
    return total, metrics


def step_loss(
    k: int,
    logits: torch.Tensor,
    probs: torch.Tensor,
    in_vocab: torch.Tensor,
    loss_mask: torch.Tensor,
    step_weight: float,
    denominators: list[float] | None,
    segment_ids: torch.Tensor | None,
    queries: int | None,
    target_top: torch.Tensor,
    objective: Objective = KL,
    rollout_weight: float = 0.0,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """TTT step k's share of ttt_loss -> (step_weight^k * L_k, or None when step k has no
    position; its metrics). target_top: probs.argmax(-1). Called by ttt_loss for each step, and
    inside each recomputed step by a run with train.recompute_ttt_steps (eagle3.model's
    ttt_forward `step_loss`), so the step's logits need not outlive it."""
    rows, valid = step_labels(in_vocab, loss_mask, k, segment_ids, queries)
    n = valid.shape[1]
    if n == 0:
        return None, {f"{key}_{k}": 0 for key in METRIC_KEYS}
    masked = int(step_targets(loss_mask, k, segment_ids, queries).sum())
    ce, alpha, top = position_loss(logits, probs[:, rows], objective)  # (B, n) each
    count = int(valid.sum())
    denom = denominators[k] if denominators is not None else max(count, 1)
    weight = valid
    if rollout_weight:  # the pairs a rollout judged count 1 + rollout_weight times
        judged = judged_depths(loss_mask, n) > k
        weight = valid * (1.0 + rollout_weight * judged)
    loss_k = (ce * weight).sum() / max(denom, 1e-8)
    correct = int(((top == target_top[:, rows]) & valid).sum())
    metrics = {
        f"loss_{k}": float((ce.detach() * valid).sum()) / max(count, 1),
        f"alpha_{k}": float((alpha * valid).sum()) / max(count, 1),
        f"acc_{k}": correct / max(masked, 1),
        f"count_{k}": count,
        f"masked_{k}": masked,
        f"correct_{k}": correct,
    }
    return (step_weight**k) * loss_k, metrics


def simulated_acceptance(accs: list[float]) -> float:
    """Expected accepted tokens + 1 for a chain if step k is right with probability acc_k."""
    tau, run = 1.0, 1.0
    for acc in accs:
        run *= acc
        tau += run
    return tau
