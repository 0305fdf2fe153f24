"""``python -m datagen.openrouter --plan``: the provider table and what the budget buys.

Nothing here sends a chat request: the projection uses the endpoints' prices, the prompts'
estimated input tokens and ``expected_output_tokens`` per answer, per dataset; once without
prompt caching and once with it (each user turn after the first resends the conversation so
far, and that prefix is billed at the cache-read price of the cheapest allowed endpoint that
lists one).
"""

from __future__ import annotations

import json

from datagen.openrouter import providers
from datagen.openrouter.config import GenConfig
from datagen.openrouter.ledger import Ledger
from eagle3.data.prompts import Prompt, user_turns

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
