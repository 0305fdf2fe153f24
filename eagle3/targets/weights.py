"""Single matrices of a target read alone from its safetensors, the model never built: lm_head,
embeddings, the final norm (and rms_norm to apply it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error
from eagle3.targets.facts import target_facts
from eagle3.targets.registry import ResolvedTarget, resolve


def _hf_file(hf_dir: str, filename: str) -> Path | None:
    """A file of a local HF dir or hub repo (downloaded alone); None if the repo lacks it."""
    local = Path(hf_dir)
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(hf_dir, filename))
    except EntryNotFoundError:
        return None


def _weight_files(hf_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file name, from the index or the single model.safetensors."""
    index = _hf_file(hf_dir, "model.safetensors.index.json")
    if index is not None:
        return json.loads(index.read_text())["weight_map"]
    single = _hf_file(hf_dir, "model.safetensors")
    if single is None:
        raise Eagle3Error(
            f"{hf_dir} has no model.safetensors(.index.json); is it a HF model directory?"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def _read_tensor(name_or_path: str | os.PathLike | ResolvedTarget, which: str) -> torch.Tensor:
    hf_dir = resolve(name_or_path).hf_dir
    config_path = _hf_file(hf_dir, "config.json")
    config = json.loads(config_path.read_text()) if config_path else {}
    tied = config.get(
        "tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")
    )
    weight_map = _weight_files(hf_dir)
    suffixes = ["embed_tokens.weight"]
    if which == "lm_head" and not tied:  # tied unknown (None): lm_head if saved, else embeddings
        suffixes = (
            ["lm_head.weight"] if tied is False else ["lm_head.weight", "embed_tokens.weight"]
        )
    # Shortest match first: "model.embed_tokens.weight" beats an MTP layer's copy.
    for suffix in suffixes:
        keys = sorted((k for k in weight_map if k.endswith(suffix)), key=len)
        if keys:
            break
    else:
        raise Eagle3Error(f"{hf_dir} holds no tensor named *{suffixes[0]}; is it a causal LM?")
    from safetensors import safe_open

    with safe_open(_hf_file(hf_dir, weight_map[keys[0]]), framework="pt") as f:
        return f.get_tensor(keys[0])


def load_lm_head(name_or_path: str | os.PathLike | ResolvedTarget) -> torch.Tensor:
    """The target's lm_head matrix [V, H] (the embeddings when tied), read alone from the
    safetensors (one shard for sharded checkpoints); the model is never built."""
    return _read_tensor(name_or_path, "lm_head")


def load_embeddings(name_or_path: str | os.PathLike | ResolvedTarget) -> torch.Tensor:
    """The target's input embeddings [V, H] (the drafter's frozen embed_tokens)."""
    return _read_tensor(name_or_path, "embed")


def load_final_norm(
    name_or_path: str | os.PathLike | ResolvedTarget,
) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm (weight [H], eps), read alone from the safetensors: what
    turns a pre-norm last hidden state (vLLM's id num_hidden_layers) into lm_head's input."""
    hf_dir = resolve(name_or_path).hf_dir
    weight_map = _weight_files(hf_dir)
    # the decoder's own norm, not a layer's (model.layers.N.*norm) nor an MTP/vision copy
    keys = sorted(
        (k for k in weight_map if k.endswith("norm.weight") and ".layers." not in k),
        key=lambda k: (not k.endswith("model.norm.weight"), not k.endswith(".norm.weight"), len(k)),
    )
    if not keys:
        raise Eagle3Error(f"{hf_dir} holds no final norm (*.norm.weight); is it a causal LM?")
    from safetensors import safe_open

    with safe_open(_hf_file(hf_dir, weight_map[keys[0]]), framework="pt") as f:
        weight = f.get_tensor(keys[0])
    config = target_facts(name_or_path)["hf_config"]
    return weight, float(getattr(config, "rms_norm_eps", 1e-6))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (computed in fp32, as transformers' LlamaRMSNorm does)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * h.to(x.dtype).float()
