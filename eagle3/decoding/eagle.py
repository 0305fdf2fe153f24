"""EagleDrafter: an EAGLE-3 draft (eagle3.model.Eagle3Draft) proposing with its own KV cache,
as a chain or an EAGLE-2 dynamic tree.

Draft convention (eagle3/model.py): draft cache entry s pairs token x_{s+1} with the target's
aux hidden h_s at rotary position s; chained draft steps feed the draft's own out hidden. The
cache holds only target-verified pairs: this round's draft entries live in a local copy during
drafting, so after verification `update` runs just the new pairs, and that call's last logits
are the next round's first draft step.

Trees (EAGLE-2, `topk`, `total_tokens` = tree size including the root, `depth`): depth by
depth, the `topk` highest-scoring (cumulative draft log-prob) nodes of the newest layer are
expanded in one batched draft call.
- T=0: every expanded node gets its `topk` best children; the tree is then re-ranked to the
  `total_tokens - 1` best nodes (EAGLE-2). A stable sort keeps every parent ahead of its
  children, so the result is a tree.
- T>0: children are drawn WITHOUT replacement from the draft distribution q (Gumbel-top-k), and
  no node is ever pruned by its own value: how many children a node gets is fixed before they
  are drawn (the budget is spread evenly over the remaining depths). Re-ranking would select
  children by their values, which biases the output; this scheme keeps the rejection sampling
  of eagle3.decoding.tree exact.
"""

from __future__ import annotations

import torch

from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.tree import DraftTree
from eagle3.model import Eagle3Draft


