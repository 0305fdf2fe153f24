"""Drafters as other trainers publish them, read onto this project's checkpoint format.

eagle3.checkpoint reads a checkpoint directory through two functions of this module:
`project_config` turns the config.json of any accepted layout into the config this project
writes (eagle3.checkpoint's docstring), and `project_state` does the same for the tensors. Our
own exports (is_ours) pass through unchanged, and a re-export of a drafter loaded from any
layout writes our format (eagle3.checkpoint.save_draft).

Layouts accepted (read from the trainers' and vLLM 0.32's sources):
- SpecForge's and other SGLang-format exports: our layout without our own keys (no
  `eagle_config.method`; `draft_vocab_size`, `d2t`/`t2d` and `eagle_config` as they wrote them).
- TorchSpec's Llama head (lightseekorg/kimi-k2.5-eagle3): `LlamaForCausalLMEagle3` with no
  `draft_vocab_size`, `target_hidden_size` or `eagle_config`; its own rope (theta, YaRN);
  `embed_tokens.weight` in the file; the whole target vocab with no `d2t`/`t2d`.
- TorchSpec's MLA head (lightseekorg/kimi-k2.5-eagle3-mla): `Eagle3DeepseekV2ForCausalLM` (or
  V3), `model_type` "kimi_k2" (served by vLLM as the same function as "deepseek_v2", which our
  re-export writes), `mla_use_nope` (either value: see below), and in `eagle_config` ModelOpt's
  layer switches beside the aux ids; its own `embed_tokens`; optionally a reduced vocab
  (`draft_vocab_size`, `d2t`, maybe no `t2d`).
- vLLM-renamed tensors: `layers.0.*` for the one decoder layer (TorchSpec's `--vllm`,
  speculators) instead of `midlayer.*`.
- speculators (vLLM's trainer): `architectures: ["Eagle3DraftModel"]`, the layer's Llama config
  in `transformer_layer_config` (defaults omitted: read through transformers' LlamaConfig), and
  `draft_vocab_size`, `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`,
  `eagle_aux_hidden_state_layer_ids` at the top level.
- save_pretrained's sharded files: `model.safetensors.index.json` and its shards.

Aux layer ids, into the project's convention (output of decoder layer k = HF hidden_states[k+1]):
- the top-level `eagle_aux_hidden_state_layer_ids` (speculators, vLLM-style exports): vLLM's ids
  (after k layers), minus 1, as for our own exports;
- `eagle_config`'s ids beside `midlayer.*` tensors: SGLang's convention, which is ours (TorchSpec
  trains on them; SGLang adds 1 when it captures);
- `eagle_config`'s ids beside `layers.0.*` tensors of a kimi_k2 draft: TorchSpec's `--vllm`
  export added 1 to them (tools/convert_to_hf.py), so they are vLLM's: minus 1;
- `eagle_config`'s ids beside `layers.0.*` of any other draft: nothing says which convention;
  refused, asking for the top-level key in vLLM's;
- no ids at all: the engines' default, vLLM's (2, L//2, L-3) after-k-layers ids (SGLang's and
  speculators' are the same layers), i.e. project ids [1, L//2 - 1, L - 4] of the target's L
  layers; the caller passes L (`target_layers`), else it is refused.

Keys read as the trainer that wrote them and the engine that serves them read them:
- `mla_use_nope` is inert in an EAGLE-3 MLA draft. TorchSpec writes it true
  (configs/draft_models/kimi_k3_eagle3_mla.json), but its draft layer
  (torchspec/models/draft/deepseek_eagle.py, `DeepSeekMLAAttention._apply_rope_and_assemble`)
  applies DeepSeek's interleaved rope to the qk_rope dims whatever it says, and vLLM 0.32's
  Eagle3DeepseekV2ForCausalLM (model_executor/models/deepseek_eagle3.py, on deepseek_v2.py's
  DeepseekV2MLAAttention) never reads it (only the Kimi-Linear and K3 configs do,
  transformers_utils/configs/kimi_linear.py, k3_dspark.py). eagle3.model's MLA layer applies
  that same rope; the key is dropped.
- `embed_tokens.weight` in the file: vLLM 0.32 keeps a draft's own embed_tokens unless they
  equal the target's (v1/spec_decode/llm_base_proposer.py, `_maybe_share_embeddings`:
  torch.equal, else "distinct embed_tokens weights. Keeping separate"), and so does
  eagle3.checkpoint.load_draft (DraftConfig.own_embeddings: frozen, and exported), so the
  drafter measured, fine-tuned and re-exported is the one vLLM serves from the same directory.
  speculators' `embed_requires_grad` (its embeddings were trained) is inert for the same reason.

Anything that would be read as other maths than eagle3.model computes is refused in one line
naming the key: a layer switch of another value than our layer's (LAYER_SWITCHES),
`norm_before_fc` (one norm over the concatenated aux states), biases, a layer config other than
Llama's (speculators' Qwen3 layer normalises q and k), more than one layer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.errors import Eagle3Error
from eagle3.rope import target_rope

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # save_pretrained's shards
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
OUR_LAYER = "midlayer."
VLLM_LAYER = "layers.0."  # vLLM's name for the one decoder layer
# ModelOpt's eagle_config switches (TorchSpec's MLA config carries them) and the value that is
# our layer: input_layernorm on the embeddings, norm before lm_head, no MTP-style extra norms;
# use_aux_hidden_state false would be the EAGLE-1/2 feature, which no engine serves with ids
LAYER_SWITCHES = {
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
    "use_aux_hidden_state": True,
}


def is_ours(raw: dict[str, Any]) -> bool:
    """A config.json this project wrote: its exports record eagle_config.method and, top-level,
    every DraftConfig field (`feature` among them, and its method's sub-config's), which no other
    trainer writes."""
    return "method" in (raw.get("eagle_config") or {}) or "feature" in raw


def engine_default_aux_ids(num_layers: int) -> list[int]:
    """The layers vLLM, SGLang and speculators capture for a draft naming none, as project ids:
    vLLM's (2, L//2, L-3) after-k-layers ids, minus 1."""
    return [i - 1 for i in (2, num_layers // 2, num_layers - 3)]


# -- files -----------------------------------------------------------------------------------
def _weight_files(ckpt_dir: Path) -> dict[str, Path]:
    """tensor name -> the file holding it: model.safetensors, else the index's shards."""
    single = ckpt_dir / WEIGHTS_FILE
    index = ckpt_dir / INDEX_FILE
    if single.is_file():
        return {name: single for name in _keys(single)}
    if not index.is_file():
        raise Eagle3Error(f"{single} not found: the checkpoint is incomplete; re-export it")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise Eagle3Error(f"{index} has no readable weight_map ({err}); re-save it") from err
    files = {name: ckpt_dir / shard for name, shard in weight_map.items()}
    missing = sorted({str(f) for f in files.values() if not f.is_file()})
    if missing:
        raise Eagle3Error(f"{index} names shard {missing[0]}, which is not there; copy it")
    return files


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise Eagle3Error(f"{file} cannot be read ({err}); re-export the checkpoint") from err


def tensor_shapes(ckpt_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers only (single file or shards)."""
    shapes = {}
    files = _weight_files(Path(ckpt_dir))
    for file in sorted(set(files.values())):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if files.get(name) == file:
                        shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types for a corrupt header
            raise Eagle3Error(f"{file} cannot be read ({err}); re-export the checkpoint") from err
    return shapes


def read_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (single file or shards), as stored."""
    files = _weight_files(Path(ckpt_dir))
    state = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(str(file), framework="pt") as f:
                state.update({k: f.get_tensor(k) for k in f.keys() if files.get(k) == file})
        except Exception as err:  # a truncated file fails on its first tensor
            raise Eagle3Error(f"{file} cannot be read ({err}); re-export the checkpoint") from err
    return state


# -- config.json ---------------------------------------------------------------------------
def project_config(
    path: Path,
    raw: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    target_layers: int | None = None,
) -> dict[str, Any]:
    """config.json of any accepted layout (module docstring) -> the config this project writes;
    our own unchanged. `shapes` are the tensors' (tensor_shapes); `target_layers` the target's
    decoder layer count, needed only for a draft that names no aux layers."""
    if is_ours(raw):
        return raw
    out = copy.deepcopy(raw)
    if SPECULATORS_ARCHITECTURE in (raw.get("architectures") or []):
        out = _from_speculators(path, raw)
    _refuse_other_maths(path, out)
    aux = _project_aux_ids(path, out, shapes, target_layers)
    if out.get("model_type") == "kimi_k2":  # vLLM serves kimi_k2 and deepseek_v2 alike
        out["model_type"] = "deepseek_v2"
    out.pop("mla_use_nope", None)  # inert in a draft layer (module docstring)
    if "kv_lora_rank" in out:  # the MLA head: its dense layer never reads the expert count
        out.setdefault("n_routed_experts", 1)
        out.setdefault("num_key_value_heads", out.get("num_attention_heads"))
    lm_head, fc = shapes.get("lm_head.weight"), shapes.get("fc.weight")
    if "draft_vocab_size" not in out and lm_head is not None:
        out["draft_vocab_size"] = lm_head[0]  # TorchSpec's Llama config: the whole vocab
    if "target_hidden_size" not in out and fc is not None:
        out["target_hidden_size"] = fc[1] // 3  # fc fuses 3 aux states
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    out.pop("eagle_aux_hidden_state_layer_ids", None)  # now in eagle_config, in our convention
    return out


def _project_aux_ids(
    path: Path, raw: dict[str, Any], shapes: dict[str, Any], target_layers: int | None
) -> list[int]:
    """The aux ids in the project's convention, by the rules of the module docstring."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_named = any(k.startswith(VLLM_LAYER) for k in shapes) and not any(
        k.startswith(OUR_LAYER) for k in shapes
    )
    if top and ids and [int(i) + 1 for i in ids] != [int(i) for i in top]:
        raise Eagle3Error(
            f"{path}: top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM, after k "
            f"layers) and eagle_config's {list(ids)} (SGLang, output of layer k) name different "
            "layers; keep the one the drafter was trained on"
        )
    if top:
        return [int(i) - 1 for i in top]
    if ids and not vllm_named:
        return [int(i) for i in ids]
    if ids and raw.get("model_type") == "kimi_k2":  # TorchSpec's --vllm export added 1
        return [int(i) - 1 for i in ids]
    if ids:
        raise Eagle3Error(
            f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)} beside "
            "layers.0.* tensors of a non-kimi_k2 draft: nothing says whether they are SGLang's "
            "(output of layer k) or vLLM's (after k layers); write them as the top-level "
            "eagle_aux_hidden_state_layer_ids in vLLM's convention"
        )
    if target_layers is None:
        raise Eagle3Error(
            f"{path} names no eagle_aux_hidden_state_layer_ids: the engines' default layers "
            "depend on the target's layer count; load it with its target"
        )
    return engine_default_aux_ids(target_layers)


def _refuse_other_maths(path: Path, raw: dict[str, Any]) -> None:
    """One line naming the first key that would make this layer compute other maths than
    eagle3.model (the module docstring)."""
    eagle = raw.get("eagle_config") or {}
    for key, ours in LAYER_SWITCHES.items():
        if key in eagle and bool(eagle[key]) != ours:
            raise Eagle3Error(
                f"{path}: eagle_config.{key} is {eagle[key]!r}; this project's draft layer is "
                f"{key}: {str(ours).lower()}, so it would compute another function"
            )
    problems = {
        "norm_before_fc": "one RMSNorm over the concatenated aux states; ours has none "
        "(or EAGLE-3.1's fc_norm, one per state)",
        "attention_bias": "biased q/k/v/o projections; ours have none",
        "mlp_bias": "biased MLP projections; ours have none",
    }
    for key, why in problems.items():
        if raw.get(key):
            raise Eagle3Error(f"{path}: {key} is {raw[key]!r}: {why}; it cannot be loaded")


def _from_speculators(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """speculators' Eagle3DraftModel config -> a Llama-head config in our keys."""
    from transformers import LlamaConfig  # only for a speculators config

    kind = raw.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise Eagle3Error(
            f"{path}: speculators_model_type is {kind!r}; only speculators' eagle3 drafts load here"
        )
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise Eagle3Error(
            f"{path}: transformer_layer_config.model_type is {layer.get('model_type')!r}; this "
            "project's draft layer is Llama's (a qwen3 layer also normalises q and k)"
        )
    if layer.get("num_hidden_layers", 1) != 1:
        raise Eagle3Error(
            f"{path}: transformer_layer_config.num_hidden_layers is "
            f"{layer['num_hidden_layers']}; only one-layer EAGLE-3 drafts load here"
        )
    # speculators writes the layer config's diff against LlamaConfig's defaults
    llama = LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})
    theta, scaling = target_rope(llama)
    heads = llama.num_attention_heads
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": llama.hidden_size,
        "intermediate_size": llama.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": llama.num_key_value_heads or heads,
        "head_dim": getattr(llama, "head_dim", None) or llama.hidden_size // heads,
        "vocab_size": llama.vocab_size,
        "rms_norm_eps": llama.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": llama.max_position_embeddings,
        "hidden_act": llama.hidden_act,
        "attention_bias": llama.attention_bias,
        "mlp_bias": llama.mlp_bias,
        "torch_dtype": raw.get("torch_dtype") or raw.get("dtype") or "float32",
    }
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        out[key] = bool(raw.get(key, False))
    if out.get("target_hidden_size") is None:
        out.pop("target_hidden_size", None)  # speculators' fc is 3 x the layer's width
    return out


