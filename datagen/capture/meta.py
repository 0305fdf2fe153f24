"""What a capture's meta.json records: the target and the rendering (a resume must match them),
the command that resumes it, and the records' sources and origins (provenance)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from datagen.render import Item, Rendering
from eagle3.data.shards import bytes_per_token, check_meta, finalize, read_meta, target_meta
from eagle3.data.windows import record_of
from eagle3.targets import ResolvedTarget, TargetModel, tokenizer_fingerprint


def check_resumable(out: Path, settings: dict) -> None:
    """Refuse to add to a capture in `out` made with other settings (dtype, target, ...)."""
    old = read_meta(out)
    if old is not None:
        check_meta(old, settings, out)


def capture_meta(
    target: TargetModel, dtype: str, rendering: Rendering, model: ResolvedTarget
) -> dict:
    """meta.json of this capture: the target's identity (its registry name where the registry
    knows it, and the local directory it was read from: offline training reads the target's
    embeddings and lm_head there when its recipe names the registry entry), plus how the
    records were rendered, and the fingerprint of the tokenizer that made the token ids
    (eagle3.targets.tokenizer: training compares it with the tokenizer it loads)."""
    return {
        **target_meta(target),
        "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer),
        "target_dir": str(Path(model.hf_dir).resolve()) if model.is_local else None,
        "max_length": rendering.max_length,
        "dtype": dtype,
        "bytes_per_token": bytes_per_token(target.hidden_size, dtype),
        "chat_template": "given" if rendering.chat_template else "tokenizer",
        "template_kwargs": rendering.template_kwargs or {},
    }


def capture_command(flags: list[str], data: list[str], old_sources: list[str]) -> list[str]:
    """meta.json's ``command``: this run's flags, with --data naming every source of the
    directory when earlier runs read others (so a resume finds all of its records)."""
    if not set(old_sources) <= set(data):
        data = sorted(set(old_sources) | set(data))
    target, rest = flags[:2], flags[2:]  # command_flags lists --target first
    return [*target, "--data", *data, *rest]


def response_origins(records: list[dict], items: list[Item]) -> tuple[Counter, Counter]:
    """How many of the captured items each model and each provider wrote (provenance)."""
    by_id = {str(r["id"]): r for r in records}
    kept = {record_of(it.id) for it in items}  # a long record's windows count once
    models = Counter(str(by_id[i].get("model")) for i in kept)
    providers = Counter(str(by_id[i].get("provider")) for i in kept)
    return models, providers


def merge_provenance(
    out: Path,
    gathered: list,
    sources: list[str],
    processes: int,
    served_by: dict | None = None,
    command: list[str] | None = None,
) -> tuple[Counter, dict]:
    """Process 0, once every writer closed: add this run's sources, origins and counts (from
    every process) to the directory's, merge the index and mark it complete.

    -> (this run's counts over all processes, the final meta)."""
    stats, models, providers = Counter(), Counter(), Counter()
    for s, m, p in gathered:
        stats.update(s)
        models.update(m)
        providers.update(p)
    old = read_meta(out) or {}
    final = finalize(
        out,
        {
            "sources": sorted(set(old.get("sources") or []) | set(sources)),
            "models": dict(Counter(old.get("models") or {}) + models),
            "providers": dict(Counter(old.get("providers") or {}) + providers),
            "summary": dict(stats),
            "processes": processes,
            # the flags a resume repeats: what error messages name to recapture a damaged shard
            **({"command": command} if command else {}),
            # an engine capture: the dtype and attention backend it served (the last run's)
            **({"served_by": served_by} if served_by else {}),
        },
    )
    return stats, final
