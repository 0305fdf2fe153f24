"""Drafter checkpoints in the format SGLang loads with `--speculative-algorithm EAGLE3`.

A checkpoint is a directory with two files:

config.json
    A Llama config for one decoder layer: `architectures: ["LlamaForCausalLMEagle3"]`,
    `model_type: "llama"`, `num_hidden_layers: 1`, the layer sizes (hidden, intermediate,
    heads, kv-heads, head_dim), rope and rms-norm settings (`rope_theta`, and `rope_scaling`
    null or linear/YaRN in the form vLLM and SGLang both read the same way, see
    eagle3.rope.rope_scaling_for_engines; configs without it load as unscaled),
    `vocab_size` (the TARGET vocab), `draft_vocab_size`, `target_hidden_size`, `tie_word_embeddings: false`, `torch_dtype`,
    and `eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true, method}`.

    EAGLE-3.1 (eagle3.model's docstring): top-level `fc_norm` and `norm_output`, the switches
    vLLM reads, true for method eagle3.1 (with the tensors `fc_norm.{0,1,2}.weight`), false
    for eagle3. `eagle_config.method` is ours: loading refuses a config whose switches
    disagree with it, and weights whose fc_norm tensors disagree with the flag, because vLLM
    reads only the switches and would silently serve plain EAGLE-3.

    Aux layer ids, written twice because the engines read different keys with different
    conventions (checked against their loaders):
    - `eagle_config.eagle_aux_hidden_state_layer_ids`: the PROJECT's ids (output of decoder
      layer k = HF hidden_states[k+1]). SGLang reads only this key
      (`model_runner.py`: `eagle_config["eagle_aux_hidden_state_layer_ids"]`) and adds 1
      (`set_eagle3_layers_to_capture`), which captures exactly layer k's output.
    - top-level `eagle_aux_hidden_state_layer_ids`: the same layers in vLLM's convention,
      project id + 1 (vLLM id j = the residual stream after j layers = HF hidden_states[j]).
      vLLM 0.32 (`gpu_model_runner._get_eagle3_aux_layers_from_config`, and the speculators
      config path) reads this top-level key FIRST and uses it as is; only without it does it
      fall back to `eagle_config`'s list, which would then be one layer too early.
    The ids must be strictly ascending: vLLM returns the aux states in layer order whatever
    order it is given, while the drafter's fc was trained on the concatenation in id order.
    Two more keys that SGLang ignores:
    - `speculators_config`: the vLLM/speculators proposal block (algorithm "eagle3", greedy
      proposal with `speculative_tokens`, verifier name/architectures). We do NOT set
      `speculators_model_type`, which would make vLLM expect speculators' tensor names; vLLM
      loads this SGLang layout through the `LlamaForCausalLMEagle3` architecture.
    - `extra_config`: whatever the caller passed to `save_draft` (training provenance). Its
      keys `target`, `target_architectures` and `speculative_tokens` (or `ttt_steps`) also
      fill the speculators block.
model.safetensors
    Exactly fc.weight, midlayer.* (norms, q/k/v/o_proj, gate/up/down_proj), norm.weight,
    lm_head.weight [draft_vocab, H], d2t (int64 [draft_vocab]: target id = draft id + d2t)
    and t2d (bool [target vocab]). No embed_tokens: the drafter uses the target's embeddings,
    except a drafter that has its own (DraftConfig.own_embeddings: a published file's that
    differ from the target's), whose embed_tokens.weight [vocab, H] is written: vLLM 0.32
    serves a draft's own embed_tokens unless they equal the target's
    (vllm/v1/spec_decode/llm_base_proposer.py, `_maybe_share_embeddings`), so the export serves
    the function that was measured and trained.
    A draft over the whole target vocab (draft_vocab_size = vocab_size) has no d2t and t2d:
    vLLM 0.32 fails to load a d2t beside a full-size lm_head.

Drafters published by other trainers (TorchSpec, SpecForge, speculators) load through
eagle3.published, which reads their layouts onto this one; saving always writes this format.

The MLA draft (DraftConfig.attention "mla") is the same directory for vLLM's
`Eagle3DeepseekV3ForCausalLM` (vllm/model_executor/models/deepseek_eagle3.py):
- config.json: `architectures: ["Eagle3DeepseekV3ForCausalLM"]`, `model_type: "deepseek_v2"`,
  `num_hidden_layers: 1`, hidden / intermediate sizes, `num_attention_heads` (=
  `num_key_value_heads`), `q_lora_rank` (null: a plain q_proj), `kv_lora_rank`,
  `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_theta` and `rope_scaling` in
  DeepSeek's YaRN keys (eagle3.rope.deepseek_rope_scaling), `n_routed_experts: 1`,
  `norm_before_residual` false, and the same vocab, aux-id, EAGLE-3.1, speculators and
  extra_config keys as above.
- model.safetensors: midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight in place of q/k/v/o_proj;
  everything else as above. vLLM's load_weights renames midlayer. -> layers.0., fuses q_a_proj
  with kv_a_proj_with_mqa and gate_proj with up_proj itself, maps d2t to draft_id_to_target_id
  and skips t2d, so the tensors are written unfused, under the names our model uses.
A method's sub-config (DraftConfig.options: the switches above, P-EAGLE's fields) is written as
top-level keys in DraftConfig.to_dict()'s order, and read back by eagle3.methods.make_draft_config.
A P-EAGLE draft (eagle3/methods/p_eagle/) is the GQA directory
with `num_hidden_layers` = its layer count, `method` (p-eagle), `num_layers`,
`parallel_depth` and `mask_token_id` (vLLM's `_init_parallel_drafting_params` reads the mask id
under that name) in config.json, and in model.safetensors `layers.{i}.*` for its plain layers
i >= 1 (vLLM's own index; layer 0 stays `midlayer.*`) and `mask_hidden` [1, 3 * H_target],
which vLLM's `Eagle3LlamaForCausalLM.load_weights` requires when parallel drafting is on.
Served with `"parallel_drafting": true` in the speculative config (eagle3.engine.server).
The loader refuses a config whose method or layer count disagrees with the tensors.
SGLang (python/sglang/srt/models/deepseek_eagle3.py at the commits read) registers the same
architecture and reads the same names and eagle_config ids; see docs/kimi-runbook.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.errors import Eagle3Error
from eagle3.methods import (
    OPTION_FIELDS,
    REGISTRY,
    draft_for,
    make_draft_config,
    method_of,
    method_of_published,
)
from eagle3.model import MLA_FIELDS, DraftConfig, Eagle3Draft
from eagle3.published import project_config, project_state, read_tensors, tensor_shapes
from eagle3.rope import deepseek_rope_scaling

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the GQA draft
# The MLA draft: vLLM's Eagle3DeepseekV3ForCausalLM, an alias of its V2 class (both accepted)
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
MLA_ARCHITECTURES = (MLA_ARCHITECTURE, "Eagle3DeepseekV2ForCausalLM")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EMBED_KEY = "embed_tokens.weight"  # part of Eagle3Draft, saved only when its own
EMBED_CHUNK = 4096  # rows compared at a time with the target's (a Kimi matrix is 4.7 GB in fp32)
# tensors some method's drafts carry (P-EAGLE's mask_hidden); the others' files must lack them
METHOD_TENSORS = {key: m for m in REGISTRY.values() for key in m.own_tensors}


DEFAULT_EXPORT_DTYPE = torch.bfloat16
log = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _export_dtype(dtype: torch.dtype | str | None, model: Eagle3Draft) -> torch.dtype:
    """None keeps the model's own float dtype; a name such as "bf16"/"float32" is accepted."""
    if dtype is None:
        return model.fc.weight.dtype
    if isinstance(dtype, str):
        aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
        name = aliases.get(dtype.lower(), dtype.lower()).removeprefix("torch.")
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise Eagle3Error(f"unknown export dtype {dtype!r}; use bfloat16, float16 or float32")
        dtype = resolved
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Eagle3Error(
            f"export dtype {dtype} is not a float dtype; use bfloat16, float16 or float32"
        )
    return dtype


