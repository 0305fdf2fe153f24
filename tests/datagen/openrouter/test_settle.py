"""Settling earlier runs' unknown costs against the fake OpenRouter, over real sockets: orphans of
a kill -9 settled at what the key was billed (or kept at worst case when something else used the
key), and an OpenRouter failure during settlement loses nothing."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from datagen.openrouter.client import OpenRouter
from datagen.openrouter.ledger import Ledger
from eagle3.errors import EXIT_UNAVAILABLE, RemoteError


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def kill_mid_run(tmp_path, fake, h, timeout_s: float):
    """Start the CLI, kill -9 it with requests in flight (1 s each); returns the fake, the
    command line, the ledger as the kill left it and when the kill was."""
    server = fake(latency=1.0)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=8)
    with open(cfg, "a") as f:
        f.write(f"request_timeout_s: {timeout_s}\n")
    h.write_prompts(tmp_path / "p.jsonl", 40)
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
    killed_at = time.monotonic()
    proc.communicate(timeout=30)
    dead = Ledger(out / "ledger.jsonl")
    dead.close()
    assert dead.orphans >= 6
    return server, args, dead, killed_at


@pytest.mark.slow
def test_kill_9_orphans_settled_at_what_the_key_was_billed(tmp_path, fake, cli, h):
    timeout_s = 3.0
    server, args, dead, killed_at = kill_mid_run(tmp_path, fake, h, timeout_s)
    orphans, worst, known = dead.orphans, dead.orphan_usd, dead.charged_usd
    out = tmp_path / "out"
    ids = [r["id"] for r in h.read_jsonl(tmp_path / "p.jsonl")]

    # at once: the orphans may still be running upstream, so they stay at worst case for now
    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    assert f"ledger: {orphans} orphaned request(s) of run" in stderr
    assert "may still be billed; a later resume settles them" in stderr
    assert sorted(r["id"] for r in h.read_jsonl(out / "p.jsonl")) == sorted(ids)

    while server.stats.inflight or time.monotonic() < killed_at + timeout_s + 0.2:
        time.sleep(0.05)
    code, stdout, stderr = cli(*args)  # later: settled from the key's usage
    assert code == 0, stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("ledger: settled")]
    m = re.fullmatch(
        rf"ledger: settled {orphans} orphaned request\(s\) of run \S+ at \$([0-9.]+) "
        rf"\(worst case was \${worst:.4f}; from the key's usage\)",
        line,
    )
    assert m, line
    led = Ledger(out / "ledger.jsonl")
    billed = server.stats.charged_usd
    assert led.orphans == 0 and led.spent_usd == pytest.approx(billed, abs=1e-9)
    assert f"${billed:.2f} spent" in last_line(stdout)
    settled = [e for e in h.read_jsonl(out / "ledger.jsonl") if e["t"] == "settle_orphans"]
    assert len(settled) == 1 and settled[0]["how"] == "key usage"
    assert settled[0]["usd"] == pytest.approx(float(m.group(1)), abs=1e-4)
    assert settled[0]["usd"] < settled[0]["worst_case_usd"] == pytest.approx(worst)
    print(
        f"\norphans {orphans}: worst case ${worst:.6f}, settled ${settled[0]['usd']:.6f}; "
        f"known before ${known:.6f}; ledger spent ${led.spent_usd:.6f}, fake billed ${billed:.6f}"
    )
    led.close()


@pytest.mark.slow
def test_orphans_stay_at_worst_case_when_something_else_used_the_key(tmp_path, fake, cli, h):
    timeout_s = 2.0
    server, args, dead, killed_at = kill_mid_run(tmp_path, fake, h, timeout_s)
    while server.stats.inflight or time.monotonic() < killed_at + timeout_s + 0.2:
        time.sleep(0.05)
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
