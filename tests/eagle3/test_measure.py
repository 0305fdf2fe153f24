"""eagle3.measure: a vLLM response's per-step counts read as in-house steps with their
contexts, and the engine rows' buckets from them (a fake server; each test well under a
second)."""

from __future__ import annotations

import pytest

from eagle3.decoding.decode_config import DecodeConfig
from eagle3.engine.metrics import SpecDecodeMetrics
from eagle3.evaluation.measure import EngineResult, EngineRun, engine_pass, request_steps
from eagle3.evaluation.report import engine_row, format_table


def _reply(accepted, drafted, completion_tokens):
    spec = {"per_step_accepted": accepted, "per_step_drafted": drafted}
    return {
        "usage": {"completion_tokens": completion_tokens},
        "metrics": {"speculative_decoding": spec},
    }


def test_request_steps_rebuild_each_steps_context():
    # prompt of 100 tokens; the prompt's forward samples token 1; then steps add 3, 1, 4 tokens
    stats, left = request_steps(_reply([2, 0, 3], [3, 3, 3], 9), 100)
    assert stats.step_log == [(101, 2, 3), (104, 0, 1), (105, 3, 3)]
    assert stats.alpha(3) == [2 / 3, 1.0, 0.5] and stats.tau == (5 + 3) / 3
    assert left == 0
    # the last step may run past a stop: fewer tokens than the steps added is not a shortfall
    assert request_steps(_reply([2, 0, 3], [3, 3, 3], 7), 100)[1] == 0
    # a step without drafts (not reported by vLLM) leaves a token no step accounts for
    assert request_steps(_reply([2, 0, 3], [3, 3, 3], 10), 100)[1] == 1
    # fewer drafts than the chain on a step (near the context's end): depth d+1 never offered
    stats, _ = request_steps(_reply([1], [1], 3), 100)
    assert stats.offered_at == [1] and stats.accepted_at == [1]


def test_a_response_without_per_step_counts_has_none():
    assert request_steps({"usage": {"completion_tokens": 5}}, 10) == (None, 0)
    summary = {"usage": {"completion_tokens": 5},
               "metrics": {"speculative_decoding": {"mean_acceptance_length": 2.0}}}  # fmt: skip
    assert request_steps(summary, 10) == (None, 0)


class _FakeServer:
    """Answers like a vLLM server with a drafter and per-step counts: a prompt of n tokens
    gets steps accepting n % 3, 1, 0 of 3 drafts; the counters sum every step, as vLLM's do."""

    def __init__(self):
        self.window = SpecDecodeMetrics()

    def complete(self, ids, **_):
        accepted = [len(ids) % 3, 1, 0]
        per_pos = [sum(a > i for a in accepted) for i in range(3)]
        self.window = SpecDecodeMetrics(
            self.window.num_drafts + 3,
            self.window.num_draft_tokens + 9,
            self.window.num_accepted_tokens + sum(accepted),
            tuple(w + p for w, p in zip(self.window.accepted_per_position or (0, 0, 0), per_pos)),
        )
        return _reply(accepted, [3, 3, 3], 1 + sum(a + 1 for a in accepted))

    def spec_decode_metrics(self):
        return self.window


@pytest.mark.parametrize("concurrency", [1, 2])
def test_engine_rows_by_context_count_the_same_steps_as_the_counters(concurrency):
    turns = [[0] * 10, [0] * 11, [0] * 600, [0] * 12]  # prompt 0 has two turns, 1 one, 2 one
    cfg = DecodeConfig(steps=3, max_new_tokens=16)
    run = engine_pass(_FakeServer(), turns, cfg, [], concurrency)
    result = EngineResult("x/final", "b", concurrency, run, EngineRun(1, 1.0), 3, 4, [0, 0, 1, 2])
    row = engine_row(result, 3, [0, 512])
    buckets = row["by_context"]
    assert [(b["label"], b["steps"], b["prompts"]) for b in buckets] == [
        ("0-511", 9, 2),
        (">=512", 3, 1),
    ]
    assert sum(b["steps"] for b in buckets) == row["engine"]["num_drafts"] == 12
    weighted = sum(b["tau"] * b["steps"] for b in buckets) / 12
    assert weighted == pytest.approx(row["tau"])
    assert row["engine"]["per_step_unaccounted_tokens"] == 0
    # per prompt, in prompt order, as the in-house rows give them: prompt 0's two turns together
    assert [(p["accepted"], p["steps"]) for p in row["per_prompt"]] == [(2 + 3, 6), (1, 3), (1, 3)]
    assert row["per_prompt"][0]["tau"] == pytest.approx((5 + 6) / 6)
    # a server that returns no per-step counts: no buckets, the counters' row unchanged
    run.requests[0] = None
    assert engine_row(result, 3, [0, 512])["by_context"] is None
    assert engine_row(result, 3, [0, 512])["per_prompt"] is None


def test_engine_rows_tau_interval_comes_from_the_per_request_counts():
    """~0.1 s (a fake server). An engine row's tau interval in the main table is bootstrapped
    over prompts from the same per-request counts as its by-context buckets (with one bucket:
    that bucket's interval), brackets the counters' tau and is printed; a server without
    per-step counts leaves it None and the table says why."""
    turns = [[0] * n for n in (10, 11, 12, 13, 14)]  # 5 prompts, n % 3 drafts accepted first
    cfg = DecodeConfig(steps=3, max_new_tokens=16)
    run = engine_pass(_FakeServer(), turns, cfg, [], 1)
    result = EngineResult("x/final", "b", 1, run, EngineRun(1, 1.0), 5, 5, [0, 1, 2, 3, 4])
    row = engine_row(result, 3, [0])
    (bucket,) = row["by_context"]
    assert bucket["tau"] == pytest.approx(row["tau"])
    assert row["tau_ci95"] == bucket["tau_ci95"]
    lo, hi = row["tau_ci95"]
    assert lo < row["tau"] < hi
    assert f"| {row['tau']:.2f} | [{lo:.2f}, {hi:.2f}] |" in format_table([row])
    run.requests[0] = None
    row = engine_row(result, 3, [0])
    assert row["tau_ci95"] is None
    assert f"| {row['tau']:.2f} | n/a (one vLLM window) |" in format_table([row])
