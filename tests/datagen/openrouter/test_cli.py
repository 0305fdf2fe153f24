"""``python -m datagen.openrouter`` end to end against the fake OpenRouter on a real socket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datagen.openrouter.fake_server import FAULTS

ALLOWED = {
    "chutes",
    "deepinfra",
    "siliconflow",
    "atlas-cloud",
    "together",
    "novita",
    "parasail",
    "moonshotai",
    "venice",
}


def ids_in(out: Path, h, dataset: str) -> list[str]:
    return [r["id"] for r in h.read_jsonl(out / f"{dataset}.jsonl")]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_generates_every_prompt_once_multi_turn_and_reasoning(tmp_path, fake, cli, h):
    server = fake(latency=0.005)
    cfg = h.write_config(tmp_path / "c.yaml")
    ids = h.write_prompts(tmp_path / "chat.jsonl", 30, multi_every=3)
    out = tmp_path / "out"
    code, stdout, stderr = cli(*h.argv(5, cfg, tmp_path / "chat.jsonl", out, server))
    assert code == 0, stderr
    assert last_line(stdout).startswith("summary: 30/30 prompts done, 0 remaining, 0 failed;")
    records = h.read_jsonl(out / "chat.jsonl")
    assert sorted(r["id"] for r in records) == sorted(ids)
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        n_user = 2 if int(r["id"][1:]) % 3 == 0 else 1
        assert roles == ["user", "assistant"] * n_user  # answered turn by turn
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert m["content"].startswith("Answer") and m["reasoning"].startswith("Thinking")
        assert r["provider"] in {"Chutes"} and r["model"].startswith("moonshotai/kimi-k2.5")
        assert r["usage"]["cost"] > 0 and r["usage"]["reasoning_tokens"] > 0
    # the second turn was asked with the model's own first answer in the context
    multi = next(r for r in records if r["id"] == "q0")
    assert "Answer" in multi["messages"][1]["content"]
    totals = h.ledger_totals(out)
    assert totals["charged"] == pytest.approx(server.stats.charged_usd)
    assert totals["orphan"] == 0
    assert server.stats.violations == 0
    # a re-run has nothing to do and charges nothing
    before = server.stats.chat
    code, stdout, _ = cli(*h.argv(5, cfg, tmp_path / "chat.jsonl", out, server))
    assert code == 0 and server.stats.chat == before
    assert "30/30 prompts done" in last_line(stdout)


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


MALFORMED = ["524_in_200", "no_choices", "finish_error", "empty", "truncated", "drop", "429", "502"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_every_failure_shape_is_retried(tmp_path, fake, cli, h, kind):
    server = fake(faults={kind: 0.5}, seed=7)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=8)
    ids = h.write_prompts(tmp_path / "p.jsonl", 12)
    out = tmp_path / "out"
    code, stdout, stderr = cli(*h.argv(5, cfg, tmp_path / "p.jsonl", out, server))
    assert code == 0, stderr
    assert server.stats.faults[kind] > 0
    records = h.read_jsonl(out / "p.jsonl")
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert all(r["messages"][-1]["content"].strip() for r in records)
    # billed failures (empty, finish_reason error) are in the ledger: it matches the server
    assert h.ledger_totals(out)["charged"] == pytest.approx(server.stats.charged_usd)
    if kind in ("empty", "finish_error"):
        failed_charges = [
            e for e in h.ledger_totals(out)["events"] if e["t"] == "charge" and not e["ok"]
        ]
        assert len(failed_charges) == server.stats.faults[kind]


def test_non_retryable_error_marks_prompt_failed_and_run_goes_on(tmp_path, fake, cli, h):
    server = fake()
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 5)
    # a prompt the fake rejects with 400: the wrong model for one dataset is not possible, so
    # poison the fake's check for one request body instead
    original = server.server._chat

    async def reject_q3(request):
        body = await request.json()
        if "q3:" in body["messages"][0]["content"]:
            from aiohttp import web

            return web.json_response({"error": {"code": 403, "message": "flagged"}}, status=403)
        return await original(request)

    server.server._chat = reject_q3
    out = tmp_path / "out"
    code, stdout, _ = cli(*h.argv(5, cfg, tmp_path / "p.jsonl", out, server))
    assert code == 0
    assert "4/5 prompts done, 0 remaining, 1 failed" in last_line(stdout)
    (failed,) = h.read_jsonl(out / "failed.jsonl")
    assert failed["id"] == "q3" and failed["reason"] == "http 403" and failed["attempts"] == 1


def test_excluded_providers_never_used(tmp_path, fake, cli, h):
    server = fake(faults={"429": 0.1, "502": 0.1}, seed=3)
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 40)
    code, _, _ = cli(*h.argv(5, cfg, tmp_path / "p.jsonl", tmp_path / "out", server))
    assert code == 0
    assert server.stats.violations == 0
    assert set(server.stats.providers) <= ALLOWED
    assert server.stats.statuses[400] == 0


def test_fake_rejects_a_request_that_could_reach_an_excluded_provider(fake):
    import urllib.request

    server = fake()
    body = json.dumps(
        {
            "model": "moonshotai/kimi-k2.5",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
            "provider": {"ignore": ["fireworks"]},
        }
    ).encode()  # BaseTen fp4 reachable
    req = urllib.request.Request(
        server.server.url + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert server.stats.violations == 1


def test_length_kept_but_flagged(tmp_path, fake, cli, h):
    server = fake(completion_tokens=(200, 400))  # max_tokens 256 in the test config
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 20)
    code, _, stderr = cli(*h.argv(5, cfg, tmp_path / "p.jsonl", tmp_path / "out", server))
    assert code == 0
    records = h.read_jsonl(tmp_path / "out" / "p.jsonl")
    cut = [r for r in records if r["finish_reason"] == "length"]
    assert cut and all(r["truncated"] is True for r in cut)
    assert all("truncated" not in r for r in records if r["finish_reason"] == "stop")
    assert f"{len(cut)} answer(s) hit max_tokens" in stderr


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_budget_never_exceeded_under_faults_and_concurrency(tmp_path, fake, cli, h, seed):
    faults = {k: 0.04 for k in FAULTS if k != "no_cost"}  # every fault but the unbilled answer
    server = fake(faults=faults, seed=seed, latency=0.002)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=500)  # more than the prompts
    ids = h.write_prompts(tmp_path / "p.jsonl", 150, multi_every=4)
    out = tmp_path / "out"
    args = [
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    ]
    budget = 0.012  # about a third of what the prompts cost
    code, stdout, stderr = cli("--budget", budget, *args)
    assert code == 75, stderr
    assert "stopped: budget reached" in stderr
    totals = h.ledger_totals(out)
    assert totals["charged"] + totals["orphan"] <= budget + 1e-9
    assert server.stats.charged_usd == pytest.approx(totals["charged"])  # every charge recorded
    first = ids_in(out, h, "p")
    assert 0 < len(first) < len(ids) and len(set(first)) == len(first)
    assert f"${totals['charged']:.2f} spent of ${budget:.2f} budget" in last_line(stdout)

    # a second run with the same budget cannot spend more than what is left
    code, stdout, _ = cli("--budget", budget, *args)
    assert code == 75
    assert h.ledger_totals(out)["charged"] <= budget + 1e-9

    # more budget: everything completes, each prompt exactly once, nothing charged twice
    code, stdout, stderr = cli("--budget", 1.0, *args)
    assert code == 0, stderr
    final = ids_in(out, h, "p")
    assert sorted(final) == sorted(ids)
    assert h.ledger_totals(out)["charged"] == pytest.approx(server.stats.charged_usd)
    assert server.stats.violations == 0


def test_dataset_token_budget_caps_each_dataset(tmp_path, fake, cli, h):
    server = fake(completion_tokens=(50, 100))
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=200)
    h.write_prompts(tmp_path / "alpha.jsonl", 60, prefix="a")
    h.write_prompts(tmp_path / "beta.jsonl", 60, prefix="b")
    out = tmp_path / "out"
    cap = 2000  # max_tokens 256: each request reserves 256 of it
    code, stdout, stderr = cli(
        "--budget",
        5,
        "--config",
        cfg,
        "--tokens-per-dataset",
        cap,
        "--prompts",
        tmp_path / "alpha.jsonl",
        tmp_path / "beta.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    )
    assert code == 75, stderr
    assert "output-token budget reached for alpha, beta" in stderr
    tokens = h.ledger_totals(out)["tokens"]
    for ds in ("alpha", "beta"):
        assert 0 < tokens[ds] <= cap
        done = h.read_jsonl(out / f"{ds}.jsonl")
        assert sum(r["usage"]["completion_tokens"] for r in done) <= cap
        assert 0 < len(done) < 60


def test_402_stops_then_resume_with_more_credit_completes(tmp_path, fake, cli, h):
    server = fake(credits=0.01, latency=0.002)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=50)
    ids = h.write_prompts(tmp_path / "p.jsonl", 100)
    out = tmp_path / "out"
    args = [
        "--budget",
        10,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        out,
        "--base-url",
        server.server.url,
    ]
    code, stdout, stderr = cli(*args)
    assert code == 75, stderr
    assert "OpenRouter credits ran out (402" in stderr
    assert "more credit is needed" in stderr and "add credits and re-run" in stderr
    first = ids_in(out, h, "p")
    assert 0 < len(first) < 100
    assert server.stats.charged_usd <= 0.01 + 1e-9
    assert h.ledger_totals(out)["charged"] == pytest.approx(server.stats.charged_usd)

    server.config.credits = 10.0
    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    assert sorted(ids_in(out, h, "p")) == sorted(ids)


def test_429_storm_slows_the_client_and_completes(tmp_path, fake, cli, h):
    server = fake(max_inflight=6, retry_after=0.02, latency=0.01)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=120, max_attempts=200)
    ids = h.write_prompts(tmp_path / "p.jsonl", 120)
    out = tmp_path / "out"
    code, stdout, stderr = cli(*h.argv(5, cfg, tmp_path / "p.jsonl", out, server))
    assert code == 0, stderr
    assert sorted(ids_in(out, h, "p")) == sorted(ids)
    assert "429: concurrency limit now" in stderr
    limits = [
        int(line.rsplit(" ", 1)[1])
        for line in stderr.splitlines()
        if "concurrency limit now" in line
    ]
    assert min(limits) < 12  # the whole client backed off toward what the server takes


# ---------------------------------------------------------------------------- bad input


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    line = last_line(stderr)
    assert line.startswith("error: ")
    return line


def test_bad_config_lists_every_problem(tmp_path, cli):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "max_tokens: -5\nconcurency: 10\nnative_precision: int5\ndatasets:\n  - {name: a}\n"
    )
    code, _, stderr = cli("--budget", 1, "--config", cfg)
    assert code == 2
    line = error_line(stderr)
    for part in (
        "unknown key concurency",
        "max_tokens must be a positive integer",
        "native_precision 'int5'",
        "datasets[0]: source is required",
    ):
        assert part in line


def test_config_not_yaml(tmp_path, cli):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: [unclosed\n")
    code, _, stderr = cli("--budget", 1, "--config", cfg)
    assert code == 2 and "not valid YAML" in error_line(stderr)


def test_missing_key(tmp_path, cli, h, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY")
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 2)
    code, _, stderr = cli(
        "--budget",
        1,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--base-url",
        "http://127.0.0.1:9/api/v1",
    )
    assert code == 2 and "OPENROUTER_API_KEY is not set" in error_line(stderr)


def test_rejected_key(tmp_path, cli, h, fake):
    server = fake(api_key="the-right-key")
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 2)
    code, _, stderr = cli(*h.argv(1, cfg, tmp_path / "p.jsonl", tmp_path / "out", server))
    assert code == 2 and "rejected the API key (401)" in error_line(stderr)
    assert server.stats.chat == 0


@pytest.mark.parametrize("make", ["missing", "directory", "binary", "empty"])
def test_unreadable_prompt_file(tmp_path, cli, h, make):
    cfg = h.write_config(tmp_path / "c.yaml")
    path = tmp_path / "p.jsonl"
    if make == "directory":
        path.mkdir()
    elif make == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage\n")
    elif make == "empty":
        path.write_text("")
    code, _, stderr = cli(
        "--budget", 1, "--config", cfg, "--prompts", path, "--base-url", "http://127.0.0.1:9/api/v1"
    )
    assert code == 2
    assert str(path.name) in error_line(stderr)


def test_unknown_model(tmp_path, cli, h, fake):
    server = fake()
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 2)
    code, _, stderr = cli(
        "--budget",
        1,
        "--config",
        cfg,
        "--prompts",
        tmp_path / "p.jsonl",
        "--model",
        "nobody/nothing",
        "--base-url",
        server.server.url,
    )
    assert code == 2 and "not found" in error_line(stderr)