def check_aux_ids(aux_layer_ids: list[int], where: str = "aux layer ids") -> list[int]:
    """Non-negative, strictly ascending ints, else a one-line Eagle3Error."""
    ids = [int(i) for i in aux_layer_ids]
    if any(i < 0 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        raise Eagle3Error(
            f"{where} {ids} must be non-negative and strictly ascending (engines return the "
            f"aux states in layer order); sort them, e.g. {sorted(set(i for i in ids if i >= 0))}, "
            "and retrain"
        )
    return ids


def vllm_aux_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """Project aux ids (output of decoder layer k) -> vLLM's ids (after k+1 layers)."""
    return [int(i) + 1 for i in aux_layer_ids]


def checkpoint_config(
    model: Eagle3Draft,
    extra_config: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
) -> dict:
    """The config.json dict for `model` (see the module docstring); dtype None = the model's."""
    cfg = model.config
    aux = check_aux_ids(list(cfg.aux_layer_ids))
    extra = dict(extra_config or {})
    speculative_tokens = extra.get("speculative_tokens", extra.get("ttt_steps", 3))
    layer = _mla_layer(cfg) if cfg.attention == "mla" else _gqa_layer(cfg)
    return {
        **layer,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(_export_dtype(dtype, model)),
        # vLLM reads this top-level key first, in its own convention (see the module docstring)
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(aux),
        # SGLang reads this one and adds 1 itself: the project's ids
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux,
            "use_aux_hidden_state": cfg.feature == "aux",
            # ours: load_config checks the switches above against it (flags that never
            # reach config.json would silently serve another method)
            "method": cfg.method,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": extra.get("target"),
                "architectures": list(extra.get("target_architectures", [])),
            },
        },
        "extra_config": extra,
    }


