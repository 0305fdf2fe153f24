"""Settling earlier runs' unknown costs (datagen.openrouter.settle): the settler's readings of
the key's usage while this run spends too (a stub OpenRouter), and against the fake OpenRouter
over real sockets: a kill -9's orphans settled by the resumed run itself while it runs, a budget
full of them waited for (or exit 75 naming the time), a resume that ends too soon leaving them to
a later run, the worst case kept when something else used the key, and an OpenRouter failure
during settlement losing nothing. Money is checked against what the fake billed, and the hard
cap by replaying the ledger event by event against the fake's billing times."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import time

import pytest

from datagen.openrouter import key_usage
from datagen.openrouter import ledger as ledger_module
from datagen.openrouter.client import OpenRouter
from datagen.openrouter.ledger import KEY_USAGE_LAG_S, Ledger
from datagen.openrouter.settle import Settler, clock
from eagle3.errors import EXIT_UNAVAILABLE, RemoteError


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---------------------------------------------------------------------------- the settler


class StubOpenRouter:
    """The key's usage counter and generation costs, as the settler reads them."""

    def __init__(self, usage: float):
        self.usage = usage
        self.costs: dict[str, float] = {}

    async def key_usage(self) -> float | None:
        return self.usage

    async def generation_costs(self, ids: list[str]) -> dict[str, float]:
        return {i: self.costs[i] for i in ids if i in self.costs}


def a_moment_later(attempt):
    """``Settler.attempt`` a little later: ledger times are rounded to the millisecond, so an
    event written just now may carry a time a fraction of a millisecond ahead."""

    async def later(self, *args, **kwargs):
        await asyncio.sleep(0.002)
        return await attempt(self, *args, **kwargs)

    return later


def dead_run(path, start_usage: float) -> Ledger:
    """A run that charged $0.05 and died with $0.20 + $0.30 in flight (orphans)."""
    dead = Ledger(path)
    dead.record_key_usage(start_usage)
    a = dead.reserve(0.2, 100, "ds", 5.0, None)
    dead.charge(a, 0.05, 40, prompt_id="p", generation_id="g1", provider="X", ok=True)
    dead.reserve(0.2, 100, "ds", 5.0, None)
    dead.reserve(0.3, 100, "ds", 5.0, None)
    dead.close()
    return dead


def resumed_after_a_dead_run(tmp_path, monkeypatch):
    """The resumed run after dead_run (start $10.00), the key's counter at $10.15 (the orphans
    were billed $0.10 upstream), read at once (no usage lag) -> (path, api, ledger, settler)."""
    # the counter holds all at once: for the ledger's windows and for the rule's wait
    monkeypatch.setattr(ledger_module, "KEY_USAGE_LAG_S", 0.0)
    monkeypatch.setattr(key_usage, "KEY_USAGE_LAG_S", 0.0)
    monkeypatch.setattr(Settler, "attempt", a_moment_later(Settler.attempt))
    path = tmp_path / "ledger.jsonl"
    dead_run(path, 10.0)
    api = StubOpenRouter(10.0 + 0.05 + 0.10)
    led = Ledger(path)
    led.record_key_usage(api.usage)
    return path, api, led, Settler(led, api, timeout_s=0.0)


