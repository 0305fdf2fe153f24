"""The target model: loading (registry name, HF dir, GGUF) and aux hidden-state capture.

The registry is eagle3/targets/registry_entries/<name>.yaml, one entry per known target, shipped
inside the package (an installed wheel resolves its targets by name too). `TargetModel` is what
every user of a target relies on, whether its forwards run in this process (`Target`) or in a
vLLM engine (eagle3.engine.served_target.ServedTarget): ask `target.served`, never the class.

Aux convention (SGLang's): `aux_layer_ids` are 0-based decoder-layer indices whose OUTPUT is
taken, i.e. HF `output_hidden_states[id + 1]`. `Target.capture` hooks exactly those layers and
runs the base model (no lm_head, no list of all L hidden states), so memory stays at one
layer's activations plus the three captured ones even for a 61-layer target.

GGUF targets (the embedded default `smollm2-135m-q4`) are de-quantized by `transformers` once
(~20 s; the values stay exactly on the 4-bit grid) and cached as a plain HF directory under
`${EAGLE3_CACHE:-~/.cache/eagle3}/targets/`, so later loads take about a second.

Modules: ``registry`` (the registry, ResolvedTarget, resolve), ``gguf`` (conversion and its
cache), ``facts`` (config and facts without weights, TargetFiles), ``tokenizer`` (load_tokenizer:
the registry's class checked; the fingerprint shards and drafters record), ``in_process``
(TargetModel, Target, the capture hooks), ``loading`` (load_target), ``weights`` (lm_head,
embeddings and the final norm read alone), ``fit`` (weights against device memory),
``generation`` (the KV cache across transformers versions, EOS ids).
"""

from eagle3.targets.facts import (
    TargetFiles,
    describe_target,
    load_hf_config,
    target_facts,
)
from eagle3.targets.fit import check_fits, device_memory_bytes, weight_file_bytes
from eagle3.targets.generation import (
    cache_kwarg,
    eos_token_ids,
    keep_cache_entries,
    new_cache,
    output_cache,
)
from eagle3.targets.gguf import cache_root, gguf_to_hf
from eagle3.targets.in_process import (
    Target,
    TargetModel,
    capture_outputs,
    check_context,
    decoder_of,
)
from eagle3.targets.loading import load_target
from eagle3.targets.registry import (
    TARGETS_DIR,
    ResolvedTarget,
    default_aux_layers,
    match_registry,
    registry_names,
    resolve,
    target_spec,
)
from eagle3.targets.tokenizer import (
    PROBE_TEXT,
    check_fingerprint,
    check_tokenizer_class,
    find_tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)
from eagle3.targets.weights import load_embeddings, load_final_norm, load_lm_head, rms_norm

__all__ = [
    "PROBE_TEXT",
    "TARGETS_DIR",
    "ResolvedTarget",
    "Target",
    "TargetFiles",
    "TargetModel",
    "cache_kwarg",
    "cache_root",
    "capture_outputs",
    "check_context",
    "check_fingerprint",
    "check_fits",
    "check_tokenizer_class",
    "decoder_of",
    "default_aux_layers",
    "describe_target",
    "device_memory_bytes",
    "eos_token_ids",
    "find_tokenizer",
    "gguf_to_hf",
    "keep_cache_entries",
    "load_embeddings",
    "load_final_norm",
    "load_hf_config",
    "load_lm_head",
    "load_target",
    "load_tokenizer",
    "match_registry",
    "new_cache",
    "output_cache",
    "registry_names",
    "resolve",
    "rms_norm",
    "target_facts",
    "target_spec",
    "tokenizer_fingerprint",
    "weight_file_bytes",
]
