"""The OpenRouter run's progress (eagle3.progress): prompts out of all of them, earlier runs'
as already done, the run's figures after the count, and the closing line naming the files."""

from __future__ import annotations

import io
from collections import Counter
from types import SimpleNamespace

from datagen.openrouter.progress import Progress
from datagen.openrouter.requester import Outcome


def test_a_run_opens_with_its_total_and_closes_with_where_the_records_are(tmp_path, fake, cli, h):
    server = fake(latency=0.005)
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "chat.jsonl", 12, multi_every=3)
    out = tmp_path / "out"
    code, stdout, stderr = cli(*h.argv(5, cfg, tmp_path / "chat.jsonl", out, server))
    assert code == 0, stderr
    lines = [x for x in stderr.splitlines() if x.startswith("openrouter: ")]
    assert lines[0].startswith("openrouter: 0/12 prompts (0%), eta -; in flight 0/64, ")
    assert lines[-1].startswith("openrouter: 12/12 prompts (100%) in ")
    assert "/M out paid" in lines[-1] and ", failed 0, errors: none" in lines[-1]
    closing, summary = stdout.splitlines()[-2:]
    assert closing == (
        f"openrouter: 12 prompts written in this run, 0 failed -> {out} "
        "(chat.jsonl; ledger ledger.jsonl)"
    )
    assert summary.startswith("summary: 12/12 prompts done")


def test_a_resumed_run_counts_earlier_prompts_as_already_done(tmp_path, capsys, monkeypatch):
    """~0.1 s: 40 prompts left after 60 done by earlier runs; the figures shown are the ones
    passed in (counts, throttle, ledger, store, settings)."""
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    settings = SimpleNamespace(progress_bar=False, log_every=30.0, done_before=60,
                               budget=5.0, plan_usd_per_m_out=2.46)  # fmt: skip
    progress = Progress(
        Outcome(done=9, failed=1, errors=Counter({"http 429": 3})),
        SimpleNamespace(active=7, limit=64),
        SimpleNamespace(spent_usd=1.25, path=tmp_path / "ledger.jsonl"),
        SimpleNamespace(dir=tmp_path, datasets=lambda: ["chat", "code"]),
        settings,
        total=40,
        started=0.0,
    )
    assert stream.getvalue().startswith("openrouter: 60/100 prompts (60%, 60 already done), eta -")
    progress.close()
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("openrouter: 70/100 prompts (70%, 60 already done), ")
    assert ", eta " in last and "; in flight 7/64, " in last and "$1.25/$5.00" in last
    assert "(plan $2.46/M)" in last and "errors: http 429 3" in last
    assert capsys.readouterr().out == (
        f"openrouter: 9 prompts written in this run, 1 failed -> {tmp_path} "
        "(chat.jsonl, code.jsonl; ledger ledger.jsonl; failed.jsonl)\n"
    )
