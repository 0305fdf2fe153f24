"""An evaluation's results: one row per drafter x benchmark (the JSON `eagle3.evaluate --json`
writes, `eagle3.compare` reads), the markdown table, and the copy logged to W&B.

A row holds tau with its 95% interval, alpha_i, spec and plain tok/s, the speedup with its
interval, and `per_prompt` (every prompt's counts, and each of its turns' in `per_turn`); a
benchmark with several turns adds `per_turn`, the same measures over each turn alone (`turn`
1, 2, ...). Rows "x/final [tree]" are a checkpoint drafting a dynamic tree (the report's
`config` holds its shape) beside its chain row "x/final". Rows "[vllm]" / "[vllm xN]" are the
serving engine's: tau and alpha_i are one window of vLLM's counters over all requests, tau's
interval is bootstrapped over prompts from each response's own per-step counts (the same steps,
which also give its `per_prompt`: tau, accepted and steps in the in-house rows' prompt order),
the speedup has none (one timed pass; `ci_note` says so), and an `engine` block holds the raw
counters. The table adds a
"plain" row per benchmark (the target alone, the in-house speedups' denominator).

Every row also holds `by_context`: tau and alpha_i of its verification steps in buckets of the
context before each step (prompt + generated tokens), with intervals over prompts, printed as a
second table (:func:`format_context_table`); engine rows take theirs from each response's own
per-step counts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.evaluation.statistics import (
    bootstrap_ci,
    by_context,
    default_context_edges,
    engine_alpha,
    ratio_of_sums,
    speedup_of_sums,
    tau_interval,
)
from eagle3.tracking import wandb_mode

if TYPE_CHECKING:
    from eagle3.decoding.acceptance import AcceptanceStats
    from eagle3.evaluation.measure import EngineResult, Tally

log = logging.getLogger(__name__)

EVAL_FILE = "eagle3_eval.json"  # the results file also stored with a W&B run
# vLLM's /metrics counters are one window over every request of a pass: no per-prompt counts;
# each response's per-step counts (PER_STEP_ARGS) are, so tau gets its interval from those
ENGINE_CI_NOTE = "none: vLLM's spec-decode counters are one window over all requests"
ENGINE_TAU_CI_NOTE = (
    "tau: bootstrapped over prompts from each response's per-step counts; "
    "speedup: none, one timed pass over all requests"
)
NO_ENGINE_CI = "n/a (one vLLM window)"


# -- rows -----------------------------------------------------------------------------------------
def result_row(
    drafter: str, bench: str, plain: Tally, spec: Tally, k: int, edges: list[int] | None = None
) -> dict[str, Any]:
    """One drafter on one benchmark, every turn of every prompt; a benchmark with several turns
    (MT-bench) also gets `per_turn`: the same measures over each turn alone (turn 2 follows the
    target's own first answer, which prompt lookup can copy). `by_context`: tau and alpha_i of
    the steps in each bucket of context length before the step (`edges`: the buckets' lower
    edges, default doubling from 512), intervals over prompts (statistics.by_context)."""
    drafts = drafter != "none"
    pairs = list(zip(spec.per_prompt, plain.per_prompt))
    row = {
        "drafter": drafter,
        "bench": bench,
        **_measures(spec.stats, pairs, k, drafts),
        "prompts": spec.prompts,
        "turns": spec.turns,
    }
    edges = edges or default_context_edges(None)
    row["by_context"] = by_context(spec.prompt_stats, edges, k, drafts)
    row["per_prompt"] = [
        {
            "id": s.id,
            "tau": (s.accepted + s.steps) / s.steps if s.steps else 0.0,
            "accepted": s.accepted,
            "steps": s.steps,
            "tokens": s.tokens,
            "seconds": s.seconds,
            "plain_tokens": p.tokens,
            "plain_seconds": p.seconds,
            "per_turn": [  # the same counts, turn by turn
                {**asdict(st), "plain_tokens": pt.tokens, "plain_seconds": pt.seconds}
                for st, pt in zip(s.turns, p.turns)
            ],
        }
        for s, p in pairs
    ]
    if len(spec.turn_stats) > 1:
        row["per_turn"] = []
        for t, stats in enumerate(spec.turn_stats):
            turn = [(s.turns[t], p.turns[t]) for s, p in pairs if len(s.turns) > t]
            row["per_turn"].append(
                {"turn": t + 1, **_measures(stats, turn, k, drafts), "prompts": len(turn)}
            )
    return row


def _measures(
    stats: AcceptanceStats, pairs: list[tuple[Any, Any]], k: int, drafts: bool
) -> dict[str, Any]:
    """tau, alpha_i, tok/s and speedup of (speculative, plain) counts, one pair a prompt (its
    turns summed, or one turn), with 95% intervals bootstrapped over the prompts."""
    spec_tokens, spec_seconds = sum(s.tokens for s, _ in pairs), sum(s.seconds for s, _ in pairs)
    plain_tokens, plain_seconds = sum(p.tokens for _, p in pairs), sum(p.seconds for _, p in pairs)
    spec_tps = spec_tokens / spec_seconds if spec_seconds else 0.0
    plain_tps = plain_tokens / plain_seconds if plain_seconds else 0.0
    return {
        "tau": stats.tau,
        "tau_ci95": bootstrap_ci(
            [[s.accepted + s.steps, s.steps] for s, _ in pairs], ratio_of_sums
        ),
        "alpha": stats.alpha(k) if drafts else [],
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps else 0.0,
        "speedup_ci95": bootstrap_ci(
            [[s.tokens, s.seconds, p.tokens, p.seconds] for s, p in pairs], speedup_of_sums
        ),
        "tokens": spec_tokens,
        "plain_tokens": plain_tokens,
        "verify_steps": stats.steps,
        "spec_seconds": spec_seconds,
        "plain_seconds": plain_seconds,
    }


def engine_row_name(drafter: str, concurrency: int) -> str:
    """An engine row's drafter name: "x/final [vllm]" (one request at a time) or
    "x/final [vllm xN]" (N at a time)."""
    return f"{drafter} [vllm]" if concurrency == 1 else f"{drafter} [vllm x{concurrency}]"


def engine_prompt(stats: AcceptanceStats) -> dict[str, Any]:
    """One prompt's counts in an engine row (every turn, from its responses' per-step counts),
    in the in-house rows' prompt order and keys: tau, accepted, steps."""
    tau = (stats.accepted_total + stats.steps) / stats.steps if stats.steps else 0.0
    return {"tau": tau, "accepted": stats.accepted_total, "steps": stats.steps}


