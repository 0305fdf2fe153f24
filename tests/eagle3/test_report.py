"""eagle3.report: evaluation rows (whole benchmark and per turn), the markdown table and the
note on what its speedups mean."""

from __future__ import annotations

import pytest

from eagle3.decoding.acceptance import AcceptanceStats
from eagle3.decoding.decoder import Generation
from eagle3.evaluation.measure import Tally
from eagle3.evaluation.report import (
    format_context_table,
    format_table,
    result_row,
    speedup_note,
    wandb_summary,
    wandb_tables,
)


def test_table_shows_intervals_and_says_why_an_engine_row_has_none():
    base = {"bench": "mt_bench", "alpha": [0.5], "spec_tokens_per_s": 30.0,
            "plain_tokens_per_s": 20.0, "speedup": 1.5, "prompts": 5, "tokens": 480}  # fmt: skip
    rows = [
        {**base, "drafter": "x/final", "tau": 1.45, "tau_ci95": [1.3, 1.61],
         "speedup_ci95": [1.2, 1.74], "plain_tokens": 470},
        {**base, "drafter": "x/final [vllm]", "tau": 1.5, "tau_ci95": None,
         "speedup_ci95": None, "engine": {"name": "vllm"}},
        {**base, "drafter": "old", "tau": 1.4},  # a result file from before the intervals
    ]  # fmt: skip
    lines = format_table(rows).splitlines()
    assert lines[0] == (
        "| drafter | bench | τ | τ 95% CI | α1 | spec tok/s | plain tok/s | speedup "
        "| speedup 95% CI | prompts | tokens |"
    )
    assert lines[2] == (
        "| x/final | mt_bench | 1.45 | [1.30, 1.61] | 0.50 | 30.0 | 20.0 | 1.50x "
        "| [1.20, 1.74] | 5 | 480 |"
    )
    assert lines[3].startswith("| old | mt_bench | 1.40 | – | 0.50 |")
    # the in-house rows' shared plain decoding, then the engine's rows (their own plain vLLM)
    assert lines[4] == "| plain | mt_bench | 1.00 | – | – | 20.0 | 20.0 | 1.00x | – | 5 | 470 |"
    assert "| x/final [vllm] | mt_bench | 1.50 | n/a (one vLLM window) | 0.50 |" in lines[5]
    assert len(lines) == 6


def _gen(accepted: list[int], tokens: int, seconds: float) -> Generation:
    """A turn whose verification steps accepted `accepted[i]` drafts each (chain depth 2)."""
    stats = AcceptanceStats()
    for a in accepted:
        stats.record(a, min(a + 1, 2))
    return Generation(tokens=[0] * tokens, stats=stats, seconds=seconds)


def _tallies(turns: list[list[tuple[list[int], int, float, float]]]) -> tuple[Tally, Tally]:
    """Per prompt, per turn: (accepted per step, tokens, spec seconds, plain seconds)."""
    plain, spec = Tally(), Tally()
    for i, prompt in enumerate(turns):
        plain.start(f"p{i}")
        spec.start(f"p{i}")
        for accepted, tokens, spec_s, plain_s in prompt:
            plain.add(_gen([0] * tokens, tokens, plain_s))
            spec.add(_gen(accepted, tokens, spec_s))
    return plain, spec


def test_rows_per_turn_count_each_turn_alone():
    # three MT-bench-like prompts: turn 2 accepts far more (the target repeating itself)
    plain, spec = _tallies(
        [
            [([0, 1, 0], 4, 2.0, 4.0), ([2, 2], 6, 1.0, 6.0)],
            [([1, 0], 3, 1.0, 3.0), ([2, 1], 5, 1.0, 5.0)],
            [([0, 0], 2, 1.0, 2.0), ([2], 3, 0.5, 3.0)],
        ]
    )
    row = result_row("x/final", "mt_bench", plain, spec, 2)
    assert (row["prompts"], row["turns"], row["tokens"], row["plain_tokens"]) == (3, 6, 23, 23)
    assert row["tau"] == pytest.approx((11 + 12) / 12)  # (accepted + steps) / steps
    first, second = row["per_turn"]
    assert first["turn"] == 1 and first["prompts"] == 3
    assert first["tau"] == pytest.approx((2 + 7) / 7)
    assert second["tau"] == pytest.approx((9 + 5) / 5)
    assert first["tokens"] == 9 and second["tokens"] == 14
    assert first["spec_tokens_per_s"] == pytest.approx(9 / 4.0)
    assert second["speedup"] == pytest.approx((14 / 2.5) / (14 / 14.0))
    assert second["alpha"] == [1.0, pytest.approx(4 / 5)]  # all 5 steps depth 1, 4 depth 2
    lo, hi = second["tau_ci95"]
    assert lo <= second["tau"] <= hi
    # each turn's counts are in the JSON, and they sum to the prompt's
    turns = row["per_prompt"][0]["per_turn"]
    assert turns == [
        {"accepted": 1, "steps": 3, "tokens": 4, "seconds": 2.0,
         "plain_tokens": 4, "plain_seconds": 4.0},
        {"accepted": 4, "steps": 2, "tokens": 6, "seconds": 1.0,
         "plain_tokens": 6, "plain_seconds": 6.0},
    ]  # fmt: skip
    assert sum(t["steps"] for t in turns) == row["per_prompt"][0]["steps"]


