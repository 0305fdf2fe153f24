import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.data.prompts import Prompt
from eagle3.data.records import (
    ResultStore,
    StoreError,
    make_failure,
    make_record,
    normalize_usage,
    repair_tail,
    try_lock,
)

REPO = Path(__file__).resolve().parents[3]


def prompt(i: int, dataset: str = "chat") -> Prompt:
    return Prompt(f"p{i}", dataset, [{"role": "user", "content": f"question {i}"}])


def record(i: int, dataset: str = "chat", finish_reason: str = "stop") -> dict:
    p = prompt(i, dataset)
    messages = [*p.messages, {"role": "assistant", "content": f"answer {i} é", "reasoning": "hmm"}]
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "cost": 0.001}
    return make_record(p, messages, "m", "prov", finish_reason, usage)


def lines(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n")
    return [json.loads(ln) for ln in raw.split(b"\n") if ln]


# ------------------------------------------------------------------ records


def test_make_record_format():
    rec = record(1)
    assert rec == {
        "id": "p1",
        "dataset": "chat",
        "messages": [
            {"role": "user", "content": "question 1"},
            {"role": "assistant", "content": "answer 1 é", "reasoning": "hmm"},
        ],
        "model": "m",
        "provider": "prov",
        "finish_reason": "stop",
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
            "cost": 0.001,
        },
    }
    assert record(2, finish_reason="length")["truncated"] is True


def test_make_record_reasoning_content_and_checks():
    p = prompt(3)
    rec = make_record(
        p,
        [*p.messages, {"role": "assistant", "content": None, "reasoning_content": "think"}],
        "m",
        "sglang",
        "stop",
        None,
    )
    assert rec["messages"][-1] == {"role": "assistant", "content": "", "reasoning": "think"}
    assert rec["usage"]["cost"] is None
    with pytest.raises(ValueError, match="no assistant turn"):
        make_record(p, list(p.messages), "m", "x", "stop", {})
    with pytest.raises(ValueError, match="differ"):
        make_record(
            p,
            [{"role": "user", "content": "other"}, {"role": "assistant", "content": "a"}],
            "m",
            "x",
            "stop",
            {},
        )


def test_normalize_usage_openrouter_details():
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 50,
        "completion_tokens_details": {"reasoning_tokens": 30},
        "prompt_tokens_details": {"cached_tokens": 64},
        "cost": "0.0021",
    }
    assert normalize_usage(usage) == {
        "prompt_tokens": 100,
        "completion_tokens": 50,
        "reasoning_tokens": 30,
        "cached_tokens": 64,
        "cost": 0.0021,
    }


# ------------------------------------------------------------------ store


def test_round_trip_and_resume(tmp_path):
    with ResultStore(tmp_path) as store:
        assert store.done_ids() == set()
        for i in range(3):
            assert store.append("chat", record(i))
        assert store.append("code", record(9, "code"))
        store.append_failed(make_failure(prompt(5), "http 400", status=400))
        assert store.done_ids("chat") == {"p0", "p1", "p2"}
        assert [r["id"] for r in store.iter_records("chat")] == ["p0", "p1", "p2"]

    assert lines(tmp_path / "chat.jsonl") == [record(i) for i in range(3)]
    failed = lines(tmp_path / "failed.jsonl")
    assert (
        failed[0]["id"] == "p5" and failed[0]["reason"] == "http 400" and failed[0]["status"] == 400
    )

    with ResultStore(tmp_path) as store:  # a second run resumes
        assert store.done_ids("chat") == {"p0", "p1", "p2"}
        assert store.done_ids() == {"p0", "p1", "p2", "p9"}
        assert store.failed_ids() == {"p5"}
        assert store.datasets() == ["chat", "code"]
        assert store.append("chat", record(1)) is False  # already done: not duplicated
        assert store.append("chat", record(3))
        assert [r["id"] for r in store.iter_records()] == ["p0", "p1", "p2", "p3", "p9"]
    assert [r["id"] for r in lines(tmp_path / "chat.jsonl")] == ["p0", "p1", "p2", "p3"]


def test_batched_fsync_and_readonly(tmp_path):
    store = ResultStore(tmp_path, fsync_interval=60.0)
    store.append("chat", record(0))
    reader = ResultStore(tmp_path, readonly=True)  # sees the line before any fsync
    assert reader.done_ids("chat") == {"p0"}
    store.append("chat", record(1))
    assert reader.done_ids("chat") == {"p0", "p1"}  # readers are not cached
    with pytest.raises(StoreError):
        reader.append("chat", record(2))
    store.close()


