"""An evaluation's results: one row per drafter x benchmark (the JSON `eagle3.evaluate --json`
writes, `eagle3.compare` reads), the markdown table, and the copy logged to W&B.

A row holds tau with its 95% interval, alpha_i, spec and plain tok/s, the speedup with its
interval, and `per_prompt` (every prompt's counts). Rows "[vllm]" / "[vllm xN]" are the serving
engine's: one window of vLLM's counters over all requests, so no per-prompt counts and no
interval (`ci_note` says so), and an `engine` block with the raw counters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.statistics import bootstrap_ci, engine_alpha, ratio_of_sums, speedup_of_sums
from eagle3.tracking import wandb_mode

if TYPE_CHECKING:
    from eagle3.measure import EngineResult, Tally

log = logging.getLogger(__name__)

EVAL_FILE = "eagle3_eval.json"  # the results file also stored with a W&B run
# vLLM's /metrics counters are one window over every request of a pass: no per-prompt counts
ENGINE_CI_NOTE = "none: vLLM's spec-decode counters are one window over all requests"
NO_ENGINE_CI = "n/a (one vLLM window)"


# -- rows -----------------------------------------------------------------------------------------
def result_row(drafter: str, bench: str, plain: Tally, spec: Tally, k: int) -> dict[str, Any]:
    plain_tps = plain.tokens / plain.seconds if plain.seconds else 0.0
    spec_tps = spec.tokens / spec.seconds if spec.seconds else 0.0
    pairs = list(zip(spec.per_prompt, plain.per_prompt))
    return {
        "drafter": drafter,
        "bench": bench,
        "tau": spec.stats.tau,
        "tau_ci95": bootstrap_ci(
            [[s.accepted + s.steps, s.steps] for s, _ in pairs], ratio_of_sums
        ),
        "alpha": spec.stats.alpha(k) if drafter != "none" else [],
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps else 0.0,
        "speedup_ci95": bootstrap_ci(
            [[s.tokens, s.seconds, p.tokens, p.seconds] for s, p in pairs], speedup_of_sums
        ),
        "prompts": spec.prompts,
        "turns": spec.turns,
        "tokens": spec.tokens,
        "plain_tokens": plain.tokens,
        "verify_steps": spec.stats.steps,
        "spec_seconds": spec.seconds,
        "plain_seconds": plain.seconds,
        "per_prompt": [
            {
                "id": s.id,
                "tau": (s.accepted + s.steps) / s.steps if s.steps else 0.0,
                "accepted": s.accepted,
                "steps": s.steps,
                "tokens": s.tokens,
                "seconds": s.seconds,
                "plain_tokens": p.tokens,
                "plain_seconds": p.seconds,
            }
            for s, p in pairs
        ],
    }


def engine_row(result: EngineResult, k: int) -> dict[str, Any]:
    """A serving-engine row: drafter "x/final [vllm]" (one request at a time) or
    "x/final [vllm xN]" (N at a time)."""
    run_, base, n = result.spec, result.plain, result.concurrency
    return {
        "drafter": f"{result.drafter} [vllm]" if n == 1 else f"{result.drafter} [vllm x{n}]",
        "bench": result.bench,
        "tau": run_.window.tau,
        "tau_ci95": None,
        "ci_note": ENGINE_CI_NOTE,
        "alpha": engine_alpha(run_.window, k),
        "spec_tokens_per_s": run_.rate,
        "plain_tokens_per_s": base.rate,
        "speedup": run_.rate / base.rate if base.rate else 0.0,
        "speedup_ci95": None,
        "prompts": result.prompts,
        "turns": result.turns,
        "tokens": run_.tokens,
        "plain_tokens": base.tokens,
        "verify_steps": run_.window.num_drafts,
        "spec_seconds": run_.seconds,
        "plain_seconds": base.seconds,
        "per_prompt": None,
        "engine": {"name": "vllm", "concurrency": n, **run_.window.as_dict()},
    }


# -- the table ------------------------------------------------------------------------------------
def _interval(r: dict[str, Any], key: str) -> str:
    """A row's '[lo, hi]' cell; engine rows say why they have none; '–' in older results."""
    if r.get(key):
        lo, hi = r[key]
        return f"[{lo:.2f}, {hi:.2f}]"
    return NO_ENGINE_CI if "engine" in r else "–"


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per drafter x benchmark; 95% intervals are bootstrapped over prompts."""
    k = max((len(r["alpha"]) for r in results), default=0)
    head = ["drafter", "bench", "τ", "τ 95% CI", *[f"α{i + 1}" for i in range(k)]]
    head += ["spec tok/s", "plain tok/s", "speedup", "speedup 95% CI", "prompts", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        alphas = [r["alpha"][i] if i < len(r["alpha"]) else None for i in range(k)]
        cells = [r["drafter"], r["bench"], f"{r['tau']:.2f}", _interval(r, "tau_ci95")]
        cells += ["–" if a is None else f"{a:.2f}" for a in alphas]
        cells += [
            f"{r['spec_tokens_per_s']:.1f}",
            f"{r['plain_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            _interval(r, "speedup_ci95"),
            str(r["prompts"]),
            str(r["tokens"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- W&B ------------------------------------------------------------------------------------------
def _training_run(ckpt: str) -> tuple[Path | None, dict[str, Any]]:
    """The training out_dir above a checkpoint (it holds `wandb_run_id`) and its wandb config."""
    path = Path(ckpt).resolve()
    for parent in [path, *list(path.parents)[:3]]:
        if (parent / "wandb_run_id").is_file():
            config: dict[str, Any] = {}
            if (parent / "config.yaml").is_file():
                import yaml

                config = (yaml.safe_load((parent / "config.yaml").read_text()) or {}).get(
                    "wandb"
                ) or {}
            config["id"] = (parent / "wandb_run_id").read_text().strip()
            return parent, config
    return None, {}


def log_wandb(
    report: dict[str, Any],
    specs: dict[str, str],
    *,
    project: str,
    group: str | None,
    json_path: str | None,
) -> None:
    """Each drafter's numbers go to its training run (resumed), else to a new eval run in
    the same group (`project` and `group` where the training run names none); baselines join
    the group of the first trained drafter. A run without a training directory lives beside
    `json_path` (or in the working directory)."""
    mode = wandb_mode()
    if mode == "disabled":
        log.info("W&B is disabled (WANDB_MODE=disabled): nothing logged to W&B")
        return
    import wandb

    runs: dict[str, tuple[Path | None, dict[str, Any]]] = {
        n: _training_run(s) for n, s in specs.items() if s not in ("none", "prompt-lookup")
    }
    first = next((cfg for _, cfg in runs.values() if cfg), {})
    for name in specs:
        out_dir, cfg = runs.get(name, (None, {}))
        rows = [r for r in report["results"] if r["drafter"] == name]
        kwargs: dict[str, Any] = dict(
            project=cfg.get("project") or project,
            group=cfg.get("group") or first.get("group") or group,
            mode=mode,
            dir=str(out_dir or Path(json_path or ".").resolve().parent),
            settings=wandb.Settings(silent=True),
        )
        if cfg.get("id"):
            kwargs.update(id=cfg["id"], resume="allow")
        else:
            kwargs.update(job_type="eval", name=f"eval-{name}", config={"eval": report["config"]})
        run = wandb.init(**kwargs)
        try:
            for r in rows:
                prefix = f"eval/{r['bench']}"
                run.summary[f"{prefix}/tau"] = r["tau"]
                for side, value in zip(("lo", "hi"), r.get("tau_ci95") or ()):
                    run.summary[f"{prefix}/tau_ci95_{side}"] = value
                run.summary[f"{prefix}/speedup"] = r["speedup"]
                run.summary[f"{prefix}/spec_tokens_per_s"] = r["spec_tokens_per_s"]
                run.summary[f"{prefix}/plain_tokens_per_s"] = r["plain_tokens_per_s"]
                for i, a in enumerate(r["alpha"]):
                    if a is not None:
                        run.summary[f"{prefix}/alpha_{i + 1}"] = a
            columns = [
                "drafter",
                "bench",
                "tau",
                "speedup",
                "spec_tokens_per_s",
                "plain_tokens_per_s",
                "prompts",
                "tokens",
            ]
            run.log(
                {
                    "eval/results": wandb.Table(
                        columns=columns, data=[[r[c] for c in columns] for r in rows]
                    )
                }
            )
            if run.dir and Path(run.dir).is_dir():
                Path(run.dir, EVAL_FILE).write_text(
                    json.dumps({**report, "results": rows}, indent=2)
                )
        finally:
            run.finish()
