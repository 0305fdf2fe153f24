"""Spend ledger: pure budget functions, reserve/settle, persistence across runs, orphans, the
key-usage settlement rule (a table) and bounds."""

import json
import time

import pytest

from datagen.openrouter.key_usage import Settlement, decide_settlement
from datagen.openrouter.ledger import (
    KEY_USAGE_LAG_S,
    Ledger,
    Reservation,
    fits,
    upper_prompt_tokens,
    worst_case_usd,
)


def test_worst_case_and_fits():
    # 1000 prompt tokens at $0.60/M + 16384 completion at $3.00/M
    assert worst_case_usd(1000, 16384, 0.6e-6, 3.0e-6) == pytest.approx(0.0006 + 0.049152)
    assert worst_case_usd(10, 10, 1e-6, 1e-6, request_price=0.5) == pytest.approx(0.50002)
    assert fits(0.5, 0.3, 0.2, 1.0)
    assert not fits(0.5, 0.3, 0.21, 1.0)
    assert fits(99.0, 0.0, 1e6, None)


def test_upper_prompt_tokens_bounds_bytes():
    msgs = [{"role": "user", "content": "héllo"}]  # 6 bytes
    assert upper_prompt_tokens(msgs) == 64 + 6 + 16
    assert upper_prompt_tokens(msgs * 3) == 64 + 3 * 22


def test_reserve_charge_release_and_reload(tmp_path):
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path)
    a = led.reserve(0.4, 100, "ds", budget_usd=1.0, budget_tokens=250)
    b = led.reserve(0.4, 100, "ds", budget_usd=1.0, budget_tokens=250)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    assert led.reserve(0.4, 10, "ds", 1.0, None) == "budget"  # 0.8 reserved + 0.4 > 1.0
    assert led.reserve(0.1, 100, "ds", 1.0, 250) == "tokens"  # 200 + 100 > 250
    assert led.reserve(0.1, 100, "other", 1.0, 250) != "tokens"  # per dataset
    led.charge(a, 0.05, 40, prompt_id="p1", generation_id="gen-1", provider="Chutes", ok=True)
    led.release(b)
    assert led.spent_usd == pytest.approx(0.05)
    assert led.spent_tokens("ds") == 40
    assert led.open == 1 and led.reserved_usd == pytest.approx(0.1)
    led.close()

    again = Ledger(path)  # the "other" reservation was never settled: an orphan
    assert again.charged_usd == pytest.approx(0.05)
    assert again.orphans == 1 and again.orphan_usd == pytest.approx(0.1)
    assert again.spent_usd == pytest.approx(0.15)
    assert again.spent_tokens("ds") == 40 and again.spent_tokens("other") == 100
    charge = [json.loads(x) for x in path.read_text().splitlines() if '"charge"' in x][0]
    assert charge["generation_id"] == "gen-1" and charge["provider"] == "Chutes"
    again.close()


def test_billed_failure_counts(tmp_path):
    led = Ledger(tmp_path / "ledger.jsonl")
    r = led.reserve(0.01, 50, "ds", 1.0, None)
    led.charge(
        r,
        0.004,
        30,
        prompt_id="p",
        generation_id="g",
        provider="X",
        ok=False,
        reason="empty content",
    )
    assert led.spent_usd == pytest.approx(0.004)
    led.close()
    assert Ledger(tmp_path / "ledger.jsonl").spent_usd == pytest.approx(0.004)


def test_unreadable_line_is_skipped(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"t":"charge","rid":"x","usd":0.5,"tokens":3,"dataset":"d"}\nnot json\n')
    led = Ledger(path)
    assert led.spent_usd == pytest.approx(0.5)
    led.close()


# ---------------------------------------------------------------------------- orphan settlement

S = 100.0  # the key's usage at the start of the first run with unknowns


