"""Prompt lookup: the latest earlier match of the longest suffix n-gram, proposed as a chain."""

from eagle3.decoding.prompt_lookup import PromptLookupDrafter, lookup


def test_longest_suffix_ngram_wins():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 1..3 -> followed by 9, 8, 2
    assert lookup(tokens, 3, max_ngram=3) == [9, 8, 2]
    # only bigrams allowed: [2, 3] last occurred at 6..7 -> followed by 7, 1
    assert lookup(tokens, 2, max_ngram=2) == [7, 1]


def test_latest_match_and_truncation_at_the_end():
    tokens = [4, 6, 1, 4, 6, 2, 4, 6]
    assert lookup(tokens, 5, max_ngram=2) == [2, 4, 6]  # the copy stops where the text does
    assert lookup(tokens, 1, max_ngram=1) == [2]


def test_no_match_and_short_inputs():
    assert lookup([1, 2, 3, 4], 3) == []
    assert lookup([7], 3) == []
    assert lookup([], 3) == []
    assert lookup([1, 2, 1], 3, max_ngram=3, min_ngram=2) == []  # unigram matches not allowed


def test_drafter_proposes_a_chain():
    drafter = PromptLookupDrafter(num_tokens=2)
    tree = drafter.propose([3, 4, 5, 3, 4])
    assert tree.tokens == [5, 3] and tree.parents == [-1, 0] and tree.is_chain() and not tree.probs
    assert len(drafter.propose([1, 2, 3])) == 0