def test_a_single_turn_benchmark_has_no_per_turn():
    plain, spec = _tallies([[([1, 1], 4, 1.0, 2.0)], [([0], 1, 1.0, 1.0)]])
    row = result_row("x/final [tree]", "humaneval", plain, spec, 3)
    assert "per_turn" not in row and len(row["per_prompt"][0]["per_turn"]) == 1
    assert row["alpha"] == [pytest.approx(2 / 3), 0.0, None]  # to k, the drafter's depth
    assert result_row("none", "humaneval", plain, spec, 3)["alpha"] == []


def test_table_splits_turns_after_the_whole_benchmark():
    plain, spec = _tallies(
        [[([0, 1], 3, 1.0, 1.5), ([2], 3, 0.5, 1.5)], [([1], 2, 1.0, 1.0), ([2], 3, 0.5, 1.5)]]
    )
    lookup = Tally()
    for prompt in spec.per_prompt:  # prompt lookup: no acceptance, same tokens and timing
        lookup.start(prompt.id)
        for turn in prompt.turns:
            lookup.add(_gen([0] * turn.steps, turn.tokens, turn.seconds))
    rows = [
        result_row("x/final", "mt_bench", plain, spec, 2),
        result_row("prompt-lookup", "mt_bench", plain, lookup, 2),
    ]
    single_plain, single = _tallies([[([1], 2, 1.0, 1.0)], [([0], 1, 1.0, 1.0)]])
    rows.append(result_row("x/final", "humaneval", single_plain, single, 2))
    table = format_table(rows).splitlines()
    assert [line.split(" | ")[:2] for line in table[2:]] == [
        ["| x/final", "mt_bench"],
        ["| prompt-lookup", "mt_bench"],
        ["| plain", "mt_bench"],
        ["| x/final", "mt_bench turn 1"],
        ["| prompt-lookup", "mt_bench turn 1"],
        ["| plain", "mt_bench turn 1"],
        ["| x/final", "mt_bench turn 2"],
        ["| prompt-lookup", "mt_bench turn 2"],
        ["| plain", "mt_bench turn 2"],
        ["| x/final", "humaneval"],
        ["| plain", "humaneval"],
    ]
    turn2 = rows[0]["per_turn"][1]
    assert f"| x/final | mt_bench turn 2 | {turn2['tau']:.2f} |" in table[8]
    assert turn2["tau"] == pytest.approx(3.0)
    plain_turn2 = table[10].split(" | ")
    assert plain_turn2[-1] == "6 |"  # the plain tokens of turn 2 alone
    assert plain_turn2[-6] == f"{6 / 3.0:.1f}"  # its plain tok/s


@pytest.mark.parametrize(
    "device, engine, tree, turns, expected, absent",
    [
        ("cpu", False, True, True, ["below 1 here says nothing about a GPU", "--engine vllm adds",
         "[tree]: EAGLE-2 dynamic tree, topk 4, depth 3, 16 tokens", "turn 2: "], ["vLLM's rows"]),
        ("cuda:0", True, False, False, ["PyTorch eager, cuda:0", "vLLM's rows"],
         ["below 1", "[tree]", "turn 2", "--engine vllm adds"]),
    ],
)  # fmt: skip
def test_speedup_note_says_what_was_measured_where(device, engine, tree, turns, expected, absent):
    results = [{"drafter": "x/final", "bench": "mt_bench"}]
    if turns:
        results[0]["per_turn"] = [{"turn": 1}, {"turn": 2}]
    if tree:
        results.append({"drafter": "x/final [tree]", "bench": "mt_bench"})
    if engine:
        results.append({"drafter": "x/final [vllm]", "bench": "mt_bench", "engine": {}})
    report = {
        "device": device,
        "config": {"topk": 4, "depth": 3, "total_tokens": 16},
        "results": results,
    }
    note = speedup_note(report)
    assert note.startswith("speedup = spec tok/s / plain tok/s of the in-house decoder")
    for text in expected:
        assert text in note
    for text in absent:
        assert text not in note


