"""Speculative decoding against the target: chain and EAGLE-2 tree drafting, exact verification.

Draft convention (eagle3/model.py): draft cache entry s pairs token x_{s+1} with the target's
aux hidden h_s at rotary position s; chained draft steps feed the draft's own out hidden.

State between verification steps: the target cache holds x_0..x_{L-1}; the root x_L (the last
token, sampled by the target) is not in it yet. The draft cache holds entries 0..L-1.
One verification step:

  1. the drafter proposes a tree of candidates below the root (a chain: one child per node);
  2. the target runs [root, candidates] over its cache in ONE forward, positions L + depth and
     a tree attention mask (chains use the plain causal mask), with hooks on the aux layers so
     the same forward yields the aux hidden states the drafter needs next;
  3. a path is accepted: T=0 follows the target's argmax, T>0 uses recursive rejection sampling;
  4. the target cache keeps x_0..x_L plus the accepted path's entries, gathered contiguous; the
     target's own next token (the bonus) becomes the next root;
  5. the drafter's cache never held this round's draft entries (they live in a local copy
     during drafting), so it runs just the new pairs (x_{L+1}, h_L)..(bonus, h_{L+m}); that
     call's last logits are the next round's first draft step: no step re-runs the prefix.

Trees (EAGLE-2, `topk`, `total_tokens` = tree size including the root, `depth`): depth by
depth, the `topk` highest-scoring (cumulative draft log-prob) nodes of the newest layer are
expanded in one batched draft call.
- T=0: every expanded node gets its `topk` best children; the tree is then re-ranked to the
  `total_tokens - 1` best nodes (EAGLE-2). A stable sort keeps every parent ahead of its
  children, so the result is a tree.
- T>0: children are drawn WITHOUT replacement from the draft distribution q (Gumbel-top-k), and
  no node is ever pruned by its own value: how many children a node gets is fixed before they
  are drawn (the budget is spread evenly over the remaining depths). Re-ranking would select
  children by their values, which biases the output; this scheme keeps recursive rejection
  sampling exact (SpecInfer multi-draft verification with the without-replacement update of
  Jeon et al. 2024, "Recursive Speculative Decoding"): for each child x in draw order, accept
  with min(1, p(x)/q(x)); else p <- norm(max(p - q, 0)), q[x] <- 0, q <- norm(q); when all
  children are rejected the bonus is sampled from the residual p. A deterministic proposal
  (prompt lookup) is q = one-hot: accept with p(x), else p[x] <- 0, renormalize.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle3.errors import Eagle3Error
from eagle3.model import Eagle3Draft
from eagle3.target import (
    cache_kwarg,
    capture_outputs,
    decoder_of,
    eos_token_ids,
    keep_cache_entries,
    new_cache,
)


@dataclass
class DecodeConfig:
    mode: str = "chain"  # chain | tree
    steps: int = 7  # chain: draft tokens per verification step
    topk: int = 10  # tree: children per expanded node, nodes expanded per depth
    total_tokens: int = 60  # tree: tokens the target verifies per step, root included
    depth: int = 8  # tree: maximum draft depth
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("chain", "tree"):
            problems.append(f"mode {self.mode!r} is not 'chain' or 'tree'")
        if self.steps < 1 or self.topk < 1 or self.depth < 1:
            problems.append("steps, topk and depth must be >= 1")
        if self.total_tokens < 2:
            problems.append("total_tokens must be >= 2 (the root plus one candidate)")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if problems:
            raise Eagle3Error("; ".join(problems))

    @property
    def max_depth(self) -> int:
        """Deepest draft position a step can offer (columns alpha_1..alpha_k)."""
        return self.steps if self.mode == "chain" else self.depth


# -- the draft tree -------------------------------------------------------------------------------
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


# -- acceptance statistics ------------------------------------------------------------------------
@dataclass
class AcceptanceStats:
    """tau = mean over verification steps of (accepted draft tokens + 1); alpha_i = accepted at
    depth i / steps that offered a depth-i candidate after accepting depths 1..i-1."""

    steps: int = 0
    accepted_total: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i-1]: steps with >= i accepted
    offered_at: list[int] = field(default_factory=list)  # [i-1]: steps offering depth i
    # (context, accepted, offered) of every step recorded with its context: the tokens before
    # the step's first drafted token (prompt + generated so far); eagle3.statistics buckets them
    step_log: list[tuple[int, int, int]] = field(default_factory=list)

    def record(self, accepted: int, offered: int, context: int | None = None) -> None:
        """offered: deepest depth d such that depths 1..d were on offer along the path;
        context: tokens before the first drafted token (None: not known, not logged)."""
        if context is not None:
            self.step_log.append((context, accepted, offered))
        self.steps += 1
        self.accepted_total += accepted
        need = max(accepted, offered)
        for arr in (self.accepted_at, self.offered_at):
            arr.extend([0] * (need - len(arr)))
        for i in range(accepted):
            self.accepted_at[i] += 1
        for i in range(offered):
            self.offered_at[i] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.steps += other.steps
        self.accepted_total += other.accepted_total
        self.step_log.extend(other.step_log)
        for name in ("accepted_at", "offered_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tau(self) -> float:
        return (self.accepted_total + self.steps) / self.steps if self.steps else 0.0

    def alpha(self, k: int | None = None) -> list[float | None]:
        k = len(self.offered_at) if k is None else k
        out: list[float | None] = []
        for i in range(k):
            offered = self.offered_at[i] if i < len(self.offered_at) else 0
            out.append(self.accepted_at[i] / offered if offered else None)
        return out


# -- drafters -----------------------------------------------------------------------------------
class Drafter(Protocol):
    name: str

    def reset(self) -> None: ...

    def update(self, tokens: list[int], aux: torch.Tensor) -> None:
        """New target features: aux [n, 3H] for the last n positions the target has cached;
        their paired tokens are tokens[-n:] (token x_{s+1} with aux h_s)."""

    def propose(self, tokens: list[int], generator: torch.Generator | None) -> DraftTree: ...


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


def _select(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Generation:
    tokens: list[int]  # new tokens (EOS included when produced)
    stats: AcceptanceStats
    seconds: float


class SpeculativeDecoder:
    """Batch-size-1 speculative decoding of `target` (an eagle3.target.Target) with `drafter`
    (None = no drafts: plain decoding through the same loop, tau = 1)."""

    def __init__(
        self,
        target,
        drafter: Drafter | None,
        cfg: DecodeConfig,
        eos_ids: set[int] | None = None,
    ):
        self.target, self.model, self.drafter, self.cfg = target, target.model, drafter, cfg
        attn = str(getattr(self.model.config, "_attn_implementation", "") or "")
        if cfg.mode == "tree" and "flash" in attn:
            raise Eagle3Error(
                f"tree verification needs a custom attention mask, which {attn} cannot take; "
                "load the target with attn_implementation='sdpa' or use --mode chain"
            )
        decoder = decoder_of(self.model)
        self.layers, self.final_norm = decoder.layers, decoder.norm
        # the drafter's own aux layers (a drafter may be trained on non-default ids), else the
        # target's; the features it takes are these layers' outputs, concatenated in this order
        self.aux_ids = list(getattr(drafter, "aux_layer_ids", None) or target.aux_layer_ids)
        bad = [i for i in self.aux_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise Eagle3Error(
                f"drafter aux layer id(s) {bad} out of range: the target has {len(self.layers)} "
                "decoder layers; the drafter was trained for another target"
            )
        # "aux": the 3 aux layers (EAGLE-3); "last": the final post-norm state (ablation drafters)
        self.feature = getattr(drafter, "feature", "aux")
        self.eos = eos_token_ids(target) if eos_ids is None else set(eos_ids)
        self.cache_kw = cache_kwarg(self.model)
        self.device = target.device
        self.cache = None
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.done = False
        self.stats = AcceptanceStats()
        self.last_path: list[int] = []  # accepted node indices of the latest step's tree

    # -- one target forward with aux capture --------------------------------------------------
    def _forward(
        self, ids: list[int], positions: torch.Tensor, mask: torch.Tensor | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [S or 1, V], features [S, 3H] or [S, H]); appends S entries to self.cache."""
        if self.feature == "last":
            hooked = {"last": self.final_norm}
        else:
            hooked = {i: self.layers[i] for i in self.aux_ids}
        with capture_outputs(hooked) as captured:
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=positions[None].to(self.device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **{self.cache_kw: self.cache},
            )
        if self.feature == "last":
            return out.logits[0], captured["last"][0].to(self.device)
        aux = torch.cat([captured[i][0].to(self.device) for i in self.aux_ids], dim=-1)
        return out.logits[0], aux

    def _tree_mask(self, tree: DraftTree, prefix: int) -> torch.Tensor:
        """Additive float mask (1, 1, N+1, prefix + N+1) in the model's dtype."""
        dtype = self.model.dtype
        anc = tree.ancestor_mask()
        allowed = torch.cat([torch.ones(len(anc), prefix, dtype=torch.bool), anc], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
        return mask[None, None].to(self.device)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompt_ids: list[int], generator: torch.Generator | None = None) -> None:
        if not prompt_ids:
            raise Eagle3Error("empty prompt: nothing to condition the target on")
        self.cache = new_cache(self.model)
        self.stats = AcceptanceStats()
        self.prompt_len, self.done = len(prompt_ids), False
        logits, aux = self._forward(
            list(prompt_ids), torch.arange(len(prompt_ids)), None, last_only=True
        )
        self.tokens = list(prompt_ids) + [_select(logits[-1], self.cfg.temperature, generator)]
        self._check_done()
        if self.drafter is not None:
            self.drafter.reset()
            if not self.done:
                self.drafter.update(self.tokens, aux)

    @torch.inference_mode()
    def step(self, generator: torch.Generator | None = None) -> None:
        """One verification step (draft, verify, accept, roll back the caches)."""
        L = len(self.tokens) - 1  # target cache length; tokens[L] is the root
        tree = self.drafter.propose(self.tokens, generator) if self.drafter else DraftTree()
        ids = [self.tokens[L]] + tree.tokens
        positions = torch.tensor([0] + tree.depths()) + L
        mask = None if tree.is_chain() else self._tree_mask(tree, L)
        logits, aux = self._forward(ids, positions, mask, last_only=False)
        t = self.cfg.temperature
        if t == 0:
            path, bonus = accept_greedy(tree, logits.argmax(-1).tolist())
        else:

            def target_probs(row: int) -> torch.Tensor:
                return torch.softmax(logits[row].double().cpu() / t, dim=-1)

            path, bonus = accept_sampling(tree, target_probs, generator)
        self.last_path = path
        last = path[-1] if path else -1
        has_children = any(p == last for p in tree.parents)
        # context: x_0..x_L (prompt + generated, the root included) precede the first draft
        self.stats.record(len(path), len(path) + int(has_children), context=L + 1)
        keep_cache_entries(self.cache, L + 1, [L + 1 + i for i in path])
        self.tokens += [tree.tokens[i] for i in path] + [bonus]
        self._check_done()
        if self.drafter is not None and not self.done:
            self.drafter.update(self.tokens, aux[[0] + [1 + i for i in path]])

    def _check_done(self) -> None:
        new = self.tokens[self.prompt_len :]
        for i, tok in enumerate(new):
            if tok in self.eos or i + 1 >= self.cfg.max_new_tokens:
                self.tokens = self.tokens[: self.prompt_len + i + 1]
                self.done = True
                return

    def generate(
        self, prompt_ids: list[int], generator: torch.Generator | None = None
    ) -> Generation:
        t0 = _now(self.device)
        self.start(prompt_ids, generator)
        while not self.done:
            self.step(generator)
        return Generation(self.tokens[self.prompt_len :], self.stats, _now(self.device) - t0)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def plain_generate(
    target,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Plain autoregressive decoding with a KV cache: the reference and the speed baseline."""
    model, device = target.model, target.device
    eos = eos_token_ids(target) if eos_ids is None else set(eos_ids)
    kw = cache_kwarg(model)
    t0 = _now(device)
    cache = new_cache(model)
    ids = torch.tensor([list(prompt_ids)], device=device)
    new: list[int] = []
    while True:
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        tok = _select(logits[0, -1], temperature, generator)
        new.append(tok)
        if tok in eos or len(new) >= max_new_tokens:
            break
        ids = torch.tensor([[tok]], device=device)
    stats = AcceptanceStats(steps=len(new), accepted_total=0)
    return Generation(new, stats, _now(device) - t0)
