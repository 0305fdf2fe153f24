"""``python -m datagen.openrouter --audit-every N`` against the fake OpenRouter on a real socket.

The auditor is a stub (scoring under a real target is tested in tests/datagen/test_audit.py):
it flags a provider on its first check. The fake routes ``sort: price`` to Chutes, the cheapest allowed
endpoint, until Chutes is ignored, then to DeepInfra.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from datagen.openrouter import exclusions

REASON = "mean NLL 2.400 vs 1.100 for DeepInfra (stub)"


class StubAudit:
    """OnlineAudit's interface: a check every ``every`` records; flags ``flag`` at check 1."""

    def __init__(self, every=5, flag="Chutes", fail=False, sleep=0.0):
        self.every, self.flag, self.fail, self.sleep = every, flag, fail, sleep
        self.records, self.checks = 0, 0
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def add(self, record: dict) -> bool:
        self.records += 1
        return self.records % self.every == 0

    def check(self) -> dict[str, str]:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            time.sleep(self.sleep)
            self.checks += 1
            if self.fail:
                raise RuntimeError("scoring blew up")
            return {self.flag: REASON} if self.checks == 1 else {}
        finally:
            with self._lock:
                self.running -= 1


def spy_on_rules(server) -> list[list[str]]:
    """provider.ignore of every chat request the fake receives, in order."""
    seen: list[list[str]] = []
    fake = server.server
    reachable = fake.reachable

    def spy(provider, max_tokens):
        seen.append(list((provider or {}).get("ignore") or []))
        return reachable(provider, max_tokens)

    fake.reachable = spy
    return seen


@pytest.fixture
def stub(monkeypatch):
    """``stub(**StubAudit kwargs)`` installs a StubAudit as what make_audit returns."""
    made = SimpleNamespace(audit=None, calls=[])

    def install(**kwargs) -> StubAudit:
        made.audit = StubAudit(**kwargs)

        def make_audit(target, every, log_path, device_map=None):
            made.calls.append((target, every, log_path))
            return made.audit

        monkeypatch.setattr(exclusions, "make_audit", make_audit)
        return made.audit

    install.made = made
    return install


def run_cli(cli, server, tmp_path, h, *extra, n=30, concurrency=2):
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=concurrency)
    h.write_prompts(tmp_path / "chat.jsonl", n)
    out = tmp_path / "out"
    args = ["--budget", 5, "--config", cfg, "--prompts", tmp_path / "chat.jsonl", "--out", out]
    code, stdout, stderr = cli(*args, "--base-url", server.server.url, *extra)
    return code, stdout, stderr, out


def test_flagged_provider_is_ignored_for_the_rest_of_the_run_and_on_resume(
    tmp_path, fake, cli, h, stub
):
    server = fake(latency=0.02)
    seen = spy_on_rules(server)
    audit = stub(every=5)
    code, stdout, stderr, out = run_cli(
        cli, server, tmp_path, h, "--audit-every", 5, "--audit-target", "tiny"
    )
    assert code == 0, stderr
    assert stub.made.calls == [("tiny", 5, out / "audit.jsonl")]
    assert audit.checks >= 1
    assert f"audit: excluding chutes ({REASON})" in stderr
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("summary: 30/30 prompts done") and "audit excluded Chutes" in summary

    # Requests carry chutes in ignore from some point on, and every one after that does too.
    carried = ["chutes" in ignore for ignore in seen]
    k = carried.index(True)
    assert all(carried[k:]) and 5 <= k < len(seen)  # the first check is due after 5 records
    # The router reached Chutes only before that; never afterwards.
    assert server.stats.providers["chutes"] == k
    assert server.stats.providers["deepinfra"] == len(seen) - k
    records = h.read_jsonl(out / "chat.jsonl")
    assert sum(r["provider"] == "Chutes" for r in records) == k
    assert server.stats.violations == 0

    decisions = [e for e in h.read_jsonl(out / "audit.jsonl") if e.get("t") == "exclude"]
    assert [(e["provider"], e["slugs"], e["reason"]) for e in decisions] == [
        ("Chutes", ["chutes"], REASON)
    ]

    # A resumed run (audit off) starts with Chutes ignored and says so.
    seen.clear()
    code, stdout, stderr, out = run_cli(cli, server, tmp_path, h, n=40)
    assert code == 0, stderr
    assert "audit: ignoring chutes, excluded by an earlier run" in stderr
    assert len(seen) == 10 and all("chutes" in ignore for ignore in seen)
    assert "audit excluded Chutes" in stdout.strip().splitlines()[-1]


