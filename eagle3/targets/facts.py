"""A target known from its files, no weight loaded: its tokenizer, its transformers config, the
facts every command reads from config.json (target_facts), and TargetFiles for engine-only use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.targets.registry import ResolvedTarget, resolve
from eagle3.targets.tokenizer import load_tokenizer


def load_hf_config(target: str | os.PathLike | ResolvedTarget):
    """The target's transformers config (remote code where its registry entry says)."""
    from transformers import AutoConfig

    t = resolve(target)
    return AutoConfig.from_pretrained(t.hf_dir, trust_remote_code=t.remote_code)


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