def _gqa_layer(cfg: DraftConfig) -> dict[str, Any]:
    """A Llama config of the draft's decoder layers (the module docstring): DraftConfig's flat
    fields, its method's sub-config's among them (P-EAGLE's num_layers, parallel_depth and
    mask_token_id, which vLLM's parallel drafting reads, with its method key)."""
    method = method_of(cfg)
    skip = {"aux_layer_ids", "attention", "own_embeddings", *MLA_FIELDS}
    if not method.writes_method_key:
        skip.add("method")  # eagle_config.method records it
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": method.decoder_layers(cfg),
        **{k: v for k, v in cfg.to_dict().items() if k not in skip},
        "attention_bias": False,
        "mlp_bias": False,
    }


def _mla_layer(cfg: DraftConfig) -> dict[str, Any]:
    """A DeepSeek-V2 config of one decoder layer, as vLLM's Eagle3DeepseekV3ForCausalLM loads it.

    model_type is "deepseek_v2", not "deepseek_v3": with deepseek_v3 vLLM's speculative config
    rewrites the draft into DeepSeek's MTP model and refuses it. n_routed_experts is an int
    because DeepseekV2Config refuses null (the draft layer is dense: vLLM never reads it). No
    head_dim: vLLM sizes MLA heads from the qk/v head dims and caches kv_lora_rank + rope.
    """
    skip = {"aux_layer_ids", "attention", "head_dim", "rope_scaling", "q_lora_rank"}
    skip.add("own_embeddings")  # read from the tensors (load_draft), not from config.json
    skip.add("method")  # eagle_config.method records it (no method that writes it is MLA)
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        **{k: v for k, v in cfg.to_dict().items() if k not in skip},
        "q_lora_rank": cfg.q_lora_rank or None,  # null: q_proj from the input, no q_a/q_b
        "rope_scaling": deepseek_rope_scaling(cfg.rope_scaling),
        "n_routed_experts": 1,
        "norm_before_residual": False,  # eagle3.model's residual: the incoming h
        "attention_bias": False,
    }