# timeout 30 s + KEY_USAGE_LAG_S 5 s: a dead run's requests are decided from 35 s after its
# last event. ``unsure``: this run's open reservations and cost-unknown charges (worst case);
# ``young``: charges the counter may not hold yet (left out of ``known``).
@pytest.mark.parametrize(
    "start, now, known, worst, idle, unsure, young, action, usd, cause, retry, why",
    [
        (S, S + 1.30, 1.00, 0.50, 60, 0, 0, "settle", 0.30, "", None, "from the key's usage"),
        (S, S + 1.00, 1.00, 0.50, 60, 0, 0, "settle", 0.00, "", None, "key's usage"),  # unbilled
        (S, S + 1.505, 1.00, 0.50, 60, 0, 0, "settle", 0.50, "", None, "usage"),  # a cent over
        (S, S + 0.995, 1.00, 0.50, 60, 0, 0, "settle", 0.00, "", None, "key's usage"),  # under
        (S, S + 2.00, 1.00, 0.50, 60, 0, 0, "worst_case", 0.50, "", None, "something else used"),
        (S, S + 0.90, 1.00, 0.50, 60, 0, 0, "later", 0.50, "reading", 30, "less than the $1.0000"),
        (S, None, 1.00, 0.50, 60, 0, 0, "later", 0.50, "reading", 30, "could not be read"),
        (S, S + 1.30, 1.00, 0.50, 5, 0, 0, "later", 0.50, "time", 30, "may still be billed"),
        (S, S + 1.30, 1.00, 0.50, 32, 0, 0, "later", 0.50, "time", 3, "+ 5s: its requests"),
        (S, S + 1.30, 1.00, 0.50, None, 0, 0, "later", 0.50, "time", None, "may still be billed"),
        (None, S + 1.30, 1.00, 0.50, 60, 0, 0, "worst_case", 0.50, "", None, "no key-usage snap"),
        # this run has $0.40 in flight, $0.15 of it billed already: 0.30 + 0.15 is an upper
        # bound, counted until a reading with nothing in flight; 0.45 - 0.40 would under-count
        (S, S + 1.45, 1.00, 0.50, 60, 0.40, 0, "bound", 0.45, "blur", 30, "an upper bound"),
        (S, S + 1.55, 1.00, 0.50, 60, 0.40, 0, "later", 0.50, "blur", 30, "says no less"),
        # above the worst case, but this run's own spending may be why: not for good
        (S, S + 1.85, 1.00, 0.50, 60, 0.40, 0, "later", 0.50, "blur", 30, "may or may not"),
        (S, S + 1.95, 1.00, 0.50, 60, 0.40, 0, "worst_case", 0.50, "", None, "something else"),
        # $0.10 charged 2 s ago may be in the counter or not: retry when it surely is
        (S, S + 1.30, 0.90, 0.50, 60, 0, 0.10, "bound", 0.40, "blur", 3, "too recent"),
        (S, S + 1.30, 0.90, 0.50, 60, 0.05, 0.10, "bound", 0.40, "blur", 30, "an upper bound"),
    ],
)
def test_decide_settlement(
    start, now, known, worst, idle, unsure, young, action, usd, cause, retry, why
):
    d = decide_settlement(
        start, now, known, worst, idle, 30, unsure_usd=unsure, young_usd=young, young_in_s=3.0
    )
    assert (d.action, d.cause) == (action, cause) and d.usd == pytest.approx(usd)
    assert d.retry_s == (None if retry is None else pytest.approx(retry)) and why in d.why
    assert "\n" not in d.why


def dead_run_with_an_unknown_cost(path):
    """A run that charged $0.05, got a 200 without usage.cost ($0.20 at worst case) and died
    with $0.20 + $0.30 in flight (orphans) -> (its ledger, closed; the unknown's reservation)."""
    dead = Ledger(path)
    dead.record_key_usage(10.0)
    a = dead.reserve(0.2, 100, "ds", 5.0, None)
    dead.charge(a, 0.05, 40, prompt_id="p", generation_id="g1", provider="X", ok=True)
    dead.reserve(0.2, 100, "ds", 5.0, None)  # in flight at the kill: orphans
    dead.reserve(0.3, 100, "ds", 5.0, None)
    b = dead.reserve(0.2, 100, "ds", 5.0, None)  # a 200 without usage.cost
    dead.charge(b, 0.2, 100, prompt_id="q", generation_id="g2", provider="X", ok=True,
                cost_known=False, reason="ok; cost unknown, counted at worst case")  # fmt: skip
    dead.close()
    return dead, b


