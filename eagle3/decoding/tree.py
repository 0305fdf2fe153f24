"""The draft tree and the two rules that accept a path through it.

A drafter proposes a `DraftTree` of candidates below the root (a chain is a tree with one child
per node); the target scores [root, candidates] in one forward and a path is accepted:
- T=0 (`accept_greedy`): follow the target's argmax down the tree; the first token no child
  matches is the bonus.
- T>0 (`accept_sampling`): recursive rejection sampling, exact when each node's children were
  drawn WITHOUT replacement from the draft distribution q and never pruned by their own values
  (SpecInfer multi-draft verification with the without-replacement update of Jeon et al. 2024,
  "Recursive Speculative Decoding"): for each child x in draw order, accept with
  min(1, p(x)/q(x)); else p <- norm(max(p - q, 0)), q[x] <- 0, q <- norm(q); when all children
  are rejected the bonus is sampled from the residual p. A deterministic proposal (prompt lookup)
  is q = one-hot: accept with p(x), else p[x] <- 0, renormalize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Candidates below the root. Nodes are listed parents first; children in draw order."""

    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)  # index into tokens; -1 = the root
    # T>0: node (-1 = root) -> draft distribution its children were drawn from, indexed like
    # `vocab_ids` (the draft vocab). A node without an entry proposed deterministically.
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    vocab_ids: torch.Tensor | None = None  # target id of each entry of the probs vectors

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    def ancestor_mask(self) -> torch.Tensor:
        """bool (N+1, N+1) over [root, nodes]: row r may attend column c (ancestor or self)."""
        n = len(self.tokens)
        anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        anc[:, 0] = True
        for i, p in enumerate(self.parents):
            anc[i + 1] = anc[p + 1]
            anc[i + 1, i + 1] = True
        return anc


def accept_greedy(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """T=0 walk. target_tokens[r]: the target's argmax at row r (0 = root, 1 + i = node i).
    Returns (accepted node indices, root to leaf; the bonus token)."""
    children = tree.children()
    path: list[int] = []
    node = -1
    while True:
        want = target_tokens[node + 1]
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def accept_sampling(
    tree: DraftTree, target_probs, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """T>0 recursive rejection sampling (see the module docstring); exact for any tree built as
    described there. target_probs(r) -> float64 CPU probabilities [V] of the target at row r."""
    children = tree.children()
    path: list[int] = []
    node = -1
    while True:
        p = target_probs(node + 1).clone()
        q = None
        if node in tree.probs:
            q = torch.zeros_like(p)
            q[tree.vocab_ids.cpu()] = tree.probs[node].to(p)
        for child in children.get(node, []):
            x = tree.tokens[child]
            qx = float(q[x]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * qx < float(p[x]):  # u < p(x) / q(x)
                path.append(child)
                node = child
                break
            if q is None:  # deterministic candidate: residual = p without x
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
                q[x] = 0.0
                q_sum = float(q.sum())
                q = q / q_sum if q_sum > 0 else None
            p_sum = float(p.sum())
            if p_sum <= 0:  # only reachable through rounding when p == q
                p = target_probs(node + 1).clone()
                p_sum = float(p.sum())
            p /= p_sum
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
