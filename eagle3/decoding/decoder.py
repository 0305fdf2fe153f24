"""Speculative decoding against the target: the loop that drafts, verifies exactly and accepts.

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

The drafters: eagle3.decoding.eagle (EAGLE-3, chain and EAGLE-2 tree),
eagle3.decoding.prompt_lookup, eagle3.methods.p_eagle.decoding (P-EAGLE); the tree and its
acceptance rules: eagle3.decoding.tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle3.decoding.acceptance import AcceptanceStats
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.tree import DraftTree, accept_greedy, accept_sampling
from eagle3.errors import Eagle3Error
from eagle3.targets import (
    cache_kwarg,
    capture_outputs,
    decoder_of,
    eos_token_ids,
    keep_cache_entries,
    new_cache,
)


class Drafter(Protocol):
    name: str

    def reset(self) -> None: ...

    def update(self, tokens: list[int], aux: torch.Tensor) -> None:
        """New target features: aux [n, 3H] for the last n positions the target has cached;
        their paired tokens are tokens[-n:] (token x_{s+1} with aux h_s)."""

    def propose(self, tokens: list[int], generator: torch.Generator | None) -> DraftTree: ...


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
    """Batch-size-1 speculative decoding of `target` (an eagle3.targets.Target) with `drafter`
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