def test_never_two_checks_at_once(tmp_path, fake, cli, h, stub):
    server = fake(latency=0.002)
    audit = stub(every=1, flag="Nobody", sleep=0.05)  # a check due after every record
    code, _, stderr, out = run_cli(
        cli, server, tmp_path, h, "--audit-every", 1, "--audit-target", "tiny", concurrency=8
    )
    assert code == 0, stderr
    assert audit.most_running == 1
    assert 1 <= audit.checks < 30  # records that arrived during a check did not queue more


def test_unmapped_provider_is_logged_and_recorded(tmp_path, fake, cli, h, stub):
    server = fake(latency=0.002)
    seen = spy_on_rules(server)
    stub(every=5, flag="Mystery Cloud")
    code, stdout, stderr, out = run_cli(
        cli, server, tmp_path, h, "--audit-every", 5, "--audit-target", "tiny"
    )
    assert code == 0, stderr
    assert "'Mystery Cloud' is flagged but matches no endpoint" in stderr
    assert seen[-1] == seen[0]  # nothing new to ignore
    decisions = [e for e in h.read_jsonl(out / "audit.jsonl") if e.get("t") == "exclude"]
    assert [(e["provider"], e["slugs"], e["reason"]) for e in decisions] == [
        ("Mystery Cloud", [], REASON)
    ]


def test_failed_check_is_logged_and_the_run_goes_on(tmp_path, fake, cli, h, stub):
    server = fake(latency=0.002)
    stub(every=5, fail=True)
    code, stdout, stderr, _ = run_cli(
        cli, server, tmp_path, h, "--audit-every", 5, "--audit-target", "tiny"
    )
    assert code == 0, stderr
    assert "audit: check failed, generation goes on: RuntimeError: scoring blew up" in stderr
    assert stdout.strip().splitlines()[-1].startswith("summary: 30/30 prompts done")


def test_excluding_every_allowed_provider_stops_the_run(tmp_path, fake, cli, h, stub):
    server = fake(latency=0.002)
    # Only Chutes is allowed (the fake's others filtered out by max_tokens), and it is flagged.
    for e in server.config.endpoints:
        if e["tag"] not in ("chutes", "fireworks", "baseten"):
            e["max_completion_tokens"] = 16
    stub(every=2)
    code, stdout, stderr, _ = run_cli(
        cli, server, tmp_path, h, "--audit-every", 2, "--audit-target", "tiny"
    )
    assert code == 75, stderr
    assert "stopped: the audit has excluded every allowed provider" in stderr


def test_real_online_audit_logs_its_checks(tmp_path, fake, cli, h, monkeypatch):
    """make_audit wires OnlineAudit to DIR/audit.jsonl (target load and scoring stubbed)."""
    import datagen.online_audit
    import eagle3.targets

    loaded = []

    def load_target(name, device_map=None):
        loaded.append(name)
        return SimpleNamespace(name=name, tokenizer=object())

    monkeypatch.setattr(eagle3.targets, "load_target", load_target)
    monkeypatch.setattr(datagen.online_audit, "score_records", lambda *a, **k: [])
    server = fake(latency=0.002)
    code, _, stderr, out = run_cli(
        cli, server, tmp_path, h, "--audit-every", 10, "--audit-target", "tiny"
    )
    assert code == 0, stderr
    assert loaded == ["tiny"]
    checks = [e for e in h.read_jsonl(out / "audit.jsonl") if "check" in e]
    # 30 records, a check due every 10; one that comes due while another runs waits for the
    # next record, so the last may not happen.
    assert [e["check"] for e in checks] in ([1, 2], [1, 2, 3])
    assert all(e["excluded"] == {} for e in checks)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--audit-every", 5], "--audit-every needs a local copy of the target"),
        (["--audit-every", -1], "--audit-every must be >= 0"),
    ],
)
def test_bad_audit_flags_exit_2_with_one_line(tmp_path, fake, cli, h, args, message):
    server = fake()
    code, stdout, stderr, _ = run_cli(cli, server, tmp_path, h, *args)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert server.stats.chat == 0
