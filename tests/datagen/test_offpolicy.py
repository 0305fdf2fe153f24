"""`python -m datagen.offpolicy`: a dataset's own conversations as training records."""

from __future__ import annotations

import json

import pytest

from datagen import local, offpolicy
from eagle3.data.prompts import PromptError, load_prompts, source_conversation
from eagle3.data.records import ResultStore

CONVERSATIONS = [
    {"id": "c0", "conversations": [
        {"from": "human", "value": "write a haiku about rain"},
        {"from": "gpt", "value": "soft rain on the roof"},
        {"from": "human", "value": "another one"},
        {"from": "gpt", "value": "grey clouds drift away"},
        {"from": "human", "value": "and a third"},
        {"from": "gpt", "value": "puddles hold the sky"}]},
    {"id": "c1", "conversations": [  # a split conversation: it starts with the model's tail
        {"from": "gpt", "value": "...and that is the end of the story."},
        {"from": "human", "value": "summarise it"},
        {"from": "gpt", "value": "a story ended"},
        {"from": "human", "value": "unanswered"}]},
    {"id": "c2", "conversations": [{"from": "human", "value": "no answer at all"}]},
    {"id": "c3", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]},
]  # fmt: skip


def test_source_conversation_keeps_answered_turns_in_order():
    c0 = source_conversation(CONVERSATIONS[0], max_turns=2)
    assert [m["role"] for m in c0] == ["user", "assistant", "user", "assistant"]
    assert c0[-1]["content"] == "grey clouds drift away"
    assert len(source_conversation(CONVERSATIONS[0])) == 6
    c1 = source_conversation(CONVERSATIONS[1])  # leading model turn and unanswered tail dropped
    assert [m["content"] for m in c1] == ["summarise it", "a story ended"]
    c3 = source_conversation(CONVERSATIONS[3])
    assert c3[0] == {"role": "system", "content": "be brief"} and c3[-1]["content"] == "hello"
    with pytest.raises(PromptError, match="no answered user turn"):
        source_conversation(CONVERSATIONS[2])
    with pytest.raises(PromptError, match="no assistant turns"):
        source_conversation({"prompt": "only a prompt"})


def test_cli_writes_records_resumes_and_splits_like_datagen_local(tmp_path, capsys):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "off"
    assert offpolicy.main(["--prompts", str(src), "--out", str(out), "--max-turns", "2"]) == 0
    records = {r["id"]: r for r in ResultStore(out, readonly=True).iter_records()}
    assert sorted(records) == ["c0", "c1", "c3"]  # c2 has no answer
    assert records["c0"]["messages"][1] == {
        "role": "assistant",
        "content": "soft rain on the roof",
        "reasoning": "",
    }
    assert records["c0"]["provider"] == "offpolicy" and records["c0"]["usage"]["cost"] is None
    captured = capsys.readouterr()
    assert "offpolicy: 0/3 conversations (0%), eta -; 0 assistant turns written\n" in captured.err
    assert "offpolicy: 3/3 conversations (100%) in " in captured.err
    assert captured.out.splitlines()[-1] == (
        f"offpolicy: 3 conversations selected, 3 written (4 assistant turns), 0 already there "
        f"-> {out} (convs.jsonl)"
    )
    assert offpolicy.main(["--prompts", str(src), "--out", str(out)]) == 0  # nothing new
    captured = capsys.readouterr()
    assert "0 written" in captured.out
    assert "offpolicy: 3/3 conversations (100%, 3 already done) in " in captured.err
    assert len(list(ResultStore(out, readonly=True).iter_records())) == 3

    # --split train keeps exactly the ids datagen.local keeps for the same source
    args = ["--prompts", str(src), "--split", "train", "--eval-fraction", "0.5"]
    ours = {p.id for p, _ in offpolicy.select(offpolicy.parse_args([*args, "--out", "x"]))}
    theirs = local.parse_args([*args, "--out", "y", "--target", "t"])
    kept = {p.id for p in local.select_prompts(theirs)}
    assert ours == kept & {"c0", "c1", "c3"}


def test_answers_that_copy_a_benchmark_are_excluded(tmp_path, capsys):
    question = load_prompts("mt_bench", limit=1)[0].messages[0]["content"]
    leak = {"id": "leak", "conversations": [
        {"from": "human", "value": "tell me something"},
        {"from": "gpt", "value": f"Sure. {question}"}]}  # fmt: skip
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in [*CONVERSATIONS, leak]))
    out = tmp_path / "off"
    argv = ["--prompts", str(src), "--out", str(out), "--exclude-benchmarks", "mt_bench"]
    assert offpolicy.main(argv) == 0
    ids = {r["id"] for r in ResultStore(out, readonly=True).iter_records()}
    assert ids == {"c0", "c1", "c3"}
    assert "dropped 1 of 4" in capsys.readouterr().out
