"""The target registry (eagle3/targets/registry_entries/<name>.yaml, package data) and `resolve`: a registry
name, a HF directory, a .gguf or a hub id -> ResolvedTarget, what every loader takes."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eagle3.errors import Eagle3Error
from eagle3.targets.gguf import find_gguf, gguf_to_hf, packaged_gguf

log = logging.getLogger("eagle3.targets")

TARGETS_DIR = Path(__file__).resolve().parent / "registry_entries"  # package data


def registry_names() -> list[str]:
    """Short target names with a eagle3/targets/registry_entries/<name>.yaml."""
    return sorted(p.stem for p in TARGETS_DIR.glob("*.yaml"))


def target_spec(name: str) -> dict[str, Any]:
    """The registry entry for `name` (eagle3/targets/registry_entries/<name>.yaml) as a dict."""
    path = TARGETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise Eagle3Error(
            f"unknown target {name!r}: no {path}; known targets: {', '.join(registry_names())} "
            "(or pass a HF model directory or a .gguf file)"
        )
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or "source" not in spec:
        raise Eagle3Error(
            f"{path} has no 'source' section; see eagle3/targets/registry_entries/*.yaml for the format"
        )
    return spec


def default_aux_layers(num_layers: int) -> list[int]:
    """[1, L//2 - 1, L - 4] (low / middle / high), clamped into [0, L-1] for tiny models."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


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
_SIZED_FACTS = ("aux_layer_ids", "plan_shape", "served_weights_gb", "engine_startup_timeout_s")


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
        gguf = find_gguf(path)
        if gguf is not None:
            return ResolvedTarget(gguf.stem, str(gguf_to_hf(gguf)[0]))
        spec = match_registry(_config_json(path / "config.json"))
        return ResolvedTarget(spec["name"] if spec else path.name, str(path), spec)
    if "/" not in raw and "\\" not in raw:
        spec = target_spec(raw)
        source = spec["source"]
        if "gguf_file" in source:
            return ResolvedTarget(spec["name"], str(gguf_to_hf(packaged_gguf(source))[0]), spec)
        return ResolvedTarget(spec["name"], source["hf_path"], spec)
    if raw.startswith((".", "/", "~")) or raw.endswith(".gguf"):
        raise Eagle3Error(f"target path {raw} does not exist")
    return ResolvedTarget(raw, raw)  # a hub id such as moonshotai/Kimi-K2.5
