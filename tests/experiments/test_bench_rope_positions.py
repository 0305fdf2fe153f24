"""experiments/bench_rope_positions.py: its chunked TTT unroll is Eagle3Draft.ttt_forward's."""

from __future__ import annotations

import torch
from bench_fp8_training import split
from bench_rope_positions import base_id, hits, ttt_argmax

from eagle3.methods import make_draft_config
from eagle3.model import Eagle3Draft


def tiny_draft() -> Eagle3Draft:
    cfg = make_draft_config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        draft_vocab_size=48,
        target_hidden_size=32,
        aux_layer_ids=[0, 1, 2],
        rope_theta=100000.0,
    )
    draft = Eagle3Draft(cfg).eval()
    d2t = torch.zeros(48, dtype=torch.long)
    d2t[40:] = 16  # draft ids 40..47 stand for target ids 56..63
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[torch.arange(48) + d2t] = True
    draft.set_vocab(d2t, t2d)
    return draft


def test_chunked_unroll_matches_ttt_forward():
    draft, K, T = tiny_draft(), 3, 37
    ids, aux = torch.randint(0, 64, (1, T)), torch.randn(1, T, 96)
    with torch.inference_mode():
        ref = [draft.draft_to_target(lg.argmax(-1)) for lg in draft.ttt_forward(ids, aux, K)]
    for chunk in (5, 16, 64):
        got = ttt_argmax(draft, ids, aux, K, chunk)
        assert all(torch.equal(r, g) for r, g in zip(ref, got)), chunk


def test_hits_follow_the_loss_alignment():
    K, T = 2, 6
    label = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    preds = [label.roll(-1, 1), torch.full((1, T), 99)]  # step 0 right everywhere, step 1 never
    hit, valid = hits(preds, label, mask, K)
    assert valid[0].tolist() == [True, True, True, False, False, False]  # mask[t + 2], t < T - 2
    assert hit[0].tolist() == valid[0].tolist()
    assert valid[1].tolist() == [True, True, False, False, False, False] and not hit[1].any()


def test_split_is_fixed_size_and_stable():
    records = [{"id": f"c{i}"} for i in range(40)]
    train, val = split(records, 0.15, seed=0)
    assert len(val) == 6 and len(train) == 34
    assert split(records[::-1], 0.15, seed=0)[1] == val[::-1]
    assert base_id("QWJhYvA_3") == "QWJhYvA" and base_id("abc") == "abc"