# -- tensors ---------------------------------------------------------------------------------
def project_state(
    state: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int, where: Path
) -> dict[str, torch.Tensor]:
    """Tensors of any accepted layout -> our names: `layers.0.*` -> `midlayer.*` (when there is
    no midlayer), a full-vocab draft's missing d2t / t2d as the identity, a missing t2d rebuilt
    from d2t. embed_tokens.weight is kept (eagle3.checkpoint.load_draft decides whose)."""
    state = dict(state)
    if not any(k.startswith(OUR_LAYER) for k in state):
        state = {
            (OUR_LAYER + k[len(VLLM_LAYER) :] if k.startswith(VLLM_LAYER) else k): v
            for k, v in state.items()
        }
    if "d2t" not in state:
        if draft_vocab_size != vocab_size:
            raise Eagle3Error(
                f"{where} has no d2t but a reduced draft vocab (draft_vocab_size "
                f"{draft_vocab_size} < vocab_size {vocab_size}): its lm_head rows cannot be "
                "mapped to target tokens; re-export it with its d2t"
            )
        state["d2t"] = torch.zeros(vocab_size, dtype=torch.long)  # the whole vocab, in order
    state["d2t"] = state["d2t"].long()
    if "t2d" not in state:  # TorchSpec and vLLM need only d2t
        draft_ids = state["d2t"] + torch.arange(state["d2t"].numel())
        if int(draft_ids.max()) >= vocab_size or int(draft_ids.min()) < 0:
            raise Eagle3Error(
                f"{where}: d2t maps draft ids outside the target vocab of {vocab_size}; "
                "it is not a draft vocab for this config"
            )
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        state["t2d"] = t2d
    return state


def vocab_offsets(ckpt_dir: str | Path) -> torch.Tensor:
    """The checkpoint's d2t (target id = draft id + d2t[draft id]) in any accepted layout;
    a full-vocab draft, written without one, maps every id to itself."""
    ckpt = Path(ckpt_dir)
    files = _weight_files(ckpt)
    if "d2t" in files:
        with safe_open(str(files["d2t"]), framework="pt") as f:
            return f.get_tensor("d2t").long()
    raw = json.loads((ckpt / CONFIG_FILE).read_text()) if (ckpt / CONFIG_FILE).is_file() else {}
    vocab = raw.get("vocab_size") or (raw.get("transformer_layer_config") or {}).get("vocab_size")
    rows = tensor_shapes(ckpt).get("lm_head.weight", (None,))[0]
    if vocab is None or rows != vocab:
        raise Eagle3Error(
            f"{ckpt} has no d2t and its lm_head has {rows} rows, not the target vocab "
            f"{vocab}: its draft vocab cannot be read; re-export it with its d2t"
        )
    return torch.zeros(int(vocab), dtype=torch.long)
