"""P-EAGLE: parallel drafting, K draft tokens from ONE draft forward (eagle3/methods/p_eagle/).

The draft is the EAGLE-3 layer of eagle3/model.py ("midlayer", fed [embed(token), h] as 2H)
followed by num_layers - 1 plain Llama decoder layers, then norm + lm_head:

    layer 0     h1 = h + attn0([input_layernorm(embed(x)), hidden_norm(h)]);  h1 += mlp(post(h1))
    layer i>=1  h  = h + attn_i(input_layernorm(h));                          h  += mlp(post(h))
    logits      = lm_head(norm(h))

with one learned vector `mask_hidden` [1, 3*H_target] that stands in for the target's aux
states where the draft has none, and a token id `mask_token_id` that stands in for the unknown
token there.

What vLLM 0.32 computes when it serves such a draft with
{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}
(read from vllm/v1/spec_decode/llm_base_proposer.py, vllm/v1/spec_decode/utils.py and
vllm/model_executor/models/llama_eagle3.py):

- `SpecDecodeBaseProposer._init_parallel_drafting_params`: the mask token is the draft
  config's `dflash_config.mask_token_id`, else `mask_token_id`, `dspark_noise_token_id`,
  `pard_token`, `ptd_token_id` (none: ValueError). `load_model` then sets the masked slots'
  hidden state to `combine_hidden_states(mask_hidden)`, i.e. fc(mask_hidden) (through fc_norm
  / input_norm when the config has them): the same fc as the target features.
- `set_inputs_first_pass` with `copy_and_expand_eagle_inputs_kernel` (C++
  `copy_and_expand_eagle_inputs_kernel_impl` on the CPU build, vllm/utils/cpu_triton_utils.py):
  a request whose verified tokens are x_s..x_L (target hidden states h_s..h_L, positions s..L;
  x_{L+1} the target's sampled "bonus" token) becomes the draft query

        slot       token        hidden state        position
        context    x_{j+1}      fc(aux_j)           j          j = s..L-1 (shifted ids)
        depth 0    x_{L+1}      fc(aux_L)           L          the bonus slot
        depth d    mask         fc(mask_hidden)     L + d      d = 1..K-1

  (rejected slots after them get PADDING_SLOT_ID: never cached, never sampled), with
  `extend_all_queries_by_N(N = K - 1)`: one causal attention over the draft's KV cache.
- `propose`: `if self.num_speculative_tokens == 1 or self.parallel_drafting`, the K new slots
  (depth 0..K-1) are sampled at once from their logits and returned; no second forward.
- `llama_eagle3.LlamaDecoderLayer.forward`: layer_idx 0 concatenates
  [input_layernorm(embeds), hidden_norm(h)] (qkv_proj takes 2H), residual = h
  (norm_before_residual false); layers >= 1 take only the hidden state (qkv_proj takes H) with
  vLLM's fused residual RMSNorm: `input_layernorm(h, residual)` = norm(h + residual), i.e. a
  pre-norm Llama layer on the running sum. `LlamaModel.forward` ends in norm(h, residual), the
  logits' input. Layer 0's weights are the checkpoint's `midlayer.*` (hf_to_vllm_mapper maps
  "midlayer." to "layers.0."), layer i's are `layers.{i}.*`; `Eagle3LlamaForCausalLM.load_weights`
  copies `mask_hidden` into its buffer when parallel drafting is on and raises without it.

So the draft token at depth d after a verified prefix ending at L is the argmax (T=0) of the
logits of a slot (mask, fc(mask_hidden)) at position L + d that attends causally to every
context slot <= L and to the depth 1..d-1 slots before it. `PEagleDraft.forward` computes those
slots incrementally (decoding: the context from the cache, then the K-1 mask slots in one call)
and `PEagleDraft.parallel_forward` computes all depths of every position in one pass
(training), so that each depth's training logits are exactly its decoding logits. The
in-house decoder that drives it as vLLM does is eagle3/methods/p_eagle/decoding.py. Its
sub-config (DraftConfig.options, the fields that config.json carries flat) is `PEagleOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.errors import Eagle3Error
from eagle3.layers import MLP, Attention, RMSNorm
from eagle3.methods.eagle3 import Eagle3Options
from eagle3.model import DraftConfig, Eagle3Draft


@dataclass(frozen=True)
class PEagleOptions(Eagle3Options):
    """P-EAGLE's sub-config (DraftConfig.options): EAGLE-3.1's switches (off unless a config
    sets them; fc_norm applies to mask_hidden too), then its own fields, each a top-level
    config.json key: decoder layers (the EAGLE-3 layer + num_layers - 1 plain Llama layers),
    the depths K it is trained to draft in one pass, and the token id depths >= 1 are fed (vLLM
    reads it as the config's mask_token_id). The defaults are unset values: the method's check
    refuses them, and a one-layer method's config may carry them (eagle3.methods.UNSET)."""

    num_layers: int = 1
    parallel_depth: int = 0
    mask_token_id: int | None = None


class PlainLayer(nn.Module):
    """A Llama decoder layer over the H-wide hidden state (vLLM: LlamaDecoderLayer, layer_idx
    >= 1 in llama_eagle3.py): pre-norm attention and SwiGLU MLP, residual adds."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_dim=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class PEagleDraft(Eagle3Draft):
    """The P-EAGLE draft (module docstring). State-dict names: Eagle3Draft's, plus
    `layers.{i}.*` (i = 1..num_layers-1, vLLM's layer index) and `mask_hidden`."""

    def __init__(self, cfg: DraftConfig):
        if not isinstance(cfg.options, PEagleOptions):  # made by P-EAGLE's method only
            raise Eagle3Error(f"PEagleDraft needs a P-EAGLE config, the config says {cfg.method!r}")
        super().__init__(cfg)
        layers = cfg.options.num_layers
        # keys "1".."n-1": the state dict then names layer i as vLLM does (layers.{i}.*)
        self.layers = nn.ModuleDict({str(i): PlainLayer(cfg) for i in range(1, layers)})
        self.layers.apply(self._init_weights)
        self.mask_hidden = nn.Parameter(torch.randn(1, cfg.feature_size) * 0.02)

    def stack(self) -> list[nn.Module]:
        """The decoder layers in order: midlayer (layer 0), then layers.1, layers.2, ..."""
        return [self.midlayer, *(self.layers[str(i)] for i in range(1, len(self.layers) + 1))]

    def mask_state(self) -> torch.Tensor:
        """(1, H): the hidden state of every masked slot, vLLM's
        combine_hidden_states(mask_hidden) = fc(mask_hidden)."""
        return self.project(self.mask_hidden)

    def _qkv(self, i: int, layer: nn.Module, embeds: torch.Tensor, h: torch.Tensor, pos):
        if i == 0:  # the EAGLE-3 layer: [input_layernorm(embed), hidden_norm(h)]
            return layer.self_attn.qkv(layer.attn_input(embeds, h), pos)
        return layer.self_attn.qkv(layer.input_layernorm(h), pos)

    # -- decoding: incremental, with one KV cache per layer ---------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """S new slots after P cached ones, through every layer (Eagle3Draft.forward's contract,
        the cache a list of per-layer (K, V)). Without a mask the new slots attend to the whole
        cache and causally among themselves. -> (out (B, S, H) before the final norm,
        logits (B, S, Vd), the caches including these slots)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        caches = []
        h = hidden
        for i, layer in enumerate(self.stack()):
            q, k, v = self._qkv(i, layer, embeds, h, position_ids)
            if past_key_values is not None:
                k = torch.cat([past_key_values[i][0], k], dim=2)
                v = torch.cat([past_key_values[i][1], v], dim=2)
            mask = attention_mask
            if mask is None:
                S, total = q.shape[2], k.shape[2]
                rows = torch.arange(S, device=q.device)[:, None] + (total - S)
                mask = (torch.arange(total, device=q.device)[None, :] <= rows)[None]
            h = layer.finish(h, layer.self_attn.attend(q, k, v, mask))
            caches.append((k, v))
        return h, self.compute_logits(h), caches

    # -- training: every depth in one pass --------------------------------------------------
    def parallel_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: list[torch.Tensor],
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """All depths in one pass -> [depth-0 logits (B, T, Vd), depth-d logits (B, n_d, Vd)].

        Depth 0 at position t is the context slot (x_{t+1}, fc(aux_t)) at position t, and
        predicts x_{t+2}. anchors[d-1] (ascending positions, each depth's a subset of the one
        before: eagle3/methods/p_eagle/ draws them) are the positions t whose depth-d slot
        (mask, fc(mask_hidden)) at rotary position t + d is run; it predicts x_{t+d+2} and
        attends to depth-0 slots s <= t (of t's record when packed: segment_ids) and to its own
        chain's depths 1..d at anchor t: exactly what vLLM's one draft pass gives depth d after
        a prefix ending at t (module docstring).
        """
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        if segment_ids is None:
            segment_ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        ids0 = F.pad(input_ids[:, 1:], (0, 1))  # x_{t+1}; the last one carries no loss
        h0 = self.project(aux_hidden)
        hs = [h0]
        ids = [ids0]
        pos = [position_ids]
        for d, at in enumerate(anchors, start=1):
            n = at.numel()
            ids.append(torch.full((B, n), self.config.options.mask_token_id, device=dev))
            hs.append(self.mask_state().to(h0.dtype).expand(B, n, -1))
            pos.append(position_ids[:, at] + d)
        # depth 0: causal within a record; depth d: the context s <= anchor in its record
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        masks = [causal[None] & same]
        chain_index = []  # [d-1][e-1]: where depth d's anchors sit among depth e's, e <= d
        for d, at in enumerate(anchors, start=1):
            ctx = causal[at] & same[:, at]  # (B, n_d, T)
            n = at.numel()
            eye = torch.eye(n, dtype=torch.bool, device=dev)[None].expand(B, n, n)
            masks.append(torch.cat([ctx, *([eye] * d)], dim=-1))
            chain_index.append([torch.searchsorted(anchors[e - 1], at) for e in range(1, d + 1)])
        embeds = [self.embed_tokens(x).to(h0.dtype) for x in ids]
        for i, layer in enumerate(self.stack()):
            qkv = [self._qkv(i, layer, e, h, p) for e, h, p in zip(embeds, hs, pos)]
            out = []
            for d, (q, k, v) in enumerate(qkv):
                if d == 0:
                    keys, values = k, v
                else:  # the context's keys, then the chain's depths 1..d at these anchors
                    chain = chain_index[d - 1]
                    keys = torch.cat(
                        [qkv[0][1]] + [qkv[e][1][:, :, chain[e - 1]] for e in range(1, d + 1)],
                        dim=2,
                    )
                    values = torch.cat(
                        [qkv[0][2]] + [qkv[e][2][:, :, chain[e - 1]] for e in range(1, d + 1)],
                        dim=2,
                    )
                out.append(layer.finish(hs[d], layer.self_attn.attend(q, keys, values, masks[d])))
            hs = out
        return [self.compute_logits(h) for h in hs]


class ParallelModel(nn.Module):
    """Routes parallel_forward through forward(): DDP and DeepSpeed only hook forward()."""

    def __init__(self, draft: PEagleDraft):
        super().__init__()
        self.draft = draft

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        anchors: list[torch.Tensor],
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        return self.draft.parallel_forward(
            input_ids, aux_hidden, anchors, segment_ids=segment_ids, position_ids=position_ids
        )
