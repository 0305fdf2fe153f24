"""Fixtures for the OpenRouter app's tests: the fake server on 127.0.0.1, prompt files, and
running the real CLI (in-process or as a subprocess that can be killed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from datagen.openrouter import fake_server

ROOT = Path(__file__).resolve().parents[3]

# Fast settings for tests: tiny backoff, small answers.
TEST_CONFIG = """\
model: moonshotai/kimi-k2.5
native_precision: int4
ignore: [fireworks, baseten]
max_tokens: 256
temperature: 0.7
concurrency: {concurrency}
max_attempts: {max_attempts}
retry_initial_s: 0.002
retry_max_s: 0.02
grace_s: {grace}
log_every_s: 0.5
expected_output_tokens: 2000
tokens_per_dataset: {tokens_per_dataset}
"""


@pytest.fixture
def fake():
    """``fake(**FakeConfig fields) -> FakeServerThread`` (started; stopped after the test)."""
    servers = []

    def start(**kwargs) -> fake_server.FakeServerThread:
        kwargs.setdefault("retry_after", 0.01)
        server = fake_server.FakeServerThread(fake_server.FakeConfig(**kwargs))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def write_config(path: Path, **overrides) -> Path:
    values = {
        "concurrency": 64,
        "max_attempts": 30,
        "grace": 5,
        "tokens_per_dataset": 10_000_000,
    }
    values.update(overrides)
    path.write_text(TEST_CONFIG.format(**values))
    return path


def write_prompts(path: Path, n: int, *, multi_every: int = 0, prefix: str = "q") -> list[str]:
    """n prompts; every ``multi_every``-th is a 2-user-turn ShareGPT conversation. Returns ids."""
    ids = []
    with open(path, "w") as f:
        for i in range(n):
            pid = f"{prefix}{i}"
            if multi_every and i % multi_every == 0:
                rec = {
                    "id": pid,
                    "conversations": [
                        {"from": "human", "value": f"Tell me about topic {prefix}{i}."},
                        {"from": "gpt", "value": "(source answer, regenerated)"},
                        {"from": "human", "value": f"And more about {prefix}{i}?"},
                    ],
                }
            else:
                rec = {"id": pid, "prompt": f"Question {prefix}{i}: what is {i} squared?"}
            f.write(json.dumps(rec) + "\n")
            ids.append(pid)
    return ids


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ledger_totals(out: Path) -> dict:
    """charged (settled) USD, orphan USD, tokens by dataset from DIR/ledger.jsonl."""
    events = read_jsonl(out / "ledger.jsonl")
    open_res = {}
    charged, tokens = 0.0, {}
    for e in events:
        if e["t"] == "reserve":
            open_res[e["rid"]] = e
        elif e["t"] == "charge":
            open_res.pop(e["rid"], None)
            charged += e["usd"]
            tokens[e["dataset"]] = tokens.get(e["dataset"], 0) + e["tokens"]
        elif e["t"] == "release":
            open_res.pop(e["rid"], None)
    orphan = sum(e["usd"] for e in open_res.values())
    return {"charged": charged, "orphan": orphan, "tokens": tokens, "events": events}


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``python -m datagen.openrouter`` in-process: ``cli(*args) -> (code, stdout, stderr)``."""
    from datagen.openrouter import cli as openrouter

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-test")
    monkeypatch.delenv("OPENROUTER_BASE_URL", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        code = openrouter.main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def spawn_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """The CLI as a real subprocess (for kill -9 and signals)."""
    full_env = {**os.environ, "OPENROUTER_API_KEY": "sk-or-test", **(env or {})}
    full_env.pop("OPENROUTER_BASE_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "datagen.openrouter", *map(str, args)],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def argv(budget, config, prompts, out, server, *extra) -> list:
    """The usual command line against a fake server (``cli(*h.argv(...))``)."""
    return ["--budget", budget, "--config", config, "--prompts", prompts, "--out", out,
            "--base-url", server.server.url, *extra]  # fmt: skip


@pytest.fixture
def h():
    """The helpers above, for test modules (conftest is not importable by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        argv=argv,
        write_config=write_config,
        write_prompts=write_prompts,
        read_jsonl=read_jsonl,
        ledger_totals=ledger_totals,
        spawn_cli=spawn_cli,
        fake_module=fake_server,
    )
