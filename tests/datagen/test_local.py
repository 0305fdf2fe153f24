"""`python -m datagen.local`: OpenAI-compatible servers over real sockets (a fake on 127.0.0.1)
and in-process generation on a tiny random model; same records and resume as eagle3.data.records."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from datagen import local
from datagen.generate import split_reasoning
from eagle3.data.chat import next_turns
from eagle3.data.prompts import Prompt
from eagle3.data.records import ResultStore


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _load(Path(__file__).resolve().parents[1] / "tiny_chat.py")
FakeOpenAIServer = _load(Path(__file__).with_name("fake_openai_server.py")).FakeOpenAIServer

PROMPTS = [
    {"id": "p0", "messages": [{"role": "user", "content": "what is 2 + 3 ?"}]},
    {"id": "p1", "messages": [{"role": "system", "content": "tell me"},
                              {"role": "user", "content": "hello"},
                              {"role": "user", "content": "why ?"}]},  # two turns
    {"id": "p2", "messages": [{"role": "user", "content": "fail-once please"}]},
    {"id": "p3", "messages": [{"role": "user", "content": "a long one"}]},
    {"id": "p4", "messages": [{"role": "user", "content": "bad-request"}]},
]  # fmt: skip


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def servers():
    with FakeOpenAIServer(name="a") as one, FakeOpenAIServer(name="b") as two:
        yield one, two


def records(out: Path) -> dict[str, dict]:
    store = ResultStore(out, readonly=True)
    return {r["id"]: r for r in store.iter_records()}


def test_next_turns_walks_user_turns_in_order():
    p = Prompt("x", "d", [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                          {"role": "user", "content": "u2"}])  # fmt: skip
    conv = next_turns(p, [])
    assert conv == p.messages[:2]
    conv = conv + [{"role": "assistant", "content": "a1"}]
    assert next_turns(p, conv) == [{"role": "user", "content": "u2"}]
    conv += [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    assert next_turns(p, conv) is None


def test_max_turns_keeps_the_first_user_turns():
    p = Prompt("x", "d", [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                          {"role": "user", "content": "u2"}, {"role": "user", "content": "u3"}])  # fmt: skip
    assert local.first_user_turns(p, 1).messages == p.messages[:2]
    assert local.first_user_turns(p, 2).messages == p.messages[:3]
    assert local.first_user_turns(p, 5).messages == p.messages
    assert local.first_user_turns(p, 1).id == "x"


def test_each_prompt_source_is_one_line(prompts_file, tmp_path, caplog):
    """~0.1 s: selecting the prompts logs each source's line (kept, skipped) once, the loader's
    (generate printed it twice)."""
    args = local.parse_args(["--prompts", str(prompts_file), "--out", str(tmp_path / "out"),
                             "--base-url", "http://127.0.0.1:9"])  # fmt: skip
    with caplog.at_level("INFO"):
        local.select_prompts(args)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat: ")]
    assert len(lines) == 1 and "kept 5 prompts" in lines[0], lines


def test_servers_round_robin_retries_reasoning_resume(
    servers, prompts_file, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("eagle3.progress.EVERY_S", 0.0)  # a progress line at every turn
    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    one, two = servers
    out = tmp_path / "out"
    argv = ["--prompts", str(prompts_file), "--out", str(out), "--base-url", one.url, two.url + "/v1",
            "--concurrency", "2", "--max-new-tokens", "64", "--temperature", "0.5"]  # fmt: skip
    assert local.main(argv) == 0
    # progress in turns (p1 has two), the failed p4 leaves the total; the last line says where
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("local: ")]
    assert lines[0].startswith("local: 0/6 turns (0%), eta -; 0 prompts done, 0 failed")
    assert any(re.match(r"local: [1-4]/[56] turns \(\d+%\), .+, eta \d+s; ", x) for x in lines)
    assert lines[-1].startswith("local: 5/5 turns (100%) in ")
    assert "; 4 prompts done, 1 failed, " in lines[-1]
    tokens = sum(r["usage"]["completion_tokens"] for r in records(out).values())
    assert captured.out == (
        f"local: 4 of 5 prompts are records (4 written in this run, {tokens} tokens) -> {out} "
        "(chat.jsonl; failed.jsonl: 1 http 400)\n"
    )
    got = records(out)
    assert sorted(got) == ["p0", "p1", "p2", "p3"]
    r0 = got["p0"]
    assert r0["messages"][-1] == {
        "role": "assistant",
        "content": "answer to what is 2 + 3 ?",
        "reasoning": "thinking about what is 2 + 3 ?",  # from reasoning_content
    }
    assert r0["model"] == "fake/target" and r0["finish_reason"] == "stop"  # model from /v1/models
    assert r0["provider"].startswith("local http://127.0.0.1:")
    # multi-turn: the second request carries the target's own first answer
    roles = [m["role"] for m in got["p1"]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    second = [b for s in servers for b in s.requests if b["messages"][-1]["content"] == "why ?"]
    assert second[0]["messages"][2] == {"role": "assistant", "content": "answer to hello"}
    assert got["p1"]["usage"]["completion_tokens"] == 3 + 4  # summed over both turns
    assert got["p3"]["finish_reason"] == "length" and got["p3"]["truncated"]
    assert got["p2"]["messages"][-1]["content"] == "answer to fail-once please"  # after a 503
    failed = [json.loads(x) for x in (out / "failed.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failed] == ["p4"] and failed[0]["reason"] == "http 400"
    assert one.requests and two.requests  # both servers did work
    body = one.requests[0]
    assert (
        body["max_tokens"] == 64 and body["temperature"] == 0.5 and body["model"] == "fake/target"
    )

    sent = len(one.requests) + len(two.requests)
    assert local.main(argv) == 0  # resume: done and failed-for-good prompts are skipped
    assert len(one.requests) + len(two.requests) == sent
    capsys.readouterr()
    assert local.main([*argv, "--retry-failed"]) == 0  # only the failed prompt is tried again
    assert len(one.requests) + len(two.requests) == sent + 1
    err = capsys.readouterr().err  # the turns of the 4 records are already done
    assert "local: 5/6 turns (83%, 5 already done), eta -; 0 prompts done" in err
    assert "local: 5/5 turns (100%, 5 already done) in " in err
    assert sorted(records(out)) == ["p0", "p1", "p2", "p3"]


def test_a_dead_server_only_slows_the_run(servers, prompts_file, tmp_path):
    one, _ = servers
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    out = tmp_path / "out"
    argv = ["--prompts", str(prompts_file), "--out", str(out), "--base-url", dead, one.url,
            "--model", "fake/target", "--concurrency", "1"]  # fmt: skip
    assert local.main(argv) == 0
    assert sorted(records(out)) == ["p0", "p1", "p2", "p3"]


def test_unreachable_server_without_model_is_one_line(prompts_file, tmp_path, capsys):
    argv = [
        "--prompts",
        str(prompts_file),
        "--out",
        str(tmp_path / "o"),
        "--base-url",
        "http://127.0.0.1:9",
    ]
    assert local.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot list the models") and err.count("\n") == 1


@pytest.fixture(scope="module")
def chat_llama(tiny_llama_dir, tmp_path_factory):
    return tc.chat_model_dir(
        tiny_llama_dir, tmp_path_factory.mktemp("chat_llama"), tc.chatml_tokenizer()
    )


def test_in_process_generation(chat_llama, prompts_file, tmp_path, capsys, monkeypatch):
    def argv(out, batch_size):
        return ["--prompts", str(prompts_file), "--out", str(out), "--target", str(chat_llama),
                "--max-new-tokens", "6", "--batch-size", str(batch_size), "--temperature", "0"]  # fmt: skip

    monkeypatch.setattr("eagle3.progress.EVERY_S", 0.0)  # a progress line at every turn
    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    out = tmp_path / "out"
    assert local.main(argv(out, 2)) == 0
    got = records(out)
    assert sorted(got) == ["p0", "p1", "p2", "p3", "p4"]
    # each turn counts as its row finishes, before the chunk's records are written
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("local: ")]
    assert lines[0].startswith("local: 0/6 turns (0%), eta -; 0 prompts done")
    assert re.match(r"local: 1/6 turns \(16%\), .+, eta \d+s; 0 prompts done", lines[1])
    assert lines[-1].startswith("local: 6/6 turns (100%) in ") and "; 5 prompts done" in lines[-1]
    tokens = sum(r["usage"]["completion_tokens"] for r in got.values())
    assert captured.out == (
        f"local: 5 of 5 prompts are records (5 written in this run, {tokens} tokens) -> {out} "
        "(chat.jsonl)\n"
    )
    two = got["p1"]["messages"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant"]
    for r in got.values():
        assert r["model"] == chat_llama.name and r["provider"] == "transformers"
        assert r["finish_reason"] in ("stop", "length")
        assert (
            0
            < r["usage"]["completion_tokens"]
            <= 6 * sum(m["role"] == "user" for m in r["messages"])
        )
    # greedy: the same answers whatever the batching (left padding is exact)
    assert local.main(argv(tmp_path / "again", 5)) == 0
    again = records(tmp_path / "again")
    assert {k: r["messages"] for k, r in again.items()} == {
        k: r["messages"] for k, r in got.items()
    }
    # resume: nothing left to do
    before = (out / "chat.jsonl").read_text()
    assert local.main(argv(out, 2)) == 0
    assert (out / "chat.jsonl").read_text() == before
    # --max-prompt-tokens: over-long prompts are skipped into failed.jsonl, the rest generate
    lengths = {k: len(tc_prompt_ids(chat_llama, r["messages"])) for k, r in got.items()}
    cut = sorted(lengths.values())[2]
    short = tmp_path / "short"
    capsys.readouterr()
    assert local.main([*argv(short, 2), "--max-prompt-tokens", str(cut)]) == 0
    kept = set(records(short))
    failed = [json.loads(line) for line in (short / "failed.jsonl").open()]
    # the closing line says why they are not records: skipped as too long, not failed
    assert capsys.readouterr().out.endswith(f"; failed.jsonl: {len(failed)} prompt too long)\n")
    assert kept and failed and kept.isdisjoint(f["id"] for f in failed)
    assert all(f["reason"] == "prompt too long" for f in failed)
    assert kept | {f["id"] for f in failed} == set(got)
    # resume skips what failed for good (no duplicate failed lines); --retry-failed retries
    assert local.main([*argv(short, 2), "--max-prompt-tokens", str(cut)]) == 0
    assert len((short / "failed.jsonl").read_text().splitlines()) == len(failed)
    assert local.main([*argv(short, 2), "--retry-failed"]) == 0
    assert set(records(short)) == set(got)


def tc_prompt_ids(target_dir, messages):
    """Rendered length of a record's first prompt (system + first user turn)."""
    from transformers import AutoTokenizer

    from eagle3.data.chat import prompt_ids

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    first = messages[: [m["role"] for m in messages].index("assistant")]
    return prompt_ids(tok, first)


