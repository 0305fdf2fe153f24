"""Real money against the fake OpenRouter, over real sockets: ad-hoc prompts mean only those
prompts, the key on every call, orphans of a kill -9 settled at what was billed, prompt caching
in the plan and the ledger, and the $/M output tokens paid on the progress line."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from datagen.ledger import Ledger

ROUTES = {
    "/api/v1/models/{author}/{slug}/endpoints",
    "/api/v1/key",
    "/api/v1/credits",
    "/api/v1/chat/completions",
    "/api/v1/generation",
}


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_prompts_without_datasets_run_only_those_prompts(tmp_path, fake, cli, h, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = fake()
    cfg = h.write_config(tmp_path / "c.yaml")
    with open(cfg, "a") as f:  # a mix that cannot load here: offline hub, a missing file
        f.write("datasets:\n  - {name: ultra, source: 'hf:HuggingFaceH4/ultrachat_200k'}\n")
        f.write(f"  - {{name: gone, source: {tmp_path / 'missing.jsonl'}}}\n")
    h.write_prompts(tmp_path / "p.jsonl", 6)
    args = h.argv(1, cfg, tmp_path / "p.jsonl", tmp_path / "out", server)
    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    assert last_line(stdout).startswith("summary: 6/6 prompts done, 0 remaining")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.jsonl")) == ["ledger.jsonl", "p.jsonl"]
    assert "only those prompts; the config's 2 dataset(s) are not run" in stderr

    code, _, stderr = cli(*args, "--datasets", "gone")  # named: the mix runs (and fails here)
    assert code == 2 and "missing.jsonl" in last_line(stderr)


def test_every_request_carries_the_key(tmp_path, fake, cli, h, monkeypatch):
    # no_cost: a 200 without usage.cost, counted at worst case, settled by GET /generation
    server = fake(api_key="sk-or-test", faults={"no_cost": 0.5}, seed=3)
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 12, multi_every=3)
    args = h.argv(1, cfg, tmp_path / "p.jsonl", tmp_path / "out", server)
    code, _, stderr = cli(*args)
    assert code == 0, stderr
    worst = Ledger(tmp_path / "out" / "ledger.jsonl")
    unknown = [u for u in worst.unknown.values() if u.generation_id]
    assert unknown and worst.spent_usd > server.stats.charged_usd + 1e-6
    worst.close()

    code, stdout, stderr = cli(*args)  # resume: nothing left to generate, the costs settle
    assert code == 0, stderr
    assert f"ledger: settled {len(unknown)} request(s) of unknown cost at $" in stderr
    assert "from GET /generation" in stderr
    led = Ledger(tmp_path / "out" / "ledger.jsonl")
    assert led.spent_usd == pytest.approx(server.stats.charged_usd, abs=1e-9)
    assert f"${server.stats.charged_usd:.2f} spent" in last_line(stdout)
    led.close()
    assert server.stats.unauthorised == 0 and set(server.stats.paths) == ROUTES

    monkeypatch.delenv("OPENROUTER_API_KEY")  # --plan without a key: one line, exit 2
    code, stdout, stderr = cli(*args, "--plan")
    assert code == 2 and server.stats.unauthorised == 1
    assert last_line(stderr) == (
        f"error: {server.server.url} wants an API key for the endpoint listing (401): "
        "export OPENROUTER_API_KEY"
    )


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


def test_prompt_caching_in_the_plan_and_the_ledger(tmp_path, fake, cli, h):
    server = fake(latency=0.1)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=2)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(10):
            turns = [
                {"from": "human", "value": "a" * 400},  # 100 + 8 = 108 tokens
                {"from": "gpt", "value": "(source answer)"},
                {"from": "human", "value": "b" * 200 + f"{i:04d}"},  # 51 + 8 = 59 tokens
            ]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    args = h.argv(100, cfg, tmp_path / "chat.jsonl", tmp_path / "out", server)
    code, stdout, stderr = cli(*args, "--plan")
    assert code == 0, stderr
    # hand computation, 2000 output tokens per answer (expected_output_tokens): turn 1 sends
    # 108, turn 2 108 + (2000 + 8) + 59 = 2175; its prefix 108 + 2008 = 2116 is cacheable.
    # Chutes (cheapest allowed, $0.45/M in, $2.20/M out) reads cache at $0.225/M.
    inp, cached, out = 108 + 2175, 2116, 4000
    plain = inp * 0.45e-6 + out * 2.20e-6
    with_cache = plain - cached * (0.45e-6 - 0.225e-6)
    assert (
        f"that prefix at Chutes's $0.225/M cached input): the datasets want ${10 * plain:.2f} "
        f"without caching, ${10 * with_cache:.2f} with "
        f"({100 * (with_cache - plain) / plain:+.1f}%)" in stdout
    )
    assert (
        f"caching chat: {cached} of {inp} input tok/prompt cacheable (93%); wanted "
        f"${10 * plain:.4f} without caching, ${10 * with_cache:.4f} with" in stdout
    )
    code, stdout, _ = cli(*args[:1], 0.044, *args[2:], "--plan")  # buys 4.48 vs 4.71 prompts
    assert f"buys {0.044 / plain:,.0f} prompts without, {0.044 / with_cache:,.0f} with" in stdout
    assert f"{0.044 / plain:,.0f}" == "4" and f"{0.044 / with_cache:,.0f}" == "5"

    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    charges = [e for e in h.read_jsonl(tmp_path / "out" / "ledger.jsonl") if e["t"] == "charge"]
    assert sum(e["cached_tokens"] for e in charges) == server.stats.cached_tokens > 0
    discount = sum(e["cache_discount"] or 0 for e in charges)
    assert discount == pytest.approx(server.stats.cache_discount_usd) and discount > 0
    assert sum(e["usd"] for e in charges) == pytest.approx(server.stats.charged_usd)
    assert f"{server.stats.cached_tokens:,} cached prompt tokens saved ${discount:.4f}" in (
        last_line(stdout)
    )
    # the progress line: $/M output tokens paid this run (all cost / output tokens) next to the
    # plan's blended figure at the cheapest allowed endpoint: plain / 4000 output tokens
    paid = re.findall(r"\$([0-9.]+)/M out paid \(plan \$([0-9.]+)/M\)", stderr)
    assert paid and paid[-1][1] == f"{plain / out * 1e6:.2f}" == "2.46"
    assert float(paid[-1][0]) > 0


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
