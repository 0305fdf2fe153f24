"""The drafter a run trains: a fresh one over the target's frozen embeddings and the run's draft
vocab, shaped by model.draft (nulls derived from the target), or model.init_from's export."""

from __future__ import annotations

import dataclasses

import torch

from eagle3.checkpoint import load_draft
from eagle3.errors import Eagle3Error
from eagle3.methods import draft_for, from_target_config, method_named
from eagle3.model import MLA_FIELDS, DraftConfig, Eagle3Draft
from eagle3.vocab import DraftVocab, carry_rows
from train.config import ModelConfig
from train.sources import TrainData


def draft_config(
    model: ModelConfig, hf_config, draft_vocab_size: int, aux_ids: list[int]
) -> DraftConfig:
    """The DraftConfig model.draft describes for a target's hf_config (nulls derived)."""
    shape = model.draft
    overrides = {
        "feature": model.feature,
        "attention": shape.attention,
        "method": shape.method,
        **{name: getattr(shape.mla, name) for name in MLA_FIELDS},
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "rope_theta": shape.rope.theta,
        "rope_scaling": shape.rope.scaling,  # {rope_type: default} turns the target's off
        # the method's own fields, nulls derived (P-EAGLE's depth: model.ttt_steps)
        **method_named(shape.method).draft_fields(shape, model.ttt_steps, hf_config),
    }
    return from_target_config(hf_config, draft_vocab_size, aux_ids, **overrides)


def build_draft(model: ModelConfig, facts: dict, vocab: DraftVocab, data: TrainData) -> Eagle3Draft:
    """A fresh drafter (or model.init_from's) with the TTT attention of model.draft.ttt_attention."""
    draft = _build_draft(model, facts, vocab, data)
    draft.midlayer.self_attn.ttt_impl = model.draft.ttt_attention  # an instance attribute
    return draft


def _build_draft(
    model: ModelConfig, facts: dict, vocab: DraftVocab, data: TrainData
) -> Eagle3Draft:
    """A fresh drafter on the target's frozen embeddings, or the one of model.init_from: on the
    target's too, or on its own where its file's differ from them (a published drafter's, which
    vLLM serves: kept frozen and exported, eagle3.checkpoint.load_draft)."""
    draft_cfg = draft_config(model, facts["hf_config"], vocab.size, data.aux_layer_ids)
    if model.init_from is None:
        draft = draft_for(draft_cfg)  # of the method's class (eagle3/methods/)
        draft.set_embeddings(data.embed.float().cpu())  # the target's, frozen
        draft.set_vocab(vocab.d2t, vocab.t2d)
        return draft
    # exports are bf16 by default: train on fp32 master weights (mixed precision casts later)
    draft = load_draft(
        model.init_from,
        embed_weight=data.embed.float().cpu(),
        dtype=torch.float32,
        target_layers=facts["num_layers"],  # a published draft may name no aux layers
    )
    if list(draft.config.aux_layer_ids) != list(data.aux_layer_ids):
        raise Eagle3Error(
            f"model.init_from {model.init_from} reads aux layers "
            f"{list(draft.config.aux_layer_ids)} but the training records hold "
            f"{list(data.aux_layer_ids)} (output of decoder layer k): capture them with "
            f"target.aux_layer_ids={list(draft.config.aux_layer_ids)}"
        )
    if draft.config.method != model.draft.method:
        raise Eagle3Error(
            f"model.init_from {model.init_from} is a {draft.config.method} drafter but "
            f"model.draft.method is {model.draft.method!r}; set "
            f"model.draft.method={draft.config.method}"
        )
    if draft.config.feature != model.feature:
        raise Eagle3Error(
            f"model.init_from {model.init_from} takes feature {draft.config.feature!r} but "
            f"model.feature is {model.feature!r}; set model.feature={draft.config.feature}"
        )
    if model.revocab:
        draft = with_vocab(draft, vocab)
    return draft


def with_vocab(draft: Eagle3Draft, vocab: DraftVocab) -> Eagle3Draft:
    """`draft` over another draft vocab (model.revocab): lm_head rows of tokens in both vocabs
    carried over, the others freshly initialised; every other weight as it was."""
    new = draft_for(dataclasses.replace(draft.config, draft_vocab_size=vocab.size))
    state = draft.state_dict()
    old_ids = draft.d2t + torch.arange(draft.d2t.numel())
    fresh = new.lm_head.weight.detach()
    state["lm_head.weight"] = carry_rows(
        state["lm_head.weight"], old_ids, vocab.draft_ids, fresh.to(draft.lm_head.weight.dtype)
    )
    state["d2t"], state["t2d"] = vocab.d2t, vocab.t2d
    new.load_state_dict(state)
    return new.to(draft.lm_head.weight.dtype)
