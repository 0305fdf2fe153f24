"""The EAGLE-3 draft model: one decoder layer over fused target features.

Definition (the EAGLE-3 paper; parameter names as in SGLang's LlamaForCausalLMEagle3):

    h_0   = fc(concat(aux_low, aux_mid, aux_high))                   3*H_target -> H
    x     = concat(input_layernorm(embed(token)), hidden_norm(h))     2H, into the attention
    h'    = h + attn(x)                                               attn ends in o_proj
    out   = h' + mlp(post_attention_layernorm(h'))                    passed to the next step
    logits = lm_head(norm(out))                                       over the draft vocab

The attention is Llama's GQA (`Attention`, exported as LlamaForCausalLMEagle3) or DeepSeek-V3's
MLA (`MLAAttention`, exported as vLLM's Eagle3DeepseekV3ForCausalLM): DraftConfig.attention.
Everything else is the same layer (eagle3.layers holds the layer and its parts). In vLLM's
decoder-layer terms the residual is the incoming h, not hidden_norm(h) (norm_before_residual =
false), for every method.

The method (DraftConfig.method; eagle3/methods/ holds one module per method) is EAGLE-3 as
above, or EAGLE-3.1 (arXiv 2605.09992), which turns on two switches vLLM 0.32 reads from the
draft's config.json in both llama_eagle3.py and deepseek_eagle3.py:

    fc_norm:      h_0 = fc(concat(fc_norm_0(aux_low), fc_norm_1(aux_mid), fc_norm_2(aux_high)))
                  one RMSNorm per aux state (weights fc_norm.{0,1,2}.weight); vLLM:
                  Eagle3LlamaForCausalLM.combine_hidden_states, chunked over the aux states
    norm_output:  the next draft step is fed norm(out) instead of out (no parameters); vLLM:
                  LlamaModel.forward returns `hidden_states if self.norm_output else
                  hidden_prenorm` as the state the proposer chains

The logits are lm_head(norm(out)) either way, so under norm_output the state the next step
gets is exactly the one the logits were read from. Each switch is a field of its own of the
method's sub-config, DraftConfig.options (a peer's checkpoint may carry one without the other;
`DraftOptions` below is what this layer reads of it), owned by the method: off for EAGLE-3
(eagle3.methods.eagle3.Eagle3Options), on for EAGLE-3.1. P-EAGLE
(eagle3/methods/p_eagle/draft.py) adds plain layers after this one, its fields in its own
sub-config. A DraftConfig is made by eagle3.methods.make_draft_config (or from_target_config),
which routes the flat fields config.json carries to the method's sub-config: this module never
asks the registry.

Two ways to run it:
- `forward`: incremental decoding with a KV cache and an optional explicit attention mask
  (speculative decoding, chain or tree drafting).
- `ttt_forward`: the training-time test unroll. Step k at position t reads token x_{t+k+1}
  and the hidden state the draft itself produced at step k-1 (step 0: fc over the target's
  aux states). Its query attends to step-0 keys at positions <= t and to the keys of steps
  1..k at position t only, which is exactly what the draft sees at inference after k steps.
  Its attention kernels (linear-memory "flash" and "chunked" on CPU, "flex" on CUDA, and the
  dense references) live in eagle3/ttt_attention/. `TTTModel` is that unroll as `forward()`, the
  module training wraps (DDP, DeepSpeed).

Parameter names match SGLang's `LlamaForCausalLMEagle3` so checkpoints load there unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3.errors import Eagle3Error
from eagle3.layers import DecoderLayer, RMSNorm
from eagle3.rope import check_mla_rope, rope_scaling_for_engines, target_rope
from eagle3.ttt_attention.sequence_parallel import SequenceParallel

FEATURES = ("aux", "last")
# "gqa": Llama's attention (q/k/v/o_proj), exported as LlamaForCausalLMEagle3. "mla": DeepSeek-
# V3's multi-head latent attention, exported as vLLM's Eagle3DeepseekV3ForCausalLM (MLAAttention).
ATTENTIONS = ("gqa", "mla")
# A TTT step's loss from its logits (eagle3.loss.step_loss, bound to a micro-batch's labels):
# (k, logits (B, T, Vd)) -> step_weight^k * CE_k, None when step k has no position
StepLoss = Callable[[int, torch.Tensor], torch.Tensor | None]
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Kimi-class (MLA) targets have no Llama head shape to copy: 64 heads of 112 (hidden / heads)
# or of 64 (qk_rope_head_dim), neither of which every attention backend serves. Their draft
# layer defaults to SpecForge's DeepSeek-V3 EAGLE-3 shape instead: heads of 128, 8 KV heads.
MLA_HEAD_DIM = 128
MLA_KV_HEADS = 8


class DraftOptions(Protocol):
    """What the draft layer reads of its method's sub-config (DraftConfig.options, a frozen
    dataclass of eagle3/methods/: eagle3.methods.eagle3.Eagle3Options or one extending it):
    EAGLE-3.1's switches (module docstring)."""

    @property
    def fc_norm(self) -> bool: ...

    @property
    def norm_output(self) -> bool: ...


