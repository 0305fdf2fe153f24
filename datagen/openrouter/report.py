"""What a run says at its end: the notes and ``stopped:`` lines on stderr (what happened, what
to do next) and the one ``summary:`` line on stdout, its last line."""

from __future__ import annotations

from datagen.openrouter.client import OpenRouter
from datagen.openrouter.exclusions import AUDIT_LOG
from datagen.openrouter.requester import Outcome
from datagen.openrouter.settle import Settled
from eagle3.data.prompts import Prompt
from eagle3.data.records import ResultStore


def summary_line(
    done: int,
    total: int,
    failed: int,
    tokens: int,
    spent: float,
    budget: float,
    excluded: list[str] | None = None,
    settled: Settled | None = None,
    cache: tuple[int, float] = (0, 0.0),
):
    remaining = total - done - failed
    line = (
        f"summary: {done}/{total} prompts done, {remaining} remaining, {failed} failed; "
        f"{tokens:,} output tokens; ${spent:.2f} spent of ${budget:.2f} budget"
    )
    if settled is not None and settled.requests:
        line += (
            f" (incl. {settled.requests} earlier request(s) settled at ${settled.usd:.4f}, "
            f"worst case ${settled.worst_usd:.4f})"
        )
    if cache[0]:
        line += f"; {cache[0]:,} cached prompt tokens saved ${cache[1]:.4f}"
    if excluded:
        line += f"; audit excluded {', '.join(excluded)}"
    return line


async def stop_messages(
    out: Outcome,
    remaining: int,
    spent: float,
    budget: float,
    api: OpenRouter,
    store: ResultStore,
    groups: dict[str, list[Prompt]],
) -> list[str]:
    lines = []
    for provider, entry in out.excluded.items():
        lines.append(
            f"note: the audit excluded {provider} ({', '.join(entry['slugs']) or 'no slug'}): "
            f"{entry['reason']}; see {AUDIT_LOG} in the output directory"
        )
    if out.audit_failures:
        lines.append(f"note: {out.audit_failures} audit check(s) failed (logged above)")
    if out.length:
        lines.append(
            f"note: {out.length} answer(s) hit max_tokens (finish_reason length, "
            "kept with truncated: true)"
        )
    if out.failed:
        lines.append(
            f"note: {out.failed} prompt(s) failed for good this run (see failed.jsonl; "
            "a re-run tries them again)"
        )
    if remaining == 0:
        return lines
    if out.stop == "credits":
        acct = await api.account()
        costs = [
            r["usage"]["cost"] for r in store.iter_records() if (r.get("usage") or {}).get("cost")
        ]
        per_prompt = sum(costs) / len(costs) if costs else None
        need = min(budget - spent, remaining * per_prompt) if per_prompt else budget - spent
        have = acct["left"]
        missing = max(0.0, need - (have or 0.0))
        lines.append(
            f"stopped: OpenRouter credits ran out (402: {out.stop_detail}). "
            + (f"${have:.2f} credit left; " if have is not None else "")
            + f"about ${missing:.2f} more credit is needed for the {remaining} remaining prompts"
            + (f" (~${per_prompt:.4f} each so far)" if per_prompt else "")
            + "; add credits and re-run the same command"
        )
    elif out.stop == "budget":
        lines.append(
            f"stopped: budget reached ({out.stop_detail}); raise --budget and re-run to continue"
        )
    elif out.stop == "orphans":
        lines.append(
            f"stopped: {out.stop_detail} (without --no-wait-for-orphans a run waits for that "
            "itself)"
        )
    elif out.stop == "audit":
        lines.append(
            f"stopped: {out.stop_detail}; see {AUDIT_LOG} in the output directory, and "
            "check the target or the audit before re-running"
        )
    elif out.stop == "interrupted":
        lines.append(
            f"stopped: interrupted ({out.stop_detail}); re-run the same command to continue"
        )
    if out.capped:
        lines.append(
            f"stopped: output-token budget reached for {', '.join(sorted(out.capped))}; "
            "raise --tokens-per-dataset (or the dataset's tokens) to generate more"
        )
    return lines