def test_this_runs_in_flight_spending_is_never_taken_for_the_dead_runs(tmp_path, monkeypatch):
    path, api, led, settler = resumed_after_a_dead_run(tmp_path, monkeypatch)
    mine = led.reserve(0.4, 100, "ds", 5.0, None)  # in flight, billed $0.35 already upstream
    api.usage += 0.35

    lines = asyncio.run(settler.attempt())
    # 0.45 is an upper bound on the orphans (they may be all of it); growth less this run's
    # worst case in flight (0.05) would under-count what was billed for them
    assert lines == [
        f"ledger: 2 orphaned request(s) of run {led.window().runs[0]} counted at $0.4500 for "
        "now (worst case $0.5000; from the key's usage, an upper bound while $0.4000 of this "
        "directory's latest spending (in flight, of unknown cost or too recent for the "
        "counter) may or may not be in it)"
    ]
    assert led.spent_usd + led.reserved_usd >= api.usage - 10.0
    assert led.spent_usd == pytest.approx(0.05 + 0.45) and settler.next_at is not None

    led.charge(mine, 0.35, 80, prompt_id="q", generation_id="g2", provider="X", ok=True)
    lines = asyncio.run(settler.attempt())  # nothing in flight: the reading is exact
    assert lines[-1].startswith("ledger: settled 2 orphaned request(s) of run")
    assert "at $0.1000 (worst case was $0.5000; from the key's usage)" in lines[-1]
    assert led.spent_usd == pytest.approx(api.usage - 10.0) and settler.next_at is None
    led.close()
    again = Ledger(path)
    assert again.spent_usd == pytest.approx(0.5) and again.window() is None
    again.close()


def test_a_reading_only_this_runs_unknown_costs_blur_stops_the_wait(tmp_path, monkeypatch):
    path, api, led, settler = resumed_after_a_dead_run(tmp_path, monkeypatch)
    timed_out = led.reserve(0.3, 100, "ds", None, None)  # a timeout: billed or not, unknown
    led.charge(timed_out, 0.3, 100, prompt_id="p", generation_id=None, provider=None, ok=False,
               cost_known=False, reason="timeout; cost unknown")  # fmt: skip
    api.usage += 0.02  # (it was billed $0.02)
    asyncio.run(settler.attempt())  # nothing in flight, still blurred by the timeout
    assert led.spent_usd == pytest.approx(0.05 + 0.12 + 0.3)  # the bound: 0.17 - 0.05
    # settling at $0 would make room, but until this run sends again every reading is this one
    assert not settler.could_fit(0.3, 0.7) and settler.next_at is not None
    again = led.reserve(0.01, 1, "ds", None, None)
    assert settler.could_fit(0.3, 0.7)
    led.release(again)
    led.close()


def test_generation_lookups_settle_this_runs_unknowns_too_while_a_window_is_open(
    tmp_path, monkeypatch
):
    path, api, led, settler = resumed_after_a_dead_run(tmp_path, monkeypatch)
    r = led.reserve(0.3, 100, "ds", None, None)
    led.charge(r, 0.3, 100, prompt_id="p", generation_id="gen-7", provider="X", ok=True,
               cost_known=False, reason="ok; cost unknown")  # fmt: skip
    api.usage += 0.04
    api.costs["gen-7"] = 0.04
    lines = asyncio.run(settler.attempt())  # this run's own lookup is not reported as earlier
    assert len(lines) == 1 and "settled 2 orphaned request(s)" in lines[0] and "$0.1000" in lines[0]
    assert led.spent_usd == pytest.approx(api.usage - 10.0) and settler.settled.requests == 2
    led.close()


# ---------------------------------------------------------------------------- kill -9, resume


def kill_mid_run(tmp_path, fake, h, timeout_s: float, prompts: int = 16, **fake_config):
    """Start the CLI on ``prompts`` prompts (8 in flight, 1 s each), kill -9 it after 8 are
    written with 6+ in flight; returns the fake, the command line and the ledger as the kill
    left it."""
    server = fake(latency=1.0, **fake_config)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=8)
    with open(cfg, "a") as f:
        f.write(f"request_timeout_s: {timeout_s}\n")
    h.write_prompts(tmp_path / "p.jsonl", prompts)
    out = tmp_path / "out"
    args = h.argv(5, cfg, tmp_path / "p.jsonl", out, server)
    proc = h.spawn_cli(*args)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        (out / "p.jsonl").exists()
        and (out / "p.jsonl").read_bytes().count(b"\n") >= 8
        and server.stats.inflight >= 6
    ):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    dead = Ledger(out / "ledger.jsonl")
    dead.close()
    assert dead.orphans >= 6
    return server, args, dead


