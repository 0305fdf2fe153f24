"""Spend ledger: pure budget functions, reserve/settle, persistence across runs, orphans."""

import json

import pytest

from datagen.ledger import Ledger, Reservation, fits, upper_prompt_tokens, worst_case_usd


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
