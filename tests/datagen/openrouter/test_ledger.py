"""Spend ledger: pure budget functions, reserve/settle, persistence across runs, orphans."""

import json

import pytest

from datagen.openrouter.ledger import (
    Ledger,
    Reservation,
    decide_settlement,
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


@pytest.mark.parametrize(
    "start, now, known, worst, idle, action, usd, why",
    [
        (S, S + 1.30, 1.00, 0.50, 60, "settle", 0.30, "from the key's usage"),
        (S, S + 1.00, 1.00, 0.50, 60, "settle", 0.00, "from the key's usage"),  # never billed
        (S, S + 1.505, 1.00, 0.50, 60, "settle", 0.50, "from the key's usage"),  # a cent over
        (S, S + 0.995, 1.00, 0.50, 60, "settle", 0.00, "from the key's usage"),  # a cent under
        (S, S + 2.00, 1.00, 0.50, 60, "worst_case", 0.50, "something else used the key"),
        (S, S + 0.90, 1.00, 0.50, 60, "later", 0.50, "less than the $1.0000 charged here"),
        (S, None, 1.00, 0.50, 60, "later", 0.50, "could not be read"),
        (S, S + 1.30, 1.00, 0.50, 5, "later", 0.50, "may still be billed"),  # too recent
        (S, S + 1.30, 1.00, 0.50, None, "later", 0.50, "may still be billed"),
        (None, S + 1.30, 1.00, 0.50, 60, "worst_case", 0.50, "no key-usage snapshot"),
    ],
)
def test_decide_settlement(start, now, known, worst, idle, action, usd, why):
    d = decide_settlement(start, now, known, worst, idle, timeout_s=30)
    assert d.action == action and d.usd == pytest.approx(usd) and why in d.why
    assert "\n" not in d.why


def test_settlement_persists_and_frees_the_worst_case(tmp_path):
    path = tmp_path / "ledger.jsonl"
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
