"""P-EAGLE training (eagle3/methods/p_eagle/): subsampling policy, labels, loss, the recipe.

The pure tests take < 1 s together; the recipe test (slow) trains a tiny random Llama's
P-EAGLE drafter 6 steps offline with validation and packing, ~25 s on one core.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eagle3.methods.p_eagle import (
    batch_anchors,
    candidate_positions,
    draw_anchors,
    keep_counts,
    parallel_loss,
    valid_counts,
)


def test_peagle_keep_counts_decay_to_the_floor_and_never_grow():
    assert keep_counts(100, 8, 0.7, 0.2) == [70, 49, 35, 25, 20, 20, 20]
    assert keep_counts(10, 4, 0.5, 0.0) == [5, 3, 2]
    assert keep_counts(3, 5, 0.1, 0.0) == [1, 1, 1, 1]  # never an empty depth
    assert keep_counts(0, 3, 0.7, 0.2) == [0, 0]
    assert keep_counts(10, 3, 1.0, 0.2) == [10, 10]  # keep_rate 1: every candidate


def test_peagle_anchors_are_nested_sorted_subsets_and_seeded():
    candidates = torch.tensor([3, 4, 5, 8, 9, 10, 11, 15, 16, 17, 20, 21])
    g = torch.Generator().manual_seed(0)
    anchors = draw_anchors(candidates, 5, 0.7, 0.2, g)
    assert [a.numel() for a in anchors] == keep_counts(12, 5, 0.7, 0.2)
    pool = set(candidates.tolist())
    for a in anchors:
        assert a.tolist() == sorted(a.tolist())
        assert set(a.tolist()) <= pool
        pool = set(a.tolist())
    again = draw_anchors(candidates, 5, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert all(x.equal(y) for x, y in zip(anchors, again))


def test_peagle_candidates_are_positions_with_a_generated_depth0_label():
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    assert candidate_positions(mask).tolist() == [0, 1, 2]  # x_{t+2} generated in some row
    mb = {"loss_mask": mask}
    assert [a.tolist() for a in batch_anchors(mb, 3, 0.5, 0.0, None)] == [[0, 1, 2]] * 2


def test_peagle_loss_is_one_count_normalised_mean_and_acc_follows_the_chain():
    """Loss = sum of soft CE over every valid slot / their count; correct_k counts anchors whose
    depths 0..k are all right (a parallel draft is accepted as a chain)."""
    torch.manual_seed(0)
    B, T, V, K = 1, 8, 5, 3
    loss_mask = torch.ones(B, T, dtype=torch.long)
    in_vocab = torch.ones(B, T, dtype=torch.bool)
    probs = torch.softmax(torch.randn(B, T, V) * 3, -1)
    anchors = [torch.tensor([0, 1, 2, 3]), torch.tensor([1, 3])]
    top = probs.argmax(-1)[0]
    # depth 0 right everywhere but t=1; depth 1 right at t=0,1,3; depth 2 right at t=1,3
    logits = [torch.randn(B, T, V), torch.randn(B, 4, V), torch.randn(B, 2, V)]
    for d, (lg, where) in enumerate(zip(logits, [torch.arange(T), *anchors])):
        for j, t in enumerate(where.tolist()):
            row = min(t + d + 1, T - 1)
            right = {0: t != 1, 1: t in (0, 1, 3), 2: t in (1, 3)}[d]
            tok = top[row] if right else (top[row] + 1) % V
            lg[0, j] = F.one_hot(tok, V) * 10.0
    ref_logits = [lg.clone() for lg in logits]
    loss, m = parallel_loss(
        [lg.requires_grad_() for lg in logits], probs, in_vocab, loss_mask, anchors
    )
    # valid slots: depth d at t needs t + d + 2 < T
    assert [m[f"count_{d}"] for d in range(K)] == [6, 4, 2]
    assert valid_counts(in_vocab, loss_mask, anchors).tolist() == [6, 4, 2]
    ce = []
    for d, (lg, where) in enumerate(zip(ref_logits, [torch.arange(T), *anchors])):
        for j, t in enumerate(where.tolist()):
            if t + d + 2 < T:
                ce.append(F.cross_entropy(lg[0, j], probs[0, t + d + 1]))
    assert float(loss.detach()) == pytest.approx(float(torch.stack(ce).mean()), rel=1e-5)
    # chain: depth 0 right at 5 of its 6 valid slots; depth 1 offered at anchors whose depth 0
    # was right (0, 2, 3) and right at 0, 3; depth 2 offered at 3 (t=1 failed depth 0): right
    assert (m["correct_0"], m["masked_0"]) == (5, 6)
    assert (m["correct_1"], m["masked_1"]) == (2, 3)
    assert (m["correct_2"], m["masked_2"]) == (1, 1)


@pytest.mark.slow
def test_peagle_recipe_trains_validates_and_exports(tmp_path, helpers, tiny_llama_dir, shard_dir):
    """model.draft.method=p-eagle end to end, trained with an LK loss (train.loss=lk-alpha: the
    objective reaches P-EAGLE's one-pass loss as it does the TTT unroll's): the loss falls,
    validation logs the chain's simulated tau and every depth's alpha, and the export loads back
    as the P-EAGLE draft vLLM serves. Costs ~4 s (its call: a 6-step trainer run; measured on 2
    xdist workers)."""
    from eagle3.checkpoint import load_draft
    from eagle3.methods.p_eagle.draft import PEagleDraft

    out = tmp_path / "run"
    args = helpers.common_args(
        tiny_llama_dir,
        out,
        **helpers.offline(shard_dir),
        **{
            "model.draft.method": "p-eagle",
            "model.draft.num_layers": 2,
            "model.draft.parallel_depth": 4,
            "model.draft.mask_token_id": 255,
            "data.val_fraction": 0.2,
            "data.packing": "true",
            "data.pack_length": 128,
            "data.batch_size": 2,
            "train.eval_every": 3,
            "train.loss": "lk-alpha",
        },
    )
    helpers.run_cli(args)
    losses = helpers.losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val/sim_accept_len" in x]
    assert len(val) == 2 and "val/acc_3" in val[-1] and "val/acc_4" not in val[-1]
    assert all(0 < val[-1][f"val/alpha_{d}"] <= 1 for d in range(4))
    assert val[-1]["val/sim_accept_len_alpha"] > 1
    config = json.loads((out / "final" / "config.json").read_text())
    assert (config["method"], config["num_hidden_layers"], config["mask_token_id"]) == (
        "p-eagle",
        2,
        255,
    )
    draft = load_draft(out / "final")
    assert isinstance(draft, PEagleDraft) and draft.config.options.parallel_depth == 4