def test_settlement_persists_and_frees_the_worst_case(tmp_path):
    path = tmp_path / "ledger.jsonl"
    dead, b = dead_run_with_an_unknown_cost(path)

    led = Ledger(path)
    assert led.spent_usd == pytest.approx(0.05 + 0.2 + 0.3 + 0.2)
    assert sorted(u.orphan for u in led.unknown.values()) == [False, True, True]
    led.settle_generation(b.rid, 0.01)  # GET /generation's total_cost
    window = led.window()
    assert window.runs == [dead.run] and window.start_usage == 10.0
    assert window.known_usd == pytest.approx(0.06) and window.worst_usd == pytest.approx(0.5)
    d = decide_settlement(window.start_usage, 10.16, window.known_usd, window.worst_usd, 99, 30)
    led.settle_window(window, d)
    assert led.spent_usd == pytest.approx(0.16) and led.orphans == 0 and led.window() is None
    assert led.spent_tokens("ds") == 40 + 100 + 200  # settled orphans keep worst-case tokens
    led.close()

    again = Ledger(path)
    assert again.spent_usd == pytest.approx(0.16) and again.window() is None
    assert again.spent_tokens("ds") == 340
    again.close()


def test_a_bound_counts_until_settled_and_survives_a_reload(tmp_path):
    path = tmp_path / "ledger.jsonl"
    dead, b = dead_run_with_an_unknown_cost(path)

    led = Ledger(path)  # the resumed run: its own spending is part of what the counter holds
    led.record_key_usage(10.3)
    mine = led.reserve(0.4, 100, "ds", 5.0, None)
    window = led.window()
    assert window.runs == [dead.run] and window.worst_usd == pytest.approx(0.7)
    assert window.unsure_usd == pytest.approx(0.4) and window.held_usd == pytest.approx(0.7)
    led.charge(mine, 0.1, 50, prompt_id="r", generation_id="g3", provider="X", ok=True)
    now = led.window()  # every charge here is younger than KEY_USAGE_LAG_S
    assert now.known_usd == pytest.approx(0.15) and now.young_usd == pytest.approx(0.15)
    assert now.unsure_usd == 0 and 0 < now.young_in_s <= KEY_USAGE_LAG_S + 1e-3  # (ts in ms)
    later = led.window(time.time() + KEY_USAGE_LAG_S + 0.01)  # the counter holds it by then
    assert later.young_usd == 0 and later.known_usd == pytest.approx(0.15)

    led.settle_window(window, Settlement("bound", 0.25, "an upper bound"))
    assert led.spent_usd == pytest.approx(0.05 + 0.25 + 0.1)
    led.settle_window(led.window(), Settlement("bound", 0.3, "looser"))  # not written
    led.close()
    events = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["t"] for e in events].count("bound_orphans") == 1

    again = Ledger(path)  # the bound holds across runs, the requests stay to be settled
    assert again.spent_usd == pytest.approx(0.4) and len(again.window().unknowns) == 3
    assert again.window().held_usd == pytest.approx(0.25)
    again.settle_generation(b.rid, 0.01)  # one of them settled on its own: the bound is void
    assert again.spent_usd == pytest.approx(0.05 + 0.5 + 0.01 + 0.1)
    again.settle_window(again.window(), Settlement("settle", 0.12, "from the key's usage"))
    assert again.spent_usd == pytest.approx(0.05 + 0.12 + 0.01 + 0.1) and again.window() is None
    again.close()
    final = Ledger(path)
    assert final.spent_usd == pytest.approx(0.28) and final.bound_relief_usd == 0
    final.close()


def test_this_runs_cost_unknown_charges_blur_the_window_not_join_it(tmp_path):
    path = tmp_path / "ledger.jsonl"
    dead = Ledger(path)
    dead.record_key_usage(1.0)
    dead.reserve(0.2, 100, "ds", 5.0, None)
    dead.close()
    led = Ledger(path)
    r = led.reserve(0.3, 100, "ds", 5.0, None)
    led.charge(r, 0.3, 100, prompt_id="p", generation_id="g", provider="X", ok=True,
               cost_known=False, reason="ok; cost unknown")  # fmt: skip
    window = led.window()
    assert [u.run for u in window.unknowns] == [dead.run]
    assert window.unsure_usd == pytest.approx(0.3) and led.unknown[r.rid].run == led.run
    led.close()