def safe_at(dead: Ledger, timeout_s: float) -> float:
    """When the dead run's orphans can be settled (its last event + timeout + counter lag)."""
    run = next(iter(dead.unknown.values())).run
    return dead.runs[run].last_ts + timeout_s + KEY_USAGE_LAG_S


def assert_cap_held(tmp_path, out, server, budget: float | None = None) -> None:
    """Replay the ledger event by event: what it counted from each event on (spent plus open
    reservations, as a run loading that prefix would) covers what the fake had billed before
    the next event, and stays within the budget."""
    lines = (out / "ledger.jsonl").read_text().splitlines(keepends=True)
    prefix = tmp_path / "replay" / "ledger.jsonl"
    prefix.parent.mkdir()
    bills = sorted(server.stats.bills)
    stamps = [json.loads(line)["ts"] for line in lines] + [math.inf]
    billed, i = 0.0, 0
    for k in range(len(lines)):
        prefix.write_text("".join(lines[: k + 1]))
        led = Ledger(prefix)
        led.close()
        while i < len(bills) and bills[i][0] < stamps[k + 1]:
            billed += bills[i][1]
            i += 1
        assert led.spent_usd >= billed - 1e-12, (k, lines[k], led.spent_usd, billed)
        assert budget is None or led.spent_usd <= budget + 1e-9, (k, lines[k], led.spent_usd)
    assert i == len(bills)


@pytest.mark.slow
def test_the_resumed_run_settles_a_kill_9s_orphans_while_it_runs(tmp_path, fake, cli, h):
    """Costs ~20 s: a kill after ~2 s, then a resume of ~14 s (120 prompts, 8 in flight, 1 s
    each) that outlasts request_timeout_s (2 s) + 5 s, and a replay of ~300 ledger events."""
    timeout_s = 2.0
    # answers of 5-10 tokens: the orphans' worst case (256 tokens each) is far above their cost
    server, args, dead = kill_mid_run(
        tmp_path, fake, h, timeout_s, prompts=120, completion_tokens=(5, 10)
    )
    out, n, worst = tmp_path / "out", dead.orphans, dead.orphan_usd
    run = next(iter(dead.unknown.values())).run
    code, stdout, stderr = cli(*args)  # at once
    assert code == 0, stderr
    assert (
        f"ledger: {n} orphaned request(s) of run {run} kept at their worst case ${worst:.4f} "
        f"for now: the run stopped " in stderr
    )
    assert f"its requests may still be billed; they can be settled from {clock(safe_at(dead, timeout_s))}" in stderr  # fmt: skip
    ids = [r["id"] for r in h.read_jsonl(tmp_path / "p.jsonl")]
    done = [r["id"] for r in h.read_jsonl(out / "p.jsonl")]
    assert sorted(done) == sorted(ids)

    # while requests of its own were in flight: an upper bound, relief for the budget at once
    bound = re.search(
        rf"ledger: {n} orphaned request\(s\) of run {run} counted at \$([0-9.]+) for now "
        rf"\(worst case \${worst:.4f}; from the key's usage, an upper bound while",
        stderr,
    )
    assert bound, stderr
    # then, with nothing in flight, exact
    settled = re.search(
        rf"ledger: settled {n} orphaned request\(s\) of run {run} at \$([0-9.]+) "
        rf"\(worst case was \${worst:.4f}; from the key's usage\)",
        stderr,
    )
    assert settled, stderr[-3000:]
    assert float(settled.group(1)) <= float(bound.group(1)) < worst
    events = h.read_jsonl(out / "ledger.jsonl")
    kinds = [e["t"] for e in events]
    assert kinds.index("bound_orphans") < max(i for i, t in enumerate(kinds) if t == "charge")
    assert kinds.count("settle_orphans") == 1 and events[-1]["t"] == "settle_orphans"

    billed = server.stats.charged_usd
    led = Ledger(out / "ledger.jsonl")
    assert led.orphans == 0 and led.spent_usd == pytest.approx(billed, abs=1e-9)
    led.close()
    assert f"${billed:.2f} spent" in last_line(stdout)
    assert f"(incl. {n} earlier request(s) settled at ${events[-1]['usd']:.4f}" in last_line(stdout)
    assert_cap_held(tmp_path, out, server)


