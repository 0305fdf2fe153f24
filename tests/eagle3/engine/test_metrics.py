"""eagle3.engine.metrics: vLLM's spec-decode counters from Prometheus text (no server)."""

from __future__ import annotations

import math

import pytest

from eagle3.engine.metrics import (
    SpecDecodeMetrics,
    parse_requests_served,
    parse_spec_decode_metrics,
)

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


# -- no server needed --------------------------------------------------------------------------
def test_metrics_parse_and_window():
    m = parse_spec_decode_metrics(METRICS)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (10, 30, 12)
    assert m.accepted_per_position == (7, 4, 1)
    assert m.tau == pytest.approx(2.2) and m.acceptance_rate == pytest.approx(0.4)
    assert m.per_position_acceptance == pytest.approx([0.7, 0.4, 0.1])
    window = m - SpecDecodeMetrics(4, 12, 6, (3, 2, 1))
    assert window.tau == pytest.approx(1 + 6 / 6)
    assert window.per_position_acceptance == pytest.approx([4 / 6, 2 / 6, 0])


def test_metrics_without_spec_decode_are_zero():
    m = parse_spec_decode_metrics('vllm:num_requests_running{engine="0"} 0.0\n')
    assert m == SpecDecodeMetrics() and math.isnan(m.tau) and m.per_position_acceptance == []


def test_requests_served_sums_finished_requests_but_aborted_ones():
    # vLLM 0.32's lines, as a capture server printed them (the client gone: abort)
    text = """\
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 24.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 3.0
vllm:request_success_created{engine="0",finished_reason="length",model_name="m"} 1.7e9
"""
    assert parse_requests_served(text) == 26
    assert parse_requests_served(METRICS) == 0
