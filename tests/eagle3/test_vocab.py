import logging

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.vocab import build_draft_vocab, token_frequencies, vocab_from_d2t


def test_counts_only_loss_masked_tokens():
    ids = [torch.tensor([1, 2, 2, 3]), torch.tensor([3, 3, 9])]
    masks = [torch.tensor([0, 1, 1, 1]), torch.tensor([1, 0, 1])]
    counts = token_frequencies(ids, masks, 10)
    assert counts.tolist() == [0, 0, 2, 2, 0, 0, 0, 0, 0, 1]


def test_top_tokens_with_deterministic_ties_and_round_trip():
    counts = torch.tensor([5, 0, 7, 5, 1, 5, 0, 2])
    vocab = build_draft_vocab(counts, 4)
    # 7 (id 2) then the three 5s (ids 0, 3, 5): the tie keeps the lower ids; stored ascending.
    assert vocab.draft_ids.tolist() == [0, 2, 3, 5]
    assert vocab.d2t.dtype == torch.int64
    assert (torch.arange(4) + vocab.d2t).tolist() == vocab.draft_ids.tolist()
    assert vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().squeeze(-1).tolist() == vocab.draft_ids.tolist()
    again = vocab_from_d2t(vocab.d2t, 8)
    assert torch.equal(again.t2d, vocab.t2d)
    assert torch.equal(again.draft_ids, vocab.draft_ids)
    shuffled = build_draft_vocab(counts.clone(), 4)
    assert torch.equal(shuffled.d2t, vocab.d2t)


def test_shrinks_with_warning_when_data_has_few_tokens(caplog):
    counts = torch.tensor([0, 3, 0, 1, 0, 0])
    with caplog.at_level(logging.WARNING):
        vocab = build_draft_vocab(counts, 5)
    assert vocab.size == 2
    assert vocab.draft_ids.tolist() == [1, 3]
    assert "shrinks from 5 to 2" in caplog.text


def test_draft_vocab_larger_than_target_is_an_error():
    with pytest.raises(Eagle3Error, match="larger than the target vocab"):
        build_draft_vocab(torch.ones(10, dtype=torch.long), 11)


def test_token_outside_target_vocab_is_an_error():
    with pytest.raises(Eagle3Error, match="outside the target vocab"):
        token_frequencies([torch.tensor([1, 12])], [torch.tensor([1, 1])], 10)
