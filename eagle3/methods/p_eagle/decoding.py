"""P-EAGLE's in-house decoder: a PEagleDraft driven as vLLM drives it (K drafts from one pass).

The draft and the maths it copies from vLLM are draft.py beside it; this module is the decoding
loop's side, built on eagle3.decoding (it sits with the decoders in tests/test_layout.py's
layers), kept apart so that loading a checkpoint imports no decoder: the method imports it only
when asked for its drafter.
"""

from __future__ import annotations

import torch

from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.eagle import gumbel_topk
from eagle3.decoding.tree import DraftTree
from eagle3.errors import Eagle3Error
from eagle3.methods.p_eagle.draft import PEagleDraft


class ParallelDrafter:
    """A PEagleDraft driven as vLLM drives it: after each verification, the verified pairs run
    into the draft's caches (their last logits are depth 0); propose() then runs the K-1 mask
    slots in one call and picks every depth at once. A chain of K = cfg.steps drafts."""

    def __init__(self, draft: PEagleDraft, cfg: DecodeConfig, name: str | None = None):
        if cfg.mode != "chain":
            raise Eagle3Error(
                "a P-EAGLE drafter drafts one chain per pass (vLLM's parallel drafting has no "
                "trees): use --mode chain"
            )
        self.draft = draft.eval()
        self.cfg = cfg
        self.name = name or draft.config.method
        self.feature = draft.config.feature
        self.aux_layer_ids = list(draft.config.aux_layer_ids)
        vd = draft.config.draft_vocab_size
        self.vocab_ids = draft.draft_to_target(torch.arange(vd, device=draft.d2t.device))
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # verified pairs only
        self.length = 0
        self.last_logits: torch.Tensor | None = None  # (Vd,): depth 0, the root's successor

    @torch.inference_mode()
    def update(self, tokens: list[int], aux: torch.Tensor) -> None:
        n = aux.shape[0]
        dev = self.draft.fc.weight.device
        ids = torch.tensor(tokens[-n:], device=dev)[None]
        pos = torch.arange(self.length, self.length + n, device=dev)[None]
        hidden = self.draft.project(aux.to(dev)[None])
        _, logits, self.cache = self.draft(ids, hidden, pos, self.cache)
        self.length += n
        self.last_logits = logits[0, -1]

    @torch.inference_mode()
    def propose(self, tokens: list[int], generator: torch.Generator | None = None) -> DraftTree:
        K = self.cfg.steps
        rows = [self.last_logits[None]]
        if K > 1:
            dev = self.last_logits.device
            ids = torch.full((1, K - 1), self.draft.config.options.mask_token_id, device=dev)
            hidden = self.draft.mask_state().to(self.cache[0][0].dtype).expand(1, K - 1, -1)
            # the depth-0 slot is the last cached entry, at position length - 1
            pos = torch.arange(self.length, self.length + K - 1, device=dev)[None]
            _, logits, _ = self.draft(ids, hidden, pos, self.cache)
            rows.append(logits[0])
        logits = torch.cat(rows).float()  # (K, Vd): depth d's own distribution, each
        tree = DraftTree(vocab_ids=self.vocab_ids)
        if self.cfg.temperature == 0:
            picks = logits.argmax(-1)
        else:
            logp = torch.log_softmax(logits / self.cfg.temperature, dim=-1)
            picks = gumbel_topk(logp, 1, generator)[0][:, 0]
            tree.probs = {d - 1: p for d, p in enumerate(logp.exp())}
        tree.parents = list(range(-1, K - 1))
        tree.tokens = self.draft.draft_to_target(picks).tolist()
        return tree