def engine_row(result: EngineResult, k: int, edges: list[int] | None = None) -> dict[str, Any]:
    """A serving-engine row: drafter "x/final [vllm]" (one request at a time) or
    "x/final [vllm xN]" (N at a time). Its tau and alpha_i are the counters' window; tau's
    interval and its `by_context` come from each response's own per-step counts (the same steps, with their
    contexts rebuilt from the prompt's length: measure.request_steps), None where the
    engine returned none."""
    run_, base, n = result.spec, result.plain, result.concurrency
    prompt_stats = result.prompt_stats()
    edges = edges or default_context_edges(None)
    return {
        "drafter": engine_row_name(result.drafter, n),
        "bench": result.bench,
        "tau": run_.window.tau,
        "tau_ci95": None if prompt_stats is None else tau_interval(prompt_stats),
        "ci_note": ENGINE_CI_NOTE if prompt_stats is None else ENGINE_TAU_CI_NOTE,
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
        "per_prompt": None if prompt_stats is None else [engine_prompt(s) for s in prompt_stats],
        "by_context": None if prompt_stats is None else by_context(prompt_stats, edges, k),
        "engine": {
            "name": "vllm",
            "concurrency": n,
            **run_.window.as_dict(),
            "per_step_steps": None if prompt_stats is None else sum(s.steps for s in prompt_stats),
            "per_step_unaccounted_tokens": run_.unaccounted,
        },
    }


# -- the table ------------------------------------------------------------------------------------
def _interval(r: dict[str, Any], key: str) -> str:
    """A row's '[lo, hi]' cell; engine rows say why they have none; '–' in older results."""
    if r.get(key):
        lo, hi = r[key]
        return f"[{lo:.2f}, {hi:.2f}]"
    return NO_ENGINE_CI if "engine" in r else "–"


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown, benchmark by benchmark: each drafter's row, then "plain" (the target alone, the
    speedups' denominator), then the serving engine's rows; a benchmark with several turns
    repeats that per turn ("mt_bench turn 2"). 95% intervals are bootstrapped over prompts."""
    k = max((len(r["alpha"]) for r in results), default=0)
    head = ["drafter", "bench", "τ", "τ 95% CI", *[f"α{i + 1}" for i in range(k)]]
    head += ["spec tok/s", "plain tok/s", "speedup", "speedup 95% CI", "prompts", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bench in dict.fromkeys(r["bench"] for r in results):
        rows = [r for r in results if r["bench"] == bench]
        lines += [_table_line(r, bench, k) for r in _with_plain(rows)]
        turns = dict.fromkeys(t["turn"] for r in rows for t in r.get("per_turn") or ())
        for turn in turns:
            split = [{**r, **t} for r in rows for t in r.get("per_turn") or () if t["turn"] == turn]
            lines += [_table_line(r, f"{bench} turn {turn}", k) for r in _with_plain(split)]
    return "\n".join(lines)


def _with_plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The in-house rows, a "plain" row (their shared plain decoding: tau 1 by definition),
    then the engine rows (each against plain vLLM run the same way, in its own row)."""
    own = [r for r in rows if "engine" not in r]
    if not own:
        return rows
    base = own[0]
    plain = {
        "drafter": "plain",
        "tau": 1.0,
        "alpha": [],
        "spec_tokens_per_s": base["plain_tokens_per_s"],
        "plain_tokens_per_s": base["plain_tokens_per_s"],
        "speedup": 1.0,
        "prompts": base["prompts"],
        "tokens": base.get("plain_tokens", "–"),  # results from before plain_tokens: none
    }
    return [*own, plain, *(r for r in rows if "engine" in r)]