def test_context_table_lists_each_bucket_of_each_drafter_but_none():
    """format_context_table and the rows' by_context (well under a second)."""
    plain, spec = Tally(), Tally()
    for i, contexts in enumerate([(5, 9, 14), (30, 33)]):
        plain.start(f"p{i}")
        spec.start(f"p{i}")
        stats = AcceptanceStats()
        for c in contexts:
            stats.record(1, 2, c)
        spec.add(Generation([0] * 2 * len(contexts), stats, 1.0))
        plain.add(_gen([0] * 2 * len(contexts), 2 * len(contexts), 1.0))
    row = result_row("x/final", "long_context", plain, spec, 2, [0, 16, 32])
    assert [(b["label"], b["steps"], b["prompts"]) for b in row["by_context"]] == [
        ("0-15", 3, 1),
        ("16-31", 1, 1),
        (">=32", 1, 1),
    ]
    none = {**row, "drafter": "none"}  # tau 1 by definition: not in the table
    engine = {**row, "drafter": "x/final [vllm]", "by_context": None}  # no per-step counts
    lines = format_context_table([row, none, engine]).splitlines()
    assert lines[0] == "| drafter | bench | context | steps | prompts | τ | τ 95% CI | α1 | α2 |"
    assert lines[2] == "| x/final | long_context | 0-15 | 3 | 1 | 2.00 | – | 1.00 | 0.00 |"
    assert lines[4].startswith("| x/final | long_context | >=32 | 1 | 1 | 2.00 |")
    assert len(lines) == 5
    assert format_context_table([engine]) == ""


def test_wandb_keys_name_every_number_a_row_holds():
    """0.01 s. What a drafter's W&B run gets, from its rows alone: the summary keys (interval,
    alpha_i without the unmeasured ones, MT-bench turns, context buckets) and both tables."""
    row = {"drafter": "d", "bench": "mt_bench", "tau": 1.5, "tau_ci95": [1.4, 1.6],
           "speedup": 1.2, "spec_tokens_per_s": 30.0, "plain_tokens_per_s": 25.0,
           "alpha": [0.5, None], "prompts": 20, "tokens": 900,
           "per_turn": [{"turn": 2, "tau": 1.4, "speedup": 1.1}],
           "by_context": [{"context_lo": 512, "context_hi": 1024, "steps": 40, "prompts": 9,
                           "tau": 1.3, "tau_ci95": [1.2, 1.4], "alpha": [None, 0.25]}]}  # fmt: skip
    summary = wandb_summary([row])
    assert summary == {
        "eval/mt_bench/tau": 1.5, "eval/mt_bench/tau_ci95_lo": 1.4,
        "eval/mt_bench/tau_ci95_hi": 1.6, "eval/mt_bench/speedup": 1.2,
        "eval/mt_bench/spec_tokens_per_s": 30.0, "eval/mt_bench/plain_tokens_per_s": 25.0,
        "eval/mt_bench/alpha_1": 0.5, "eval/mt_bench/turn2/tau": 1.4,
        "eval/mt_bench/turn2/speedup": 1.1, "eval/mt_bench/context_from_512/tau": 1.3,
        "eval/mt_bench/context_from_512/steps": 40,
        "eval/mt_bench/context_from_512/tau_ci95_lo": 1.2,
        "eval/mt_bench/context_from_512/tau_ci95_hi": 1.4,
        "eval/mt_bench/context_from_512/alpha_2": 0.25,
    }  # fmt: skip
    tables = wandb_tables([row])
    assert tables["eval/results"][1] == [["d", "mt_bench", 1.5, 1.2, 30.0, 25.0, 20, 900]]
    assert tables["eval/by_context"][1] == [["d", "mt_bench", 512, 1024, 40, 9, 1.3, 1.2, 1.4]]
