"""The async requester (datagen.openrouter.requester): its shared 429 gate and adaptive
concurrency limit on a real event loop, and the resume guarantees with a real subprocess
(kill -9 mid-run, SIGTERM, abandoned requests)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from datagen.openrouter.ledger import Ledger
from datagen.openrouter.requester import MIN_CONCURRENCY, Throttle, interleave
from eagle3.data.prompts import Prompt


def test_limit_cuts_once_per_round_and_gate_holds_everyone():
    async def scenario():
        loop = asyncio.get_running_loop()
        t = Throttle(100)
        sent = loop.time()
        for _ in range(50):  # 50 429s of requests sent in the same round: one cut
            t.on_rate_limit(0.05, sent)
        assert t.limit == 70
        assert t.gate_until >= loop.time() + 0.04
        t.on_rate_limit(None, loop.time())  # a request sent after the cut: cut again
        assert t.limit == 49
        start = loop.time()
        await t.acquire()  # the gate holds the sender until the hint has passed
        assert loop.time() >= t.gate_until - 1e-3 and loop.time() > start
        t.release()
        for _ in range(50):
            t.on_rate_limit(0.0, loop.time() + 1)
        assert t.limit == MIN_CONCURRENCY

    asyncio.run(scenario())


def test_acquire_blocks_at_the_limit_and_release_wakes():
    async def scenario():
        t = Throttle(2)
        await t.acquire()
        await t.acquire()
        waiter = asyncio.create_task(t.acquire())
        await asyncio.sleep(0)
        assert not waiter.done() and t.active == 2
        t.release()
        await asyncio.wait_for(waiter, 1)
        assert t.active == 2

    asyncio.run(scenario())


def test_interleave_round_robins_datasets():
    def ps(name, n):
        return [Prompt(f"{name}{i}", name, [{"role": "user", "content": "x"}]) for i in range(n)]

    order = [p.id for p in interleave([ps("a", 3), ps("b", 1), ps("c", 2)])]
    assert order == ["a0", "b0", "c0", "a1", "c1", "a2"]


# ---------------------------------------------------------------------------- resume


def wait_for_lines(path: Path, n: int, proc, timeout: float = 60.0) -> None:
    """Wait until ``path`` has ``n`` whole lines (not a timing assertion: a generous deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the CLI exited early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"{path} did not reach {n} lines")


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_completes_each_prompt_once(tmp_path, fake, cli, h):
    """A real SIGKILL of the CLI subprocess mid-run (400 prompts, 20 in flight, 429s and empty
    answers injected), then a resume: every line the kill left parses, every prompt lands exactly
    once, and the ledger's charges plus the killed run's in-flight requests at their worst case
    cover what the fake billed, within the budget. Only a real kill -9 skips every shutdown path.
    Costs ~7 s (its call; measured on 2 xdist workers)."""
    server = fake(latency=0.05, faults={"429": 0.05, "empty": 0.05}, seed=5)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=20)
    ids = h.write_prompts(tmp_path / "p.jsonl", 400, multi_every=5)
    out = tmp_path / "out"
    args = [
        "--budget",
        2,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    ]
    proc = h.spawn_cli(*args)
    wait_for_lines(out / "p.jsonl", 40, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_at = h.read_jsonl(out / "p.jsonl")  # every whole line parses
    assert 40 <= len(killed_at) < 400

    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    final = [r["id"] for r in h.read_jsonl(out / "p.jsonl")]
    assert len(final) == len(set(final)) == 400 and set(final) == set(ids)
    assert stdout.strip().splitlines()[-1].startswith("summary: 400/400 prompts done")
    # money: what the ledger counts (charges + requests in flight at the kill, at their worst
    # case) covers what the server billed, and stays within the budget
    totals = h.ledger_totals(out)
    assert totals["charged"] + totals["orphan"] >= server.stats.charged_usd - 1e-9
    assert totals["charged"] + totals["orphan"] <= 2 + 1e-9


@pytest.mark.slow
def test_sigterm_stops_sending_finishes_in_flight_and_exits_75(tmp_path, fake, cli, h):
    """SIGTERM to the CLI subprocess: it stops sending, lets the requests in flight finish and
    charges them (no orphans; the ledger equals what the fake billed), exits 75 with a summary
    naming what remains, and a resume completes the rest: the graceful stop through a real signal.
    Costs ~1 s (its call; measured on 2 xdist workers)."""
    server = fake(latency=0.05)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=20, grace=30)
    ids = h.write_prompts(tmp_path / "p.jsonl", 400)
    out = tmp_path / "out"
    args = [
        "--budget",
        2,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    ]
    proc = h.spawn_cli(*args)
    wait_for_lines(out / "p.jsonl", 30, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    assert "stopped: interrupted (signal SIGTERM)" in stderr
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("summary: ") and "remaining" in summary
    totals = h.ledger_totals(out)
    assert totals["orphan"] == 0  # in-flight requests were let finish and settled
    assert totals["charged"] == pytest.approx(server.stats.charged_usd)

    code, _, stderr = cli(*args)
    assert code == 0, stderr
    final = [r["id"] for r in h.read_jsonl(out / "p.jsonl")]
    assert sorted(final) == sorted(ids)


@pytest.mark.slow
def test_requests_abandoned_after_the_grace_period_count_at_worst_case(tmp_path, fake, cli, h):
    """Requests still in flight when the grace period after SIGINT ends are abandoned: exit 75, the
    ledger counts all 8 as orphans at their worst case and the summary's spend includes them, so a
    request whose cost is unknown cannot let a later run overspend the budget. Costs ~0.6 s (its
    call: a CLI subprocess; measured on 2 xdist workers)."""
    server = fake(latency=1.0)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=8, grace=0.2)
    h.write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "out"
    args = [
        "--budget",
        2,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    ]
    proc = h.spawn_cli(*args)
    deadline = time.monotonic() + 60
    while server.stats.inflight < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    assert "abandoning 8 in-flight request(s)" in stderr
    led = Ledger(out / "ledger.jsonl")
    assert led.orphans == 8 and led.orphan_usd > 0
    assert f"${led.spent_usd:.2f} spent" in stdout.strip().splitlines()[-1]
    led.close()