def _table_line(r: dict[str, Any], bench: str, k: int) -> str:
    alphas = [r["alpha"][i] if i < len(r["alpha"]) else None for i in range(k)]
    cells = [r["drafter"], bench, f"{r['tau']:.2f}", _interval(r, "tau_ci95")]
    cells += ["–" if a is None else f"{a:.2f}" for a in alphas]
    cells += [
        f"{r['spec_tokens_per_s']:.1f}",
        f"{r['plain_tokens_per_s']:.1f}",
        f"{r['speedup']:.2f}x",
        _interval(r, "speedup_ci95"),
        str(r["prompts"]),
        str(r["tokens"]),
    ]
    return "| " + " | ".join(cells) + " |"


def format_context_table(results: list[dict[str, Any]]) -> str:
    """Markdown: tau and alpha_i by the context before each verification step, one line per
    drafter x benchmark x context bucket ("none" left out: tau 1 by definition); "" when no
    row has them. 95% intervals bootstrapped over the prompts with steps in the bucket."""
    rows = [r for r in results if r.get("by_context") and r["drafter"] != "none"]
    if not rows:
        return ""
    k = max((len(r["alpha"]) for r in rows), default=0)
    head = ["drafter", "bench", "context", "steps", "prompts", "τ", "τ 95% CI"]
    head += [f"α{i + 1}" for i in range(k)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for b in r["by_context"]:
            alphas = [b["alpha"][i] if i < len(b["alpha"]) else None for i in range(k)]
            ci = b.get("tau_ci95")
            cells = [r["drafter"], r["bench"], b["label"], str(b["steps"]), str(b["prompts"])]
            cells += [f"{b['tau']:.2f}", f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "–"]
            cells += ["–" if a is None else f"{a:.2f}" for a in alphas]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BASELINES = ("none", "prompt-lookup")  # no trained drafter: not where a budget could go


def weakest(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trained drafter's held-out datasets (rows with `dataset`), lowest tau first, with
    its interval and how far behind that drafter's best dataset it is: where the start drafter
    is weakest (`datagen.openrouter --weight-by` reads the rows themselves)."""
    rows = [r for r in results if r.get("dataset") and r["drafter"] not in BASELINES]
    out = []
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        mine = sorted((r for r in rows if r["drafter"] == drafter), key=lambda r: r["tau"])
        best = mine[-1]["tau"]
        out += [
            {
                "drafter": drafter,
                "dataset": r["dataset"],
                "tau": r["tau"],
                "tau_ci95": r.get("tau_ci95"),
                "prompts": r["prompts"],
                "behind_best": best - r["tau"],
            }
            for r in mine
        ]
    return out


def format_weakest_table(summary: list[dict[str, Any]]) -> str:
    """Markdown of :func:`weakest`: one line per drafter x held-out dataset, lowest τ first."""
    head = ["drafter", "dataset", "τ", "τ 95% CI", "behind best", "prompts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in summary:
        ci = w.get("tau_ci95")
        cells = [w["drafter"], w["dataset"], f"{w['tau']:.2f}"]
        cells += [f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else NO_ENGINE_CI]
        cells += [f"{w['behind_best']:.2f}", str(w["prompts"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


WEAKEST_NOTE = (
    "held-out datasets: conversations training holds out (its validation split), asked up to "
    "their last user turn; 95% intervals bootstrapped over prompts. Tilt the next datagen budget "
    "toward the low ones: python -m datagen.openrouter --plan --weight-by EVAL.json"
)


CONTEXT_NOTE = (
    "context: tokens before a verification step's first drafted token (prompt + tokens "
    "generated so far); τ and α of the steps in that bucket, 95% intervals bootstrapped over "
    "the prompts with steps in it. [vllm] rows: each response's own per-step counts, the "
    "contexts rebuilt from its prompt length."
)


def speedup_note(report: dict[str, Any]) -> str:
    """What the speedup columns mean where they were measured: lines to print under the table."""
    results = report["results"]
    lines = [
        "speedup = spec tok/s / plain tok/s of the in-house decoder (PyTorch eager, "
        f"{report['device']}, one sequence, both measured in this run): the instrument that "
        "measures τ, not a serving engine."
    ]
    if str(report["device"]).startswith("cpu"):
        lines.append(
            "On a CPU each draft step is a full draft layer + lm_head pass and a tree's "
            "candidates are all verified, so a speedup below 1 here says nothing about a GPU "
            "engine; τ is what carries over."
        )
    if any("engine" in r for r in results):
        lines.append(
            'The serving numbers are vLLM\'s rows ("[vllm]": the drafter served by vLLM vs '
            'plain vLLM, one request at a time; "[vllm xN]": N at a time).'
        )
    else:
        lines.append("The serving numbers come from vLLM: --engine vllm adds its rows.")
    if any(r["drafter"].endswith(" [tree]") for r in results):
        cfg = report["config"]  # the tree's shape
        lines.append(
            f"[tree]: EAGLE-2 dynamic tree, topk {cfg['topk']}, depth {cfg['depth']}, "
            f"{cfg['total_tokens']} tokens verified a step (SGLang serves trees with "
            "--speculative-eagle-topk > 1; vLLM serves chains)."
        )
    if any(r.get("per_turn") for r in results):
        lines.append(
            "turn 2: the second question, asked after the target's own first answer; prompt "
            "lookup copies whatever of that answer the target repeats."
        )
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
            for key, value in wandb_summary(rows).items():
                run.summary[key] = value
            run.log(
                {
                    name: wandb.Table(columns=columns, data=data)
                    for name, (columns, data) in wandb_tables(rows).items()
                }
            )
            if run.dir and Path(run.dir).is_dir():
                Path(run.dir, EVAL_FILE).write_text(
                    json.dumps({**report, "results": rows}, indent=2)
                )
        finally:
            run.finish()


def wandb_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One drafter's result rows as W&B summary keys: eval/<bench>/tau (its interval, speedup,
    throughputs, alpha_i), per MT-bench turn, and per context bucket."""
    summary: dict[str, Any] = {}

    def acceptance(where: str, measured: dict[str, Any]) -> None:  # a row's or a bucket's
        summary[f"{where}/tau"] = measured["tau"]
        for side, value in zip(("lo", "hi"), measured.get("tau_ci95") or ()):
            summary[f"{where}/tau_ci95_{side}"] = value
        for i, a in enumerate(measured["alpha"]):
            if a is not None:
                summary[f"{where}/alpha_{i + 1}"] = a

    for r in rows:
        prefix = f"eval/{r['bench']}"
        acceptance(prefix, r)
        summary[f"{prefix}/speedup"] = r["speedup"]
        summary[f"{prefix}/spec_tokens_per_s"] = r["spec_tokens_per_s"]
        summary[f"{prefix}/plain_tokens_per_s"] = r["plain_tokens_per_s"]
        for turn in r.get("per_turn") or ():  # MT-bench: turn 2 follows turn 1's answer
            summary[f"{prefix}/turn{turn['turn']}/tau"] = turn["tau"]
            summary[f"{prefix}/turn{turn['turn']}/speedup"] = turn["speedup"]
        for b in r.get("by_context") or ():  # tau by the context before each step
            where = f"{prefix}/context_from_{b['context_lo']}"  # the bucket's edge
            acceptance(where, b)
            summary[f"{where}/steps"] = b["steps"]
    return summary


def wandb_tables(rows: list[dict[str, Any]]) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """One drafter's result rows as W&B tables: name -> (columns, data)."""
    columns = ["drafter", "bench", "tau", "speedup", "spec_tokens_per_s", "plain_tokens_per_s",
               "prompts", "tokens"]  # fmt: skip
    ctx_columns = ["drafter", "bench", "context_lo", "context_hi", "steps", "prompts",
                   "tau", "tau_ci95_lo", "tau_ci95_hi"]  # fmt: skip
    ctx_data = [
        [
            r["drafter"],
            r["bench"],
            b["context_lo"],
            b["context_hi"],
            b["steps"],
            b["prompts"],
            b["tau"],
            *(b.get("tau_ci95") or (None, None)),
        ]  # fmt: skip
        for r in rows
        for b in r.get("by_context") or ()
    ]
    return {
        "eval/results": (columns, [[r[c] for c in columns] for r in rows]),
        "eval/by_context": (ctx_columns, ctx_data),
    }
