"""Loading a target into this process (load_target): dtype and device, the Auto class its
checkpoint declares, and every load failure as a one-line Eagle3Error."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from eagle3.compute import matmul_dtype
from eagle3.errors import Eagle3Error
from eagle3.targets.in_process import Target
from eagle3.targets.registry import ResolvedTarget, resolve
from eagle3.targets.tokenizer import find_tokenizer

log = logging.getLogger("eagle3.targets")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_model(name_or_path: str | os.PathLike, hf_dir: str, kwargs: dict[str, Any]):
    """from_pretrained through the Auto class the checkpoint declares: AutoModelForCausalLM, or
    AutoModelForImageTextToText for a vision-language wrapper around the text model (Kimi-K2.5's
    KimiK25ForConditionalGeneration; its INT4 experts go through compressed-tensors either
    way). Any failure becomes a one-line Eagle3Error that says what to do."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    def fail(err: Exception, hint: str) -> Eagle3Error:
        first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
        return Eagle3Error(
            f"cannot load target {name_or_path}: {first or type(err).__name__}; {hint}"
        )

    upgrade = (
        f"transformers {transformers.__version__} does not know it: upgrade transformers "
        "(Kimi-K2.5 needs >= 5.24) or set trust_remote_code: true in its eagle3/targets/registry_entries entry"
    )
    if Path(hf_dir).is_dir() and not (Path(hf_dir) / "config.json").is_file():
        raise Eagle3Error(
            f"cannot load target {name_or_path}: {hf_dir} has no config.json; pass a HF model "
            "directory, a .gguf file or a registry name"
        )
    remote = bool(kwargs.get("trust_remote_code"))
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=remote)
    except OSError as err:
        hint = "pass a HF model directory with a valid config.json, or a hub id reachable here"
        raise fail(err, hint) from err
    except (ValueError, KeyError) as err:
        raise fail(err, upgrade) from err
    except Exception as err:  # remote code runs here; its error stays chained as __cause__
        raise fail(err, "its remote config code failed (the full error is chained)") from err
    model_type, auto_map = getattr(config, "model_type", None), getattr(config, "auto_map", {})
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        remote and "AutoModelForCausalLM" in (auto_map or {})
    ):
        auto = AutoModelForCausalLM
    elif model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or (
        remote and "AutoModelForImageTextToText" in (auto_map or {})
    ):
        auto = AutoModelForImageTextToText
    else:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures"
        raise Eagle3Error(
            f"cannot load target {name_or_path}: model type {model_type!r} ({archs}) is not a "
            f"causal LM nor a vision-language wrapper; {upgrade}"
        )
    try:
        model = auto.from_pretrained(hf_dir, config=config, **kwargs)
    except ImportError as err:  # e.g. INT4 weights without compressed-tensors
        hint = "install the package it names (Kimi-K2.5: pip install 'eagle3-forge[kimi]')"
        raise fail(err, hint) from err
    except OSError as err:
        hint = "the directory needs its safetensors next to config.json (re-download or re-make it)"
        raise fail(err, hint) from err
    except Exception as err:  # shape mismatch, bad quantization_config, remote code, ...
        hint = "its config.json and weights do not fit together (the full error is chained)"
        raise fail(err, hint) from err
    # compressed-tensors de-quantises INT4 weights in their scale dtype (bf16) whatever dtype
    # was asked for; upcast those (exactly) so an fp32 target computes in fp32 throughout.
    dtype = kwargs.get("dtype")
    for param in model.parameters():
        if dtype is not None and param.is_floating_point() and param.itemsize < dtype.itemsize:
            param.data = param.data.to(dtype)
    return model


def load_target(
    name_or_path: str | os.PathLike | ResolvedTarget,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: str | dict | None = None,
    aux_layer_ids: list[int] | None = None,
) -> Target:
    """Load a target by registry name, HF model directory (or hub id), .gguf file, or a
    directory holding exactly one .gguf. dtype defaults to fp32 on CPU and bf16 on CUDA (a
    half type on a CPU without native support for it computes in fp32: eagle3.compute);
    `device_map` (e.g. "auto") is passed to from_pretrained for multi-GPU targets. A
    vision-language wrapper (Kimi-K2.5) loads whole; its aux ids index the text decoder's
    layers. Every load failure is a one-line Eagle3Error."""
    t = resolve(name_or_path)
    if device_map is None:
        device = torch.device(device) if device is not None else default_device()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        on_cuda = device_map is not None or (device is not None and device.type == "cuda")
        dtype = torch.bfloat16 if on_cuda else torch.float32
    elif device_map is None and matmul_dtype(dtype, device) != dtype:
        # the weights are the arithmetic here: a half type this CPU only emulates runs 4-40x
        # slower than float32 (eagle3.compute), so it computes in float32 and says so
        log.warning("%s asked for; this CPU has no native %s: computing in float32", dtype, dtype)
        dtype = matmul_dtype(dtype, device)
    if aux_layer_ids is None and t.spec is not None:
        aux_layer_ids = t.spec.get("aux_layer_ids")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if t.remote_code:
        kwargs["trust_remote_code"] = True
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = _load_model(t.hf_dir if name_or_path is t else name_or_path, t.hf_dir, kwargs)
    if device_map is None:
        model.to(device)
    # Kimi-K2.5's model is native in transformers, its tiktoken tokenizer remote code
    tokenizer = find_tokenizer(t)  # None: Target.tokenizer is None
    return Target(model, tokenizer, name=t.name, aux_layer_ids=aux_layer_ids, spec=t.spec)