@pytest.mark.slow
def test_a_budget_full_of_orphans_exits_75_or_waits_and_finishes(tmp_path, fake, cli, h):
    """Costs ~15 s: a kill after ~2 s; a resume with --no-wait-for-orphans (exit 75, ~1 s); a
    resume that waits ~7 s for request_timeout_s (2 s) + 5 s, settles and generates the rest."""
    timeout_s = 2.0
    server, args, dead = kill_mid_run(
        tmp_path, fake, h, timeout_s, prompts=40, completion_tokens=(5, 10)
    )
    out, n, worst = tmp_path / "out", dead.orphans, dead.orphan_usd
    run = next(iter(dead.unknown.values())).run
    per_request = worst / n  # (each orphan is one single-turn prompt's worst case)
    budget = dead.spent_usd + per_request / 2  # no request fits beside the orphans
    args[1] = budget
    chats = server.stats.chat

    code, stdout, stderr = cli(*args, "--no-wait-for-orphans")
    assert code == 75, stderr
    assert server.stats.chat == chats  # nothing was sent
    assert (
        f"stopped: ${worst:.4f} of the budget is held by {n} request(s) of run {run} of unknown "
        f"cost, counted at their worst case; OpenRouter's figures settle them from "
        f"{clock(safe_at(dead, timeout_s))}: re-run the same command then (without "
        "--no-wait-for-orphans a run waits for that itself)"
    ) in stderr
    assert "remaining" in last_line(stdout)

    code, stdout, stderr = cli(*args)  # waits for the settlement, then goes on
    assert code == 0, stderr
    assert (
        f"waiting for the budget: ${worst:.4f} of it is held by {n} request(s) of run {run} "
        f"that OpenRouter may bill until {clock(safe_at(dead, timeout_s))}; settled in "
    ) in stderr
    assert f"ledger: settled {n} orphaned request(s) of run {run} at $" in stderr
    assert "stopping (budget)" not in stderr
    ids = [r["id"] for r in h.read_jsonl(tmp_path / "p.jsonl")]
    done = [r["id"] for r in h.read_jsonl(out / "p.jsonl")]
    assert sorted(done) == sorted(ids) and last_line(stdout).startswith("summary: 40/40")
    billed = server.stats.charged_usd
    led = Ledger(out / "ledger.jsonl")
    assert led.spent_usd == pytest.approx(billed, abs=1e-9) and billed <= budget
    led.close()
    assert_cap_held(tmp_path, out, server, budget)


@pytest.mark.slow
def test_a_resume_that_ends_too_soon_leaves_them_to_a_later_run(tmp_path, fake, cli, h):
    """Costs ~12 s: a kill after ~2 s, a resume of ~2 s that ends before request_timeout_s
    (4 s) + 5 s, a wait for that, and a resume that settles them at its start."""
    timeout_s = 4.0
    server, args, dead = kill_mid_run(tmp_path, fake, h, timeout_s)
    n, worst, run = dead.orphans, dead.orphan_usd, next(iter(dead.unknown.values())).run
    out = tmp_path / "out"
    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    assert (
        f"note: ${worst:.4f} of the spend is {n} request(s) of run {run} of unknown cost, "
        f"counted at their worst case; a run after {clock(safe_at(dead, timeout_s))} settles "
        "them from the key's usage"
    ) in stderr
    led = Ledger(out / "ledger.jsonl")
    assert led.orphans == n and led.spent_usd > server.stats.charged_usd
    led.close()

    time.sleep(max(0.0, safe_at(dead, timeout_s) - time.time()) + 0.2)
    code, stdout, stderr = cli(*args)  # later: settled at its start, from the key's usage
    assert code == 0, stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("ledger: settled")]
    assert line.startswith(f"ledger: settled {n} orphaned request(s) of run {run} at $")
    assert line.endswith(f"(worst case was ${worst:.4f}; from the key's usage)")
    led = Ledger(out / "ledger.jsonl")
    billed = server.stats.charged_usd
    assert led.orphans == 0 and led.spent_usd == pytest.approx(billed, abs=1e-9)
    led.close()
    assert f"${billed:.2f} spent" in last_line(stdout)
    assert_cap_held(tmp_path, out, server)


