"""train/labeller.py: a micro-batch on the device with its soft labels (computed, or from
the label cache on a record's later pass)."""

from __future__ import annotations

import torch

from eagle3.loss import label_rows, target_probs
from train.label_cache import LabelCache
from train.labeller import Labeller

V, H, VD, B, T = 12, 4, 5, 2, 6


def labeller(feature: str = "aux", cache: LabelCache | None = None) -> Labeller:
    torch.manual_seed(0)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:VD] = True
    lm_head = torch.randn(V, H)
    cpu = torch.device("cpu")
    return Labeller(cpu, torch.float32, None, lm_head, t2d, 4, feature, cache)


def stored_batch() -> dict:
    """A collated offline micro-batch: hidden states from the shards, the records' indices."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0  # the prompt
    return {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": mask,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "aux_hidden": torch.randn(B, T, 3 * H, generator=g, dtype=torch.float64),
        "last_hidden": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "index": torch.tensor([3, 7]),
    }


def test_stored_hidden_states_get_the_targets_soft_labels():
    make = labeller()
    batch = stored_batch()
    mb = make(batch)
    assert mb["aux"].dtype == torch.float32 and torch.equal(mb["aux"], batch["aux_hidden"].float())
    rows = label_rows(batch["loss_mask"])  # only the rows a TTT step reads
    probs, in_vocab = target_probs(batch["last_hidden"].float(), make.lm_head, make.t2d, 4, rows)
    assert torch.equal(mb["probs"], probs) and torch.equal(mb["in_vocab"], in_vocab)
    assert mb["segment_ids"] is None and mb["position_ids"] is None  # not packed
    assert (mb["tokens"], mb["slots"]) == (B * T, B * T)
    last = labeller("last")(batch)  # the EAGLE-2-style ablation reads the last hidden state
    assert torch.equal(last["aux"], batch["last_hidden"].float())


def test_a_records_labels_come_from_the_cache_on_its_next_pass_of_the_same_split():
    make = labeller(cache=LabelCache(10**6))
    batch = stored_batch()
    first = make(batch)
    assert len(make.label_cache) == B
    zeroed = {**batch, "last_hidden": torch.zeros_like(batch["last_hidden"])}
    assert torch.equal(make(zeroed)["probs"], first["probs"])  # cached, not recomputed
    assert not torch.equal(make(zeroed, "val")["probs"], first["probs"])  # another split's keys


def test_soft_labels_per_micro_batch_are_the_labels_made_up_front():
    """<1 s: the trainer's two passes (valid positions of every micro-batch, then each one's
    probabilities just before its forward) give the one-pass labels bit for bit, with and
    without the label cache."""
    for cache in (None, LabelCache(2**20)):
        make = labeller(cache=cache)
        up_front = labeller()(stored_batch())
        first = make(stored_batch(), probs=False)
        assert first["probs"] is None and first["in_vocab"].equal(up_front["in_vocab"])
        make.soft_labels(first)
        assert first["probs"].equal(up_front["probs"]) and first["last"] is None