def save_draft(
    model: Eagle3Draft,
    out_dir: str | Path,
    *,
    extra_config: dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = DEFAULT_EXPORT_DTYPE,
) -> Path:
    """Write config.json + model.safetensors to out_dir -> out_dir: no embeddings, unless the
    drafter has its own (config.own_embeddings), which are written as vLLM will serve them.

    Float weights are written in `dtype` (default bfloat16, what engines serve; None keeps the
    model's dtype, e.g. for an exact fp32 round trip); d2t (int64) and t2d (bool) keep theirs.
    Aux ids that are not strictly ascending are refused."""
    export = _export_dtype(dtype, model)
    config = checkpoint_config(model, extra_config, dtype=export)  # validates before writing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        key: (value.to(export) if value.is_floating_point() else value)
        .detach()
        .to("cpu")
        .contiguous()
        for key, value in model.state_dict().items()
        if key != EMBED_KEY or model.config.own_embeddings
    }
    if model.config.draft_vocab_size == model.config.vocab_size:
        # the whole target vocab in order: vLLM refuses a d2t beside a full-size lm_head
        del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_config(
    ckpt_dir: str | Path, target_layers: int | None = None
) -> tuple[DraftConfig, dict[str, Any]]:
    """-> (DraftConfig, the config.json dict in this project's keys); Eagle3Error naming any
    missing field. A published drafter's layout (eagle3.published) is read onto ours;
    `target_layers` (the target's decoder layer count) gives the engines' default aux layers
    to a draft that names none."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise Eagle3Error(f"{path} not found: {ckpt_dir} is not a drafter checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise Eagle3Error(f"{path} is not valid JSON ({err}); re-export the checkpoint") from err
    raw = project_config(path, raw, tensor_shapes(ckpt_dir), target_layers)
    architectures = raw.get("architectures") or []
    if ARCHITECTURE in architectures:
        attention = "gqa"
    elif set(MLA_ARCHITECTURES) & set(architectures):
        attention = "mla"
        _check_mla_config(path, raw)
    else:
        raise Eagle3Error(
            f"{path} has architectures={raw.get('architectures')}, expected [{ARCHITECTURE!r}] "
            f"or [{MLA_ARCHITECTURE!r}]: not an EAGLE-3 drafter checkpoint"
        )
    if raw.get("norm_before_residual"):
        raise Eagle3Error(
            f"{path}: norm_before_residual is on, a layer whose residual is hidden_norm(h); this "
            "project's layer keeps the incoming h (eagle3.model), so it would decode another "
            "function than vLLM serves: retrain or re-export without it"
        )
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")  # vLLM convention (project id + 1)
    if aux is None and top is not None:
        aux = [int(i) - 1 for i in top]  # a vLLM/speculators-style config with only that key
    if aux is None:
        raise Eagle3Error(f"{path} lacks eagle_config.eagle_aux_hidden_state_layer_ids")
    aux = check_aux_ids(list(aux), f"{path}: eagle_aux_hidden_state_layer_ids")
    if top is not None and [int(i) for i in top] != vllm_aux_layer_ids(aux):
        raise Eagle3Error(
            f"{path}: top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM, after k "
            f"layers) should be eagle_config's {aux} + 1 = {vllm_aux_layer_ids(aux)}; "
            "re-export the checkpoint"
        )
    values: dict[str, Any] = {
        "aux_layer_ids": aux,
        "attention": attention,
        "method": method_of_published(raw, path).name,
        "own_embeddings": False,  # load_draft decides, from the tensors and the target
    }
    if attention == "mla":
        values["q_lora_rank"] = raw.get("q_lora_rank") or 0
        values["head_dim"] = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    for f in dataclasses.fields(DraftConfig):
        if f.name in values or f.name == "options":  # the method's fields: flat keys, below
            continue
        if f.name in raw:
            values[f.name] = raw[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise Eagle3Error(f"{path} lacks the field {f.name!r}; re-export the checkpoint")
    # every method's, so that make_draft_config refuses another method's set ones
    values.update({name: raw[name] for name in OPTION_FIELDS if name in raw})
    try:
        cfg = make_draft_config(**values)
    except (Eagle3Error, TypeError) as err:
        raise Eagle3Error(f"{path}: {err}; re-export the checkpoint") from err
    layers = method_of(cfg).decoder_layers(cfg)
    if attention == "gqa" and raw.get("num_hidden_layers", 1) != layers:
        raise Eagle3Error(
            f"{path}: num_hidden_layers {raw.get('num_hidden_layers')} but a "
            f"{cfg.method} draft of {layers} layer(s): "
            "only a P-EAGLE drafter (method p-eagle, num_layers) has more than one; re-export it"
        )
    return cfg, raw


def _check_mla_config(path: Path, raw: dict[str, Any]) -> None:
    """What vLLM's Eagle3DeepseekV3ForCausalLM would refuse (or serve as other maths), refused
    here first in one line."""
    problems = []
    if raw.get("model_type") != "deepseek_v2":
        problems.append(
            f"model_type is {raw.get('model_type')!r}, not 'deepseek_v2' (with 'deepseek_v3' "
            "vLLM rewrites the draft into DeepSeek's MTP model and refuses it)"
        )
    if raw.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {raw.get('num_hidden_layers')}, not 1")
    if not isinstance(raw.get("n_routed_experts"), int) or isinstance(
        raw.get("n_routed_experts"), bool
    ):
        problems.append(
            f"n_routed_experts is {raw.get('n_routed_experts')!r}: vLLM's DeepseekV2Config "
            "refuses anything but an int (the dense draft layer never reads it; write 1)"
        )
    missing = [name for name in MLA_FIELDS[1:] if not isinstance(raw.get(name), int)]
    if missing:
        problems.append(f"it lacks the MLA dims {missing}")
    if problems:
        raise Eagle3Error(f"{path}: an MLA drafter vLLM would not serve as trained: {problems[0]}")


def _check_fc_norm(weights: Path, cfg: DraftConfig, state: dict[str, torch.Tensor]) -> None:
    """fc_norm's flag and tensors agree: vLLM skips fc_norm.* weights whose flag is off (plain
    EAGLE-3 served for an EAGLE-3.1 drafter) and fails on a flag without weights."""
    has = any(key.startswith("fc_norm.") for key in state)
    if has and not cfg.options.fc_norm:
        raise Eagle3Error(
            f"{weights} has fc_norm.* weights but config.json says fc_norm: false: vLLM would "
            "ignore them and serve plain EAGLE-3; set fc_norm (and norm_output) true for an "
            "EAGLE-3.1 drafter, or re-export"
        )
    if cfg.options.fc_norm and not has:
        raise Eagle3Error(
            f"{weights} has no fc_norm.* weights but config.json says fc_norm: true; "
            "re-export the checkpoint (or set fc_norm: false if it was trained without)"
        )


def _check_method_tensors(weights: Path, cfg: DraftConfig, state: dict) -> None:
    """config.json's method and the tensors agree, else one line: a P-EAGLE file read as
    EAGLE-3 (or the reverse) would serve other maths than it was trained for."""
    own = method_of(cfg).own_tensors
    for key, owner in METHOD_TENSORS.items():
        if (key in state) != (key in own):
            raise Eagle3Error(
                f"{weights.parent}: config.json says method {cfg.method!r} but the weights "
                + ("lack" if key in own else "carry")
                + f" {key!r} ({owner.name}'s): the config and weights are of different "
                "drafters; re-export the checkpoint"
            )
    layers = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
    count = method_of(cfg).decoder_layers(cfg)
    if layers != set(range(1, count)):
        raise Eagle3Error(
            f"{weights.parent}: config.json has num_hidden_layers {count} but the "
            f"weights hold decoder layers {sorted({0} | layers)}; re-export the checkpoint"
        )


def _same_embeddings(file_embed: torch.Tensor, target_embed: torch.Tensor) -> bool:
    """Equal up to a bf16 rounding of either (exports are bf16; vLLM compares the two as served,
    in one dtype, with torch.equal), every row, EMBED_CHUNK rows at a time: a Kimi-size matrix
    compared whole would cost several GB more on every rank."""
    if file_embed.shape != target_embed.shape:
        return False
    target = target_embed.detach()
    for start in range(0, file_embed.shape[0], EMBED_CHUNK):
        a = file_embed[start : start + EMBED_CHUNK].float().cpu()
        b = target[start : start + EMBED_CHUNK].float().cpu()
        if not torch.allclose(a, b, rtol=1e-2, atol=1e-3):
            return False
    return True


def _own_embeddings(
    weights: Path, cfg: DraftConfig, file_embed: torch.Tensor | None, target: torch.Tensor | None
) -> bool:
    """Whether the drafter keeps the file's embed_tokens as its own, as vLLM 0.32 decides
    (llm_base_proposer.py, `_maybe_share_embeddings`): a draft with embed_tokens keeps them
    unless they equal the target's. Without a target to compare with, a file's are kept (a
    re-export carries them; vLLM shares them again if they are the target's). Embeddings that
    cannot be reconciled with the config or the target are refused in one line."""
    if file_embed is None:
        return False
    want = (cfg.vocab_size, cfg.hidden_size)
    if tuple(file_embed.shape) != want:
        raise Eagle3Error(
            f"{weights}: embed_tokens.weight has shape {tuple(file_embed.shape)} but config.json "
            f"implies {want} (vocab_size x hidden_size); re-export the checkpoint"
        )
    if target is None:
        return True
    if tuple(target.shape) != want:
        raise Eagle3Error(
            f"{weights}: target embeddings have shape {tuple(target.shape)}, the drafter's own "
            f"embed_tokens {want}: the drafter was built for another target; use its own target"
        )
    own = not _same_embeddings(file_embed, target)
    if own:  # what vLLM logs as "distinct embed_tokens weights"
        log.info("%s: embed_tokens differ from the target's: the drafter keeps its own", weights)
    return own


def load_draft(
    ckpt_dir: str | Path,
    *,
    embed_weight: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    target_layers: int | None = None,
) -> Eagle3Draft:
    """Rebuild the drafter from a checkpoint directory: ours, or a published layout
    (eagle3.published; `target_layers` as for load_config).

    `embed_weight` is the target's embedding matrix [V, H] (`Target.embed_weight` or
    `eagle3.targets.load_embeddings`). A file's own embed_tokens.weight that differs from it
    (or any, without it) is kept instead, frozen (config.own_embeddings), as vLLM serves it,
    and save_draft exports it; one equal to it is the target's. Without either the embeddings
    stay randomly initialised, which is only good for inspecting the weights. `dtype` casts the float weights
    (None: the checkpoint's `torch_dtype`; exports are bf16 by default, so pass torch.float32 to
    train on); the target's embeddings are copied after the cast, unrounded.
    Missing, unexpected or mis-shaped tensors raise Eagle3Error naming the tensor.
    """
    cfg, raw = load_config(ckpt_dir, target_layers)
    weights = Path(ckpt_dir) / WEIGHTS_FILE
    file_dtype = getattr(torch, raw.get("torch_dtype") or "float32")
    state = project_state(read_tensors(ckpt_dir), cfg.vocab_size, cfg.draft_vocab_size, weights)
    file_embed = state.pop(EMBED_KEY, None)  # some exporters include it
    own = _own_embeddings(weights, cfg, file_embed, embed_weight)
    cfg = dataclasses.replace(cfg, own_embeddings=own)
    model = draft_for(cfg).to(file_dtype)
    expected = {k: v for k, v in model.state_dict().items() if k != EMBED_KEY}
    _check_fc_norm(weights, cfg, state)
    _check_method_tensors(weights, cfg, state)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise Eagle3Error(f"{weights} is missing tensor {missing[0]!r} (missing: {missing})")
    unexpected = sorted(state.keys() - expected.keys())
    if unexpected:
        raise Eagle3Error(f"{weights} has unexpected tensor {unexpected[0]!r} (all: {unexpected})")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise Eagle3Error(
                f"{weights}: tensor {key!r} has shape {tuple(tensor.shape)} but config.json "
                f"implies {tuple(expected[key].shape)}"
            )
    if own:
        state[EMBED_KEY] = file_embed
    model.load_state_dict(state, strict=False)
    if dtype is not None:
        model = model.to(_export_dtype(dtype, model))  # float tensors only; d2t/t2d keep theirs
    if embed_weight is not None and not own:
        model.set_embeddings(embed_weight)
    return model.to(device) if device is not None else model
