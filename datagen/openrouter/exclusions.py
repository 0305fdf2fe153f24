"""The provider audit of a run (``--audit-every N``) and the exclusions it leaves behind.

:func:`make_audit` loads the local copy of the target once and wraps it in
:class:`datagen.online_audit.OnlineAudit`; the requester runs its checks and appends each exclusion
(``{"t": "exclude", "provider", "slugs", "reason", "time"}``) to ``DIR/audit.jsonl``, beside the
audit's own check lines. A later run on DIR reads those exclusions back
(:func:`ignore_earlier_exclusions`) and keeps ignoring the providers, audit on or off: a verdict
holds for the directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from datagen.openrouter import providers
from datagen.openrouter.config import GenConfig
from eagle3.errors import ConfigError

log = logging.getLogger(__name__)

AUDIT_LOG = "audit.jsonl"  # in --out: audit checks and exclusions


def earlier_exclusions(path: Path) -> dict[str, dict]:
    """provider -> {"slugs", "reason"} from the exclusion lines of DIR/audit.jsonl (a partial
    last line left by a kill is skipped)."""
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("t") == "exclude" and entry.get("provider"):
            out[str(entry["provider"])] = {
                "slugs": [str(s) for s in entry.get("slugs") or []],
                "reason": str(entry.get("reason") or ""),
            }
    return out


def provider_slugs(endpoints: list[providers.Endpoint]) -> dict[str, list[str]]:
    """Display name (lower case; what responses report) -> the slugs of its endpoints."""
    out: dict[str, list[str]] = {}
    for e in endpoints:
        slugs = out.setdefault(e.provider.lower(), [])
        if e.tag not in slugs:
            slugs.append(e.tag)
    return out


def ignore_earlier_exclusions(
    cfg: GenConfig, out_dir: Path, slugs_of: dict[str, list[str]]
) -> dict[str, dict]:
    """Add the providers an earlier run's audit excluded for ``out_dir`` to ``cfg.ignore``:
    its verdicts hold for the directory. Returns them (provider -> {"slugs", "reason"})."""
    earlier = earlier_exclusions(out_dir / AUDIT_LOG)
    for name, entry in earlier.items():
        slugs = sorted(set(entry["slugs"]) | set(slugs_of.get(name.lower(), [])))
        cfg.ignore = cfg.ignore + [s for s in slugs if s not in cfg.ignore]
        log.info(
            "audit: ignoring %s, excluded by an earlier run (%s); see %s",
            ", ".join(slugs) or f"nothing ({name} matches no endpoint)",
            entry["reason"],
            out_dir / AUDIT_LOG,
        )
    return earlier


def make_audit(target: str, every: int, log_path: Path, device_map: str | None = None):
    """Load the audit target once and wrap it in an OnlineAudit (tests replace this)."""
    # with --audit-every only: an OpenRouter run without it never loads torch or a target
    from datagen.online_audit import OnlineAudit
    from eagle3.targets import load_target

    log.info("audit: loading target %s; a check every %d prompts", target, every)
    model = load_target(target, device_map=device_map)
    if model.tokenizer is None:
        raise ConfigError(f"audit target {target} has no tokenizer; pass a target that has one")
    return OnlineAudit(model, every=every, log_path=log_path)
