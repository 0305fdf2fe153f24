"""Prompt lookup decoding: a drafter with no model (Saxena 2023; HF `prompt_lookup_num_tokens`).

The last n tokens (n = max_ngram down to min_ngram) are searched for earlier in the sequence
(prompt plus generated text); the tokens that followed the most recent earlier match are
proposed as a chain. Proposals are deterministic, so at T>0 the verifier treats each as a
one-hot draft distribution, which keeps speculative sampling exact.
"""

from __future__ import annotations

import torch

from eagle3.decoding.tree import DraftTree


def lookup(tokens: list[int], num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
    matching suffix n-gram of `tokens`; [] when no suffix of length >= min_ngram recurs."""
    seq = torch.tensor(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # (len-n, n): every n-gram that has a successor
        hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # latest match: most relevant to the current context
            return tokens[start : start + num_tokens]
    return []


class PromptLookupDrafter:
    name = "prompt-lookup"

    def __init__(self, num_tokens: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def update(self, tokens: list[int], aux: torch.Tensor) -> None:
        pass  # needs no target features

    def propose(self, tokens: list[int], generator: torch.Generator | None = None) -> DraftTree:
        found = lookup(tokens, self.num_tokens, self.max_ngram, self.min_ngram)
        return DraftTree(tokens=found, parents=list(range(-1, len(found) - 1)))
