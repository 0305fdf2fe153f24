"""``python -m datagen.openrouter --plan``: the provider table and what the budget buys.

Nothing here sends a chat request: the projection uses the endpoints' prices, the prompts'
estimated input tokens and ``expected_output_tokens`` per answer, per dataset; once without
prompt caching and once with it (each user turn after the first resends the conversation so
far, and that prefix is billed at the cache-read price of the cheapest allowed endpoint that
lists one).

``--weight-by EVAL.json`` (:func:`weight_by`) tilts the mix's per-dataset output-token budgets
toward the datasets where the drafter's held-out tau is lowest (``eagle3.evaluate --held-out
DIR --json EVAL.json``): :func:`tilted_budgets` is the rule, the plan prints old and new.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datagen.openrouter import providers
from datagen.openrouter.config import GenConfig
from datagen.openrouter.ledger import Ledger
from eagle3.data.prompts import Prompt, user_turns
from eagle3.errors import ConfigError
from eagle3.evaluation.report import BASELINES

COLUMNS = (
    "dataset",
    "prompts",
    "in tok/prompt",
    "out tok/prompt",
    "token budget",
    "wanted tok",
    "wanted $",
    "buys tok",
    "buys prompts",
    "% of budget",
    "worst-case tok",
)


def plan_text(
    cfg: GenConfig,
    endpoints: list[providers.Endpoint],
    allowed: list[providers.Endpoint],
    groups: dict[str, list[Prompt]],
    done: dict[str, set[str]],
    budget: float,
    ledger: Ledger | None,
) -> str:
    """The provider table, and when some endpoint is allowed, the budget projection."""
    lines = provider_lines(cfg, endpoints, allowed)
    if not allowed:
        return "\n".join(lines)
    spent = ledger.spent_usd if ledger else 0.0
    left = max(0.0, budget - spent)
    demands = [
        demand(cfg, name, [p for p in prompts if p.id not in done.get(name, set())], ledger)
        for name, prompts in groups.items()
    ]
    lines += projection_lines(cfg, allowed, demands, left, budget, spent)
    return "\n".join(lines)


def provider_lines(
    cfg: GenConfig, endpoints: list[providers.Endpoint], allowed: list[providers.Endpoint]
) -> list[str]:
    lines = [f"providers of {cfg.model} (native precision {cfg.native_precision}):"]
    lines.append(providers.format_table(endpoints, cfg.native_precision))
    unknown = [e.provider for e in allowed if e.assumed_native]
    if unknown:
        lines.append(
            f"note: {', '.join(unknown)} report no quantization; taken as native "
            f"{cfg.native_precision} (the only public weights)"
        )
    if allowed:
        block = providers.provider_block(endpoints, cfg.native_precision, cfg.ignore)
        lines.append("provider rule sent with every request: " + json.dumps(block))
    return lines


def demand(
    cfg: GenConfig, name: str, todo: list[Prompt], ledger: Ledger | None
) -> providers.DatasetDemand:
    """What one dataset still wants: its prompts left, mean tokens in and out per prompt, and
    the output tokens left of its token budget."""
    tokens_in = tokens_out = cached = 0.0
    for p in todo:
        i, o = providers.conversation_tokens(p.messages, cfg.expected_output_tokens)
        tokens_in, tokens_out = tokens_in + i, tokens_out + o
        cached += providers.cacheable_tokens(p.messages, cfg.expected_output_tokens)
    n = max(1, len(todo))
    spent_tokens = ledger.spent_tokens(name) if ledger else 0
    budget_left = max(0, cfg.token_budget(name) - spent_tokens)
    return providers.DatasetDemand(
        name, len(todo), tokens_in / n, tokens_out / n, budget_left, cached / n
    )


def usd_per_m_out(
    cfg: GenConfig, allowed: list[providers.Endpoint], groups: dict[str, list[Prompt]]
) -> float | None:
    """The plan's blended $ per million output tokens for ``groups`` at the cheapest allowed
    endpoint, without caching: (input and output cost of every prompt) / (its output tokens)."""
    if not allowed:
        return None
    cheap = providers.cheapest(allowed)
    usd = tokens = 0.0
    for prompts in groups.values():
        for p in prompts:
            i, o = providers.conversation_tokens(p.messages, cfg.expected_output_tokens)
            usd += i * cheap.prompt + o * cheap.completion + cheap.request * user_turns(p)
            tokens += o
    return usd / tokens * 1e6 if tokens else None


def projection_lines(
    cfg: GenConfig,
    allowed: list[providers.Endpoint],
    demands: list[providers.DatasetDemand],
    left: float,
    budget: float,
    spent: float,
) -> list[str]:
    """What ``left`` dollars buy at the cheapest and the dearest allowed endpoint, in total and
    per dataset."""
    cheap, dear = providers.cheapest(allowed), providers.dearest(allowed)
    rows = providers.project(demands, left, cheap)
    worst = providers.project(demands, left, dear)
    wanted_tokens = sum(r.wanted_tokens for r in rows)
    wanted_usd = sum(r.wanted_usd for r in rows)
    in_per_out = (
        sum(d.input_per_prompt * r.wanted_prompts for d, r in zip(demands, rows)) / wanted_tokens
        if wanted_tokens
        else 0.0
    )
    buys_cheap = providers.tokens_for_budget(left, in_per_out, cheap) / 1e6
    buys_dear = providers.tokens_for_budget(left, in_per_out, dear) / 1e6
    lines = [
        f"budget projection: ${left:.2f} left of ${budget:.2f} (spent ${spent:.2f}); "
        f"~{cfg.expected_output_tokens} output tokens per answer assumed (expected_output_tokens)",
        f"  at the cheapest allowed ${cheap.prompt * 1e6:.2f}/M in, ${cheap.completion * 1e6:.2f}"
        f"/M out: ${left:.2f} buys {buys_cheap:.1f}M output tokens; at the dearest allowed "
        f"${dear.prompt * 1e6:.2f}/M in, ${dear.completion * 1e6:.2f}/M out: {buys_dear:.1f}M",
        f"  the datasets want {wanted_tokens / 1e6:.2f}M output tokens "
        f"(${wanted_usd:.2f} at the cheapest allowed)",
    ]
    table = [COLUMNS] + [dataset_row(d, r, w) for d, r, w in zip(demands, rows, worst)]
    return lines + ["  " + line for line in align(table)] + caching_lines(allowed, demands, left)


def caching_lines(
    allowed: list[providers.Endpoint], demands: list[providers.DatasetDemand], left: float
) -> list[str]:
    """The projection at the cheapest allowed prices without and with prompt caching."""
    cheap = providers.cheapest(allowed)
    cached, source = providers.with_cache(cheap, allowed)
    if source is None:
        return ["  prompt caching: no allowed endpoint lists a cache-read price; none projected"]
    plain = providers.project(demands, left, cheap)
    rows = providers.project(demands, left, cached)
    without, with_ = sum(r.wanted_usd for r in plain), sum(r.wanted_usd for r in rows)
    saved = 100.0 * (with_ - without) / without if without else 0.0
    lines = [
        f"  prompt caching (each turn after the first resends the conversation; that prefix at "
        f"{source.provider}'s ${cached.cache_read * 1e6:.3f}/M cached input): the datasets want "
        f"${without:.2f} without caching, ${with_:.2f} with ({saved:+.1f}%)"
    ]
    for d, p, r in zip(demands, plain, rows):
        share = 100.0 * d.cached_per_prompt / d.input_per_prompt if d.input_per_prompt else 0.0
        lines.append(
            f"  caching {d.name}: {d.cached_per_prompt:.0f} of {d.input_per_prompt:.0f} input "
            f"tok/prompt cacheable ({share:.0f}%); wanted ${p.wanted_usd:.4f} without caching, "
            f"${r.wanted_usd:.4f} with; buys {p.bought_prompts:,.0f} prompts without, "
            f"{r.bought_prompts:,.0f} with"
        )
    return lines


def dataset_row(
    d: providers.DatasetDemand, r: providers.DatasetProjection, w: providers.DatasetProjection
) -> tuple[str, ...]:
    """One dataset's cells: its demand, what it buys at the cheapest allowed price (r) and at
    the dearest (w)."""
    pct = 100.0 * r.bought_tokens / d.token_budget_left if d.token_budget_left else 0.0
    return (
        d.name,
        str(d.prompts),
        f"{d.input_per_prompt:.0f}",
        f"{d.output_per_prompt:.0f}",
        f"{d.token_budget_left:,}",
        f"{r.wanted_tokens:,.0f}",
        f"{r.wanted_usd:.2f}",
        f"{r.bought_tokens:,.0f}",
        f"{r.bought_prompts:,.0f}",
        f"{pct:.1f}%",
        f"{w.bought_tokens:,.0f}",
    )


def align(table: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells -> lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in table
    ]


# -- --weight-by: the budget toward where the drafter is weakest ----------------------------------
# Every dataset keeps this much tau of headroom in its weight, so the best-served one is tilted
# down, never starved: the fine-tune still sees what the start already drafts well (replay).
TILT_FLOOR = 0.25


def tilted_budgets(
    budgets: dict[str, int], tau: dict[str, float], floor: float = TILT_FLOOR
) -> dict[str, int]:
    """Output-token budgets tilted by held-out tau: each measured dataset d gets

        new_d = total x base_d x (tau_max - tau_d + floor) / sum_e base_e x (tau_max - tau_e + floor)

    over the measured datasets (total = their base budgets' sum, kept; tau_max their highest);
    unmeasured ones keep theirs. Why this rule: tau_max - tau_d is the acceptance the drafter
    reaches on its best dataset and misses on d, the headroom d's data can buy back; it is
    linear (a dataset 0.5 behind gets (0.5 + floor) / floor = 3x the best one's share per base
    token) where 1/tau would barely move (tau 2.7 vs 3.3: 1.2x). Equal taus leave the budgets
    as they were. Pure."""
    measured = [d for d in budgets if d in tau]
    if not measured:
        return dict(budgets)
    best = max(tau[d] for d in measured)
    score = {d: budgets[d] * (best - tau[d] + floor) for d in measured}
    total, norm = sum(budgets[d] for d in measured), sum(score.values())
    if norm <= 0:  # every measured budget is 0: nothing to move
        return dict(budgets)
    return {d: round(total * score[d] / norm) if d in score else b for d, b in budgets.items()}


def dataset_tau(
    report: Any, source: str, drafter: str | None
) -> tuple[str, dict[str, dict[str, Any]]]:
    """(drafter, dataset -> {tau, tau_ci95, prompts}) from an evaluation's rows that name a
    held-out dataset: its one trained drafter's, or `drafter`'s when it holds several."""
    results = report.get("results") if isinstance(report, dict) else None
    rows = [
        r
        for r in (results if isinstance(results, list) else ())
        if isinstance(r, dict) and r.get("dataset") and r.get("drafter") not in BASELINES
    ]
    if not rows:
        raise ConfigError(
            f"--weight-by {source}: no tau per dataset in it; write one with python -m "
            "eagle3.evaluate --held-out DIR --json EVAL.json"
        )
    drafters = list(dict.fromkeys(str(r.get("drafter")) for r in rows))
    if drafter is None and len(drafters) > 1:
        raise ConfigError(
            f"--weight-by {source} holds tau per dataset of {len(drafters)} drafters "
            f"({', '.join(drafters)}); name one with --weight-drafter NAME"
        )
    drafter = drafter if drafter is not None else drafters[0]
    if drafter not in drafters:
        raise ConfigError(
            f"--weight-drafter {drafter!r} has no tau per dataset in {source}; it has "
            f"{', '.join(drafters)}"
        )
    out = {}
    for r in rows:
        if str(r.get("drafter")) != drafter:
            continue
        tau = r.get("tau")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 1.0:
            raise ConfigError(f"--weight-by {source}: dataset {r['dataset']}'s tau is {tau!r}, "
                              "not a number >= 1; rewrite it with eagle3.evaluate")  # fmt: skip
        out[str(r["dataset"])] = {"tau": float(tau), "tau_ci95": r.get("tau_ci95")}
    return drafter, out


def weight_by(
    cfg: GenConfig, source: str, drafter: str | None = None, mix: list[str] | None = None
) -> list[str]:
    """Tilt the budgets (each entry's `tokens`) of the datasets `cfg` runs by the held-out tau
    in evaluation JSON `source` (:func:`tilted_budgets`); -> the lines that show old and new.
    `mix`: the config's whole mix before --datasets (default: cfg's); tau of a dataset in it
    that this run leaves out is not used. One-line ConfigError for a file that is not such
    JSON or names a dataset the mix lacks."""
    try:
        report = json.loads(Path(source).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not JSON"
        raise ConfigError(
            f"--weight-by {source}: {why}; pass the file eagle3.evaluate --json wrote"
        ) from None
    drafter, taus = dataset_tau(report, source, drafter)
    mix = mix if mix is not None else [d.name for d in cfg.datasets]
    unknown = sorted(set(taus) - set(mix))
    if unknown:
        raise ConfigError(
            f"--weight-by {source} has tau for datasets the mix lacks: {', '.join(unknown)} "
            f"(the mix: {', '.join(mix) or 'none'}); evaluate records of this mix or pass "
            "its --config"
        )
    old = {d.name: cfg.token_budget(d.name) for d in cfg.datasets}
    new = tilted_budgets(old, {n: t["tau"] for n, t in taus.items()})
    for d in cfg.datasets:
        d.tokens = new[d.name]
    return tilt_lines(old, new, taus, drafter, source)


def tilt_lines(
    old: dict[str, int],
    new: dict[str, int],
    taus: dict[str, dict[str, Any]],
    drafter: str,
    source: str,
) -> list[str]:
    """The tilt as a table: each dataset's held-out tau, its budget and share before and after."""
    total_old, total_new = sum(old.values()) or 1, sum(new.values()) or 1
    table = [("dataset", "tau", "tau 95% CI", "old tokens", "old %", "new tokens", "new %")]
    for name in old:
        t = taus.get(name)
        ci = t["tau_ci95"] if t else None
        table.append((
            name,
            f"{t['tau']:.2f}" if t else "-",
            f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-",
            f"{old[name]:,}",
            f"{100.0 * old[name] / total_old:.1f}%",
            f"{new[name]:,}",
            f"{100.0 * new[name] / total_new:.1f}%",
        ))  # fmt: skip
    lines = [
        f"weights by held-out tau of {drafter} ({source}): a measured dataset's token budget "
        f"x (tau_max - tau + {TILT_FLOOR}), their total kept; '-' = not measured, kept"
    ]
    return lines + ["  " + line for line in align(table)]