def test_split_reasoning_at_the_think_tag():
    tok = tc.kimi_tokenizer()
    ids = tok.encode("add two</think>it is 5", add_special_tokens=False)
    assert split_reasoning(tok, ids) == ("add two", "it is 5")
    assert split_reasoning(tok, tok.encode("it is 5", add_special_tokens=False)) == ("", "it is 5")
    chatml = tc.chatml_tokenizer()  # no special think tag: split on the text
    assert split_reasoning(chatml, chatml.encode("it is 5", add_special_tokens=False)) == (
        "",
        "it is 5",
    )


def test_exclude_benchmarks_drops_a_copied_question_before_generating(servers, tmp_path, capsys):
    from eagle3.data.prompts import load_prompts

    question = load_prompts("mt_bench", limit=1)[0].messages[0]["content"]
    path = tmp_path / "chat.jsonl"
    rows = [PROMPTS[0], {"id": "copy", "messages": [{"role": "user", "content": question}]}]
    path.write_text("".join(json.dumps(p) + "\n" for p in rows))
    one, _ = servers
    out = tmp_path / "out"
    argv = ["--prompts", str(path), "--out", str(out), "--base-url", one.url,
            "--exclude-benchmarks", "mt_bench"]  # fmt: skip
    assert local.main(argv) == 0
    assert (
        "--exclude-benchmarks: dropped 1 of 2 prompts sharing a 13-word run with a benchmark "
        "question or answer (mt_bench 1)\n" in capsys.readouterr().out
    )
    assert sorted(records(out)) == ["p0"]
    assert not (out / "failed.jsonl").exists() or "copy" not in (out / "failed.jsonl").read_text()
    asked = [m["content"] for body in one.requests for m in body["messages"]]
    assert asked == [PROMPTS[0]["messages"][0]["content"]]  # the copy was never sent