def gumbel_topk(
    logp: torch.Tensor, k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from softmax(logp) per row, in draw order -> (ids, logp)."""
    u = torch.rand(logp.shape, generator=generator, dtype=torch.float32).to(logp.device)
    gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
    ids = torch.topk(logp + gumbel, k, dim=-1).indices
    return ids, logp.gather(-1, ids)


class EagleDrafter:
    """An Eagle3Draft driven with its own KV cache: chain or EAGLE-2 dynamic tree."""

    def __init__(self, draft: Eagle3Draft, cfg: DecodeConfig, name: str = "eagle3"):
        self.draft = draft.eval()
        self.cfg = cfg
        self.name = name
        self.feature = draft.config.feature  # which target features update() takes
        self.aux_layer_ids = list(draft.config.aux_layer_ids)  # the target layers it was trained on
        vd = draft.config.draft_vocab_size
        self.vocab_ids = draft.draft_to_target(torch.arange(vd, device=draft.d2t.device))
        self.reset()

    def reset(self) -> None:
        # Only target-verified pairs: propose() extends a local copy (Eagle3Draft.forward
        # concatenates into new tensors), so rejected drafts never reach self.cache.
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = 0  # entries in self.cache
        self.last_hidden: torch.Tensor | None = None  # (1, 1, H): out of the last committed entry
        self.last_logits: torch.Tensor | None = None  # (Vd,): predicts the root's successor

    @torch.inference_mode()
    def update(self, tokens: list[int], aux: torch.Tensor) -> None:
        n = aux.shape[0]
        dev = self.draft.fc.weight.device
        ids = torch.tensor(tokens[-n:], device=dev)[None]  # (1, n)
        pos = torch.arange(self.length, self.length + n, device=dev)[None]
        hidden = self.draft.project(aux.to(dev)[None])  # (1, n, H)
        out, logits, self.cache = self.draft(ids, hidden, pos, self.cache)
        self.length += n
        self.last_hidden, self.last_logits = out[:, -1:], logits[0, -1]

    def _pick(self, logits: torch.Tensor, k: int, generator):
        """logits (S, Vd) -> (ids (S, k), logp (S, k), q (S, Vd) or None at T=0)."""
        k = min(k, logits.shape[-1])
        t = self.cfg.temperature
        if t == 0:
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logp, k, dim=-1)
            return top.indices, top.values, None
        logp = torch.log_softmax(logits.float() / t, dim=-1)
        ids, vals = gumbel_topk(logp, k, generator)
        return ids, vals, logp.exp()

    @torch.inference_mode()
    def propose(self, tokens: list[int], generator: torch.Generator | None = None) -> DraftTree:
        if self.cfg.mode == "chain":
            return self._chain(generator)
        return self._tree(generator)

    def _chain(self, generator) -> DraftTree:
        tree = DraftTree(vocab_ids=self.vocab_ids)
        cache, hidden, logits = self.cache, self.last_hidden, self.last_logits
        draft_ids = []
        for i in range(self.cfg.steps):
            ids, _, q = self._pick(logits[None], 1, generator)
            if q is not None:
                tree.probs[i - 1] = q[0]
            draft_ids.append(ids[0, 0])
            tree.parents.append(i - 1)
            if i + 1 == self.cfg.steps:
                break
            # node i (depth i+1) is fed at position (L-1) + (i+1)
            pos = torch.tensor([[self.length + i]], device=ids.device)
            # the draft embeds target ids: map the drafted draft-vocab id back first
            hidden, lg, cache = self.draft(self.draft.draft_to_target(ids), hidden, pos, cache)
            logits = lg[0, -1]
        tree.tokens = self.draft.draft_to_target(torch.stack(draft_ids)).tolist()
        return tree

    def _tree(self, generator) -> DraftTree:
        cfg, greedy = self.cfg, self.cfg.temperature == 0
        L = self.length
        k_cache, v_cache = self.cache
        dev = k_cache.device
        tok: list[int] = []  # draft-vocab ids
        parents: list[int] = []
        scores: list[float] = []
        probs: dict[int, torch.Tensor] = {}
        hidden_of = {-1: self.last_hidden[0, 0]}  # out hidden fed to a node's children
        entry_of: dict[int, int] = {}  # expanded node -> index among the draft entries
        frontier, rows = [-1], self.last_logits[None]  # nodes to give children, their logits
        budget = cfg.total_tokens - 1
        for d in range(1, cfg.depth + 1):
            width = min(cfg.topk, rows.shape[-1])  # a tiny draft vocab caps the branching
            if greedy:
                counts = [width] * len(frontier)
            else:  # fixed before drawing: spread the budget over the remaining depths
                allowance = max(budget // (cfg.depth - d + 1), min(budget, 1))
                counts = [min(width, max(allowance // len(frontier), 1))] * len(frontier)
                counts = _fit(counts, budget)
            ids, logp, q = self._pick(rows, max(counts), generator)
            ids, logp = ids.tolist(), logp.tolist()
            layer = []
            for r, parent in enumerate(frontier):
                if q is not None and counts[r]:
                    probs[parent] = q[r]
                base = scores[parent] if parent >= 0 else 0.0
                for j in range(counts[r]):
                    layer.append(len(tok))
                    tok.append(ids[r][j])
                    parents.append(parent)
                    scores.append(base + logp[r][j])
            if not greedy:
                budget -= len(layer)
            if d == cfg.depth or (not greedy and budget <= 0) or not layer:
                break
            # EAGLE-2 expansion: the topk best nodes of the newest layer, one batched draft call.
            n_expand = cfg.topk if greedy else min(cfg.topk, max(budget // (cfg.depth - d), 1))
            frontier = sorted(layer, key=lambda n: -scores[n])[:n_expand]
            n_prev = len(entry_of)
            mask = torch.zeros(1, len(frontier), L + n_prev + len(frontier), dtype=torch.bool)
            mask[..., :L] = True
            for r, node in enumerate(frontier):
                a = parents[node]
                while a >= 0:
                    mask[0, r, L + entry_of[a]] = True
                    a = parents[a]
                mask[0, r, L + n_prev + r] = True
            # tok holds draft-vocab ids; the draft embeds target ids
            input_ids = self.draft.draft_to_target(
                torch.tensor([[tok[n] for n in frontier]], device=dev)
            )
            hidden = torch.stack([hidden_of[parents[n]] for n in frontier])[None]
            pos = torch.full((1, len(frontier)), L - 1 + d, device=dev)
            out, logits, (k_cache, v_cache) = self.draft(
                input_ids, hidden, pos, (k_cache, v_cache), mask.to(dev)
            )
            for r, node in enumerate(frontier):
                hidden_of[node] = out[0, r]
                entry_of[node] = n_prev + r
            rows = logits[0]
        keep = list(range(len(tok)))
        if greedy and len(tok) > cfg.total_tokens - 1:
            # EAGLE-2 re-rank; stable, so a parent (score >= its child's) always comes first.
            order = sorted(keep, key=lambda n: -scores[n])
            keep = sorted(order[: cfg.total_tokens - 1])
        new_index = {old: new for new, old in enumerate(keep)}
        new_index[-1] = -1
        tree = DraftTree(vocab_ids=self.vocab_ids)
        kept = torch.tensor([tok[n] for n in keep], device=dev)
        tree.tokens = self.draft.draft_to_target(kept).tolist()
        tree.parents = [new_index[parents[n]] for n in keep]
        tree.probs = {new_index[n]: p for n, p in probs.items() if n in new_index}
        return tree


def _fit(counts: list[int], budget: int) -> list[int]:
    """Trim per-node child counts (front nodes keep theirs) so they sum to <= budget."""
    out = []
    for c in counts:
        c = min(c, budget)
        out.append(c)
        budget -= c
    return out
