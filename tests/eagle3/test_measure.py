"""eagle3.measure: a vLLM response's per-step counts read as in-house steps with their
contexts (well under a second)."""

from __future__ import annotations

from eagle3.measure import request_steps


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