@dataclass
class DraftConfig:
    hidden_size: int  # H; equals the target hidden size (the embeddings are the target's)
    intermediate_size: int  # SwiGLU width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # fc input is 3 * target_hidden_size (feature "aux")
    aux_layer_ids: list[int] = field(
        default_factory=list
    )  # SGLang eagle_aux_hidden_state_layer_ids
    # "aux": EAGLE-3, fc fuses the 3 aux layers. "last": the EAGLE-1/2 feature, the target's
    # final post-norm hidden state alone (fc is H -> H); kept for the ablation, SGLang and vLLM
    # load only "aux" drafters.
    feature: str = "aux"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE), or {"rope_type": "linear", "factor"} or {"rope_type": "yarn", ...}: see
    # rope_scaling_for_engines; target_fields copies the target's (theta too)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    attention: str = "gqa"  # one of ATTENTIONS
    # MLA only (0 otherwise); target_fields copies the target's. q_lora_rank 0: a plain
    # q_proj from the 2H input instead of q_a_proj -> q_a_layernorm -> q_b_proj.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the draft method, a name in eagle3.methods.METHODS: what it builds, trains and decodes
    method: str = field(kw_only=True)
    # its sub-config, the fields that differ by method (EAGLE-3.1's switches, P-EAGLE's layers,
    # depth and mask id): eagle3.methods.make_draft_config makes it from the flat fields config.json
    # carries, and to_dict flattens it back in this place
    options: DraftOptions = field(kw_only=True)
    # True: embed_tokens are the drafter's own, not the target's (a published file's that differ
    # from the target's, which vLLM serves as they are): kept frozen, and exported as
    # embed_tokens.weight. Never in config.json: eagle3.checkpoint.load_draft decides it from
    # the tensors and the target.
    own_embeddings: bool = False

    def __post_init__(self) -> None:
        """Check what the draft layer needs (a method checks its own sub-config:
        eagle3.methods.make_draft_config)."""
        self.rope_scaling = rope_scaling_for_engines(self.rope_scaling)
        if self.options.fc_norm and self.feature != "aux":
            raise Eagle3Error(
                "fc_norm normalises each of the 3 aux states before fc; feature 'last' has one "
                "state: use method eagle3 with feature last, or feature aux"
            )
        if self.attention not in ATTENTIONS:
            raise Eagle3Error(f"attention {self.attention!r} is not one of {ATTENTIONS}")
        if self.attention == "mla":
            self._check_mla()
        if self.hidden_act != "silu":
            raise Eagle3Error(f"hidden_act {self.hidden_act!r} is not supported; use 'silu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3Error(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3Error(
                f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocab "
                f"{self.vocab_size}; choose draft_vocab_size <= {self.vocab_size}"
            )
        if self.feature not in FEATURES:
            raise Eagle3Error(f"feature {self.feature!r} is not one of {FEATURES}")
        if len(self.aux_layer_ids) != 3:
            raise Eagle3Error(f"EAGLE-3 fuses exactly 3 aux layers, got {self.aux_layer_ids}")

    def _check_mla(self) -> None:
        dims = {name: getattr(self, name) for name in MLA_FIELDS}
        if min(dims.values()) < 0 or 0 in (
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.v_head_dim,
        ):
            raise Eagle3Error(
                f"an MLA draft needs kv_lora_rank, qk_rope_head_dim and v_head_dim >= 1 (and "
                f"q_lora_rank, qk_nope_head_dim >= 0), got {dims}: set model.draft.mla.*"
            )
        if self.qk_rope_head_dim % 2:
            raise Eagle3Error(f"qk_rope_head_dim must be even (rotary pairs), got {dims}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise Eagle3Error(
                f"an MLA draft has one latent KV for all heads: num_key_value_heads "
                f"({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}); leave model.draft.num_key_value_heads null"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise Eagle3Error(
                f"an MLA draft's head_dim is qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim + self.qk_rope_head_dim}, got {self.head_dim}; leave "
                "model.draft.head_dim null"
            )
        check_mla_rope(self.rope_scaling)

    @property
    def feature_size(self) -> int:
        """Width of the target features the fc layer takes."""
        return (3 if self.feature == "aux" else 1) * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        """The flat fields, the method's sub-config's in its place (config.json's keys and
        order; eagle3.methods.make_draft_config takes them back)."""
        flat: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if name == "options":
                flat.update(value)
            else:
                flat[name] = value
        return flat


def target_fields(
    hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any
) -> dict[str, Any]:
    """The flat fields of a draft layer sized like one decoder layer of the target (the usual
    choice), with the target's RoPE (theta and scaling); `overrides` replace any field (None =
    derive), the method's among them (eagle3.methods.from_target_config makes the config).

    A GQA draft for an MLA target (DeepSeek-V3, Kimi-K2.5) gets heads of MLA_HEAD_DIM
    with MLA_KV_HEADS KV heads where the hidden size divides (Kimi: 56 x 128, 8 KV heads),
    else hidden / heads. An MLA draft (attention="mla") takes the target's heads and MLA
    dims (q_lora_rank, kv_lora_rank, qk_nope / qk_rope / v head dims), each overridable.
    """
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    if getattr(hf_config, "kv_lora_rank", None):  # MLA: its head_dim is not a Llama one
        head_dim = hidden // heads
        if hidden % MLA_HEAD_DIM == 0 and (hidden // MLA_HEAD_DIM) % MLA_KV_HEADS == 0:
            head_dim, heads, kv_heads = MLA_HEAD_DIM, hidden // MLA_HEAD_DIM, MLA_KV_HEADS
        else:
            kv_heads = heads
    theta, scaling = target_rope(hf_config)
    # MoE configs (DeepSeek-V3) carry the dense-layer width in intermediate_size too.
    values = dict(
        hidden_size=hidden,
        intermediate_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=hidden,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
    )
    if overrides.get("attention") == "mla":
        values.update(_mla_shape(hf_config, overrides))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


def _mla_shape(hf_config: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """An MLA draft's heads and dims: the overrides', else the target's (one line if neither)."""
    dims = {}
    for name in MLA_FIELDS:
        value = overrides.get(name)
        dims[name] = getattr(hf_config, name, None) if value is None else value
    missing = [n for n in MLA_FIELDS[1:] if dims[n] is None]
    if missing:
        raise Eagle3Error(
            f"the target has no MLA attention to copy ({', '.join(missing)} unset): set "
            "model.draft.mla.* or use model.draft.attention: gqa"
        )
    heads = overrides.get("num_attention_heads") or hf_config.num_attention_heads
    return {
        **dims,
        "q_lora_rank": dims["q_lora_rank"] or 0,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
    }


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        # Frozen: a copy of the target's token embeddings (never saved in the checkpoint), or
        # the drafter's own (cfg.own_embeddings: saved, as vLLM serves them)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.feature_size, H, bias=False)
        if cfg.options.fc_norm:  # EAGLE-3.1: one RMSNorm per aux state before fc
            self.fc_norm = nn.ModuleList(
                RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in cfg.aux_layer_ids
            )
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # Identity mapping until a draft vocab is installed with set_vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    # -- setup --------------------------------------------------------------------------
    def set_embeddings(self, weight: torch.Tensor) -> None:
        """Install the target's embeddings (copied, frozen). A drafter with its own
        (config.own_embeddings) refuses: it would decode another function than vLLM serves."""
        if self.config.own_embeddings:
            raise Eagle3Error(
                "this drafter has its own embed_tokens (vLLM serves them, not the target's); "
                "installing the target's would measure another drafter: keep its own"
            )
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise Eagle3Error(
                f"target embeddings have shape {tuple(weight.shape)}, the draft expects "
                f"{tuple(self.embed_tokens.weight.shape)}: the drafter was built for another target"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise Eagle3Error(
                f"draft vocab shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"the model's {tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    # -- running ------------------------------------------------------------------------
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, 3*Ht), or (B, T, Ht) for feature "last" -> (B, T, H)."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.config.options.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def step_outputs(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output -> (the state the next draft step is fed, logits). norm_output
        feeds norm(out), the state the logits are read from; otherwise out itself."""
        normed = self.norm(out)
        return (normed if self.config.options.norm_output else out), self.lm_head(normed)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One incremental call: S new tokens after P cached ones.

        input_ids (B, S), hidden (B, S, H), position_ids (B, S); past (K, V) each
        (B, nkv, P, hd); attention_mask bool (B|1, S, P+S), True = may attend. Without a mask
        the new tokens attend to the whole cache and causally among themselves.
        Returns (out_hidden (B, S, H): the state the next draft step is fed, logits (B, S, Vd),
        new cache including these tokens).
        """
        layer = self.midlayer
        x = layer.attn_input(self.embed_tokens(input_ids).to(hidden.dtype), hidden)
        q, k, v = layer.self_attn.qkv(x, position_ids)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], dim=2)
            v = torch.cat([past_key_values[1], v], dim=2)
        S, P_total = q.shape[2], k.shape[2]
        if attention_mask is None:
            P = P_total - S
            rows = torch.arange(S, device=q.device)[:, None] + P
            attention_mask = (torch.arange(P_total, device=q.device)[None, :] <= rows)[None]
        out = layer.finish(hidden, layer.self_attn.attend(q, k, v, attention_mask))
        out, logits = self.step_outputs(out)
        return out, logits, (k, v)

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        ttt_steps: int,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_parallel: SequenceParallel | None = None,
        step_loss: StepLoss | None = None,
        recompute: bool = False,
    ) -> list[torch.Tensor]:
        """Training-time test unroll -> per-step draft logits, each (B, T, Vd).

        Step k at position t consumes token x_{t+k+1} (0 past the end; those positions carry
        no loss) and predicts x_{t+k+2}. Rotary position is t+k, as at inference.
        Packed rows (train/packing.py): segment_ids (B, T) keeps attention inside each record
        and position_ids (B, T) restarts positions per record (rotary position_ids + k); the
        token shift does cross a record's end, whose predictions the loss drops
        (eagle3.loss.step_targets).
        Sequence parallel (train/sequence_parallel.py): aux_hidden and position_ids are this
        rank's shard of T positions; input_ids run on past it (the shift's next tokens), and
        attention sees the whole record (`sequence_parallel`, with the whole rows' segment ids).
        `step_loss(k, logits)`: each step's loss is made inside the step and returned instead
        of its logits (None for a step without positions). `recompute` (with grad enabled):
        each step runs under activation checkpointing (torch.utils.checkpoint, non-reentrant),
        so backward keeps only what the steps hand each other, its input hidden state and its
        keys and values (the later steps attend to them), and runs each step's forward again;
        with step_loss the step's logits are recomputed too (ttt_step).
        """
        B, T = aux_hidden.shape[:2]
        sp = sequence_parallel
        if sp is not None:
            segment_ids = sp.segment_ids
        hidden = self.project(aux_hidden)  # (B, T, H)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for k in range(ttt_steps):
            ids = input_ids[:, k + 1 : k + 1 + T]
            ids = F.pad(ids, (0, T - ids.shape[1]))  # (B, T): x_{t+k+1}, 0 past the end
            step = partial(self.ttt_step, k, ids, position_ids + k, segment_ids, sp, step_loss)
            # earlier steps' keys as tuples: the list grows before a recompute runs
            if recompute and torch.is_grad_enabled():
                hidden, key, value, out = checkpoint(
                    step, hidden, tuple(keys), tuple(values), use_reentrant=False
                )
            else:
                hidden, key, value, out = step(hidden, tuple(keys), tuple(values))
            keys.append(key)
            values.append(value)
            outputs.append(out)
        return outputs

    def ttt_step(
        self,
        k: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        segment_ids: torch.Tensor | None,
        sp: SequenceParallel | None,
        step_loss: StepLoss | None,
        hidden: torch.Tensor,
        keys: tuple[torch.Tensor, ...],
        values: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TTT step k (ttt_forward): its tokens ids (B, T) at rotary `positions`, the state
        it is fed, and the keys and values of steps 0..k-1 -> (the state it feeds step k+1,
        its key and value, its logits or step_loss(k, logits))."""
        layer = self.midlayer
        x = layer.attn_input(self.embed_tokens(ids).to(hidden.dtype), hidden)
        q, key, value = layer.self_attn.qkv(x, positions)
        if sp is not None:  # the whole record for this rank's heads (exchanged once)
            nh = q.shape[1]
            q, key, value = (sp.scatter_heads(t, nh) for t in (q, key, value))
        attn = layer.self_attn.attend_ttt(q, [*keys, key], [*values, value], segment_ids, sp)
        hidden, logits = self.step_outputs(layer.finish(hidden, attn))
        return hidden, key, value, (logits if step_loss is None else step_loss(k, logits))


class TTTModel(nn.Module):
    """Routes the TTT unroll through forward(): DDP and DeepSpeed only hook forward().
    recompute: each TTT step under activation checkpointing (Eagle3Draft.ttt_forward)."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int, recompute: bool = False):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.recompute = recompute

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_parallel: SequenceParallel | None = None,
        step_loss: StepLoss | None = None,
    ) -> list[torch.Tensor]:
        return self.draft.ttt_forward(
            input_ids,
            aux_hidden,
            self.ttt_steps,
            segment_ids=segment_ids,
            position_ids=position_ids,
            sequence_parallel=sequence_parallel,
            step_loss=step_loss,
            recompute=self.recompute,
        )
