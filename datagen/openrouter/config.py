"""The OpenRouter datagen config (default: Kimi-K2.5's, ``kimi-k2.5.yaml`` beside this module,
shipped as package data): model, provider rule, request
and retry settings, budgets and the dataset mix, typed and checked in one pass
(:func:`eagle3.config.load_typed`: every problem in one error). CLI flags override some fields
(``datagen.openrouter.cli``); the retry defaults are ``datagen.retry``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from datagen import retry
from datagen.openrouter import providers
from eagle3.config import load_typed

DEFAULT_CONFIG = Path(__file__).resolve().with_name("kimi-k2.5.yaml")


@dataclass
class DatasetSpec:
    name: str = ""
    source: str = ""  # embedded name, hf:org/name[:split], or a file
    columns: dict | None = None  # normalize's field -> the source's column
    limit: int | None = None
    tokens: int | None = None  # output-token budget; None = the config's tokens_per_dataset


@dataclass
class GenConfig:
    model: str = "moonshotai/kimi-k2.5"
    native_precision: str = "int4"
    ignore: list[str] = field(default_factory=lambda: ["fireworks", "baseten"])
    max_tokens: int = 16384
    temperature: float = 0.7
    reasoning: dict | None = None  # e.g. {effort: high}, sent as the request's reasoning
    concurrency: int = 2000
    max_attempts: int = retry.MAX_ATTEMPTS
    retry_initial_s: float = retry.INITIAL_DELAY_S
    retry_max_s: float = retry.MAX_DELAY_S
    request_timeout_s: float = 900.0
    grace_s: float = 30.0
    log_every_s: float = 30.0
    expected_output_tokens: int = 2000
    tokens_per_dataset: int = 10_000_000
    out_dir: str = "data/openrouter/kimi-k2.5"
    audit_target: str | None = None  # local copy of the target for --audit-every
    audit_device_map: str | None = None  # e.g. auto: spread the audit target over the GPUs
    datasets: list[DatasetSpec] = field(default_factory=list)

    def token_budget(self, dataset: str) -> int:
        """Output tokens ``dataset`` may use: its own ``tokens``, else tokens_per_dataset."""
        for d in self.datasets:
            if d.name == dataset and d.tokens is not None:
                return d.tokens
        return self.tokens_per_dataset


def check(cfg: GenConfig, problems: list[str]) -> None:
    """Value checks of a config whose fields all have the right types."""
    for key in (
        "max_tokens",
        "concurrency",
        "max_attempts",
        "expected_output_tokens",
        "tokens_per_dataset",
    ):
        if getattr(cfg, key) <= 0:
            problems.append(f"{key} must be a positive integer, got {getattr(cfg, key)!r}")
    for key in ("request_timeout_s", "log_every_s", "retry_initial_s", "retry_max_s"):
        if getattr(cfg, key) <= 0:
            problems.append(f"{key} must be a positive number, got {getattr(cfg, key)!r}")
    for key in ("temperature", "grace_s"):
        if getattr(cfg, key) < 0:
            problems.append(f"{key} must be a number >= 0, got {getattr(cfg, key)!r}")
    if cfg.native_precision not in providers.QUANT_RANK:
        problems.append(
            f"native_precision {cfg.native_precision!r} is not one of "
            f"{', '.join(providers.QUANT_RANK)}"
        )
    if "/" not in cfg.model:
        problems.append(f"model must be 'author/slug', got {cfg.model!r}")
    for key in ("audit_target", "audit_device_map"):
        if getattr(cfg, key) == "":
            problems.append(f"{key} must be a non-empty string or null, got ''")
    names: set[str] = set()
    for i, d in enumerate(cfg.datasets):
        where = f"datasets[{i}]"
        if not d.name:
            problems.append(f"{where}: name is required")
        elif d.name in names:
            problems.append(f"{where}: duplicate dataset name {d.name!r}")
        names.add(d.name)
        if not d.source:
            problems.append(f"{where}: source is required (sharegpt, hf:org/name, or a file)")
        for key in ("limit", "tokens"):
            value = getattr(d, key)
            if value is not None and value <= 0:
                problems.append(f"{where}: {key} must be a positive integer, got {value!r}")


def load_config(path: str | Path) -> GenConfig:
    """Read and validate a datagen YAML config; every problem is reported in one error."""
    return load_typed(GenConfig, path, check=check)