@pytest.mark.slow
def test_orphans_stay_at_worst_case_when_something_else_used_the_key(tmp_path, fake, cli, h):
    """Costs ~10 s: a kill after ~2 s, a wait for request_timeout_s (2 s) + 5 s, a resume."""
    timeout_s = 2.0
    server, args, dead = kill_mid_run(tmp_path, fake, h, timeout_s)
    time.sleep(max(0.0, safe_at(dead, timeout_s) - time.time()) + 0.2)
    server.stats.charged_usd += 1.0  # another program spent $1 on the same key meanwhile
    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    events = h.read_jsonl(tmp_path / "out" / "ledger.jsonl")
    run = next(e["run"] for e in events if e["t"] == "reserve")
    assert (
        f"ledger: {dead.orphans} orphaned request(s) of run {run} kept at their worst case "
        f"${dead.orphan_usd:.4f} for good: the key's usage grew $" in stderr
    )
    assert "something else used the key meanwhile" in stderr
    (settle,) = [e for e in events if e["t"] == "settle_orphans"]
    assert settle["how"] == "worst case" and settle["usd"] == pytest.approx(dead.orphan_usd)
    led = Ledger(tmp_path / "out" / "ledger.jsonl")
    charged = sum(e["usd"] for e in events if e["t"] == "charge")
    assert led.spent_usd == pytest.approx(charged + dead.orphan_usd)
    assert led.spent_usd >= server.stats.charged_usd - 1.0  # never below what we were billed
    led.close()


def test_an_openrouter_failure_while_settling_loses_nothing(tmp_path, fake, cli, h, monkeypatch):
    # no_cost: a 200 without usage.cost, counted at worst case until GET /generation settles it
    server = fake(faults={"no_cost": 0.5}, seed=3)
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 12, multi_every=3)
    out = tmp_path / "out"
    args = h.argv(1, cfg, tmp_path / "p.jsonl", out, server)
    code, _, stderr = cli(*args)
    assert code == 0, stderr
    before = Ledger(out / "ledger.jsonl")
    before.close()
    unknown = [u for u in before.unknown.values() if u.generation_id]
    results = (out / "p.jsonl").read_bytes()
    assert unknown and before.spent_usd > server.stats.charged_usd + 1e-6

    async def fails(self, ids):
        raise RemoteError("GET /generation failed (stub): re-run the same command later")

    real = OpenRouter.generation_costs
    monkeypatch.setattr(OpenRouter, "generation_costs", fails)
    code, stdout, stderr = cli(*args)  # the lookup fails half-way into settlement
    assert code == EXIT_UNAVAILABLE and stdout == "" and "Traceback" not in stderr
    assert (
        last_line(stderr) == "error: GET /generation failed (stub): re-run the same command later"
    )
    after = Ledger(out / "ledger.jsonl")  # whole lines only, the same money and unknowns
    after.close()
    assert after.spent_usd == pytest.approx(before.spent_usd, abs=1e-12)
    assert sorted(after.unknown) == sorted(before.unknown) and after.open == 0
    assert (out / "p.jsonl").read_bytes() == results

    monkeypatch.setattr(OpenRouter, "generation_costs", real)
    code, stdout, stderr = cli(*args)  # OpenRouter answers again: settled, nothing lost
    assert code == 0, stderr
    assert f"ledger: settled {len(unknown)} request(s) of unknown cost at $" in stderr
    led = Ledger(out / "ledger.jsonl")
    assert led.spent_usd == pytest.approx(server.stats.charged_usd, abs=1e-9)
    led.close()
    assert (out / "p.jsonl").read_bytes() == results