def test_single_writer_lock(tmp_path):
    store = ResultStore(tmp_path)
    with pytest.raises(StoreError, match="another process"):
        ResultStore(tmp_path)
    store.close()
    ResultStore(tmp_path).close()  # released on close


def test_try_lock_is_exclusive_until_its_descriptor_closes(tmp_path):
    path = tmp_path / ".lock"
    fd = try_lock(path)  # created
    assert fd is not None and path.is_file()
    assert try_lock(path) is None  # held: refused at once, not waited for
    os.close(fd)
    os.close(try_lock(path))  # released by the close


def test_bad_dataset_names(tmp_path):
    with ResultStore(tmp_path) as store:
        for name in ("failed", "ledger", "a/b", "", ".hidden"):
            with pytest.raises(StoreError):
                store.append(name, record(0))
        with pytest.raises(ValueError, match="id"):
            store.append("chat", {"messages": []})


@pytest.mark.parametrize("tail", ["cut", "all but the newline"])
def test_partial_trailing_line_is_repaired(tmp_path, tail):
    path = tmp_path / "chat.jsonl"
    good = [json.dumps(record(i)) for i in range(2)]
    partial = good[0][:25] if tail == "cut" else json.dumps(record(2))
    path.write_text("\n".join(good) + "\n" + partial)  # a kill -9 mid-write
    reader = ResultStore(tmp_path, readonly=True)
    assert [r["id"] for r in reader.iter_records("chat")] == ["p0", "p1"]  # never parsed
    assert reader.done_ids("chat") == {"p0", "p1"}
    with ResultStore(tmp_path) as store:
        assert path.read_text() == "\n".join(good) + "\n"  # truncated away on open
        assert store.done_ids("chat") == {"p0", "p1"}
        assert store.append("chat", record(2))
    assert [r["id"] for r in lines(path)] == ["p0", "p1", "p2"]  # not glued to the tail


def test_repair_tail_cases(tmp_path):
    path = tmp_path / "x.jsonl"
    assert repair_tail(path) == 0
    path.write_bytes(b"")
    assert repair_tail(path) == 0
    path.write_bytes(b'{"id": "a"}\n')
    assert repair_tail(path) == 0 and path.read_bytes() == b'{"id": "a"}\n'
    path.write_bytes(b"x" * 200_000)  # one long partial line, longer than a search block
    assert repair_tail(path) == 200_000 and path.read_bytes() == b""
    path.write_bytes(b'{"id": "a"}\n' + b"y" * 100_000)
    assert repair_tail(path) == 100_000 and path.read_bytes() == b'{"id": "a"}\n'


WRITER = """
import sys
from eagle3.data.prompts import Prompt
from eagle3.data.records import ResultStore, make_record
out = sys.argv[1]
store = ResultStore(out, fsync_interval=None)
done = store.done_ids("chat")
print("ready", flush=True)
i = 0
while True:
    pid = f"p{i}"
    if pid not in done:
        p = Prompt(pid, "chat", [{"role": "user", "content": "q" * 1000}])
        msgs = [*p.messages, {"role": "assistant", "content": "a" * (i % 5000), "reasoning": "r" * 3000}]
        store.append("chat", make_record(p, msgs, "m", "x", "stop", {}))
    i += 1
"""


def test_kill_9_mid_append_leaves_only_whole_lines(tmp_path):
    path = tmp_path / "chat.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    counts = []
    for _round in range(3):  # kill, resume, kill again: still no duplicates
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()
        start = path.stat().st_size if path.exists() else 0
        deadline = time.monotonic() + 30
        while (path.stat().st_size if path.exists() else 0) < start + 2_000_000:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL

        with ResultStore(tmp_path) as store:  # repairs a partial tail, if the kill left one
            ids = [r["id"] for r in store.iter_records("chat")]
        records = lines(path)  # every line parses, file ends with a newline
        assert [r["id"] for r in records] == ids
        assert len(ids) == len(set(ids)), "duplicate ids after resume"
        counts.append(len(ids))
    assert counts[0] < counts[1] < counts[2]
    # ids are a prefix p0..pN-1: resume skipped done ones and continued in order
    assert sorted(ids, key=lambda s: int(s[1:])) == [f"p{i}" for i in range(len(ids))]
