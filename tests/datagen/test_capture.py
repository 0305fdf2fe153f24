"""`python -m datagen.capture` on tiny random targets: shards equal the target's own capture,
bad input is counted, resume, a killed run, two processes, one loop for an in-process and a
served target, a damaged shard found by --verify and recaptured by a resume."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from datagen import capture
from datagen.render import Item
from eagle3.data.chat import render_record
from eagle3.data.shards import ShardDataset, ShardWriter, read_index, read_meta
from eagle3.engine.server import free_port
from eagle3.errors import Eagle3Error
from eagle3.targets import load_target, tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[2]


def _helper():
    spec = importlib.util.spec_from_file_location(
        "tiny_chat", Path(__file__).resolve().parents[1] / "tiny_chat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _helper()
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def chat_llama(tiny_llama_dir, tmp_path_factory):
    return tc.chat_model_dir(
        tiny_llama_dir, tmp_path_factory.mktemp("chat_llama"), tc.chatml_tokenizer()
    )


def record(rid, messages, finish="stop", dataset="chat"):
    return {
        "id": rid,
        "dataset": dataset,
        "messages": messages,
        "model": "fake/target",
        "provider": "local test",
        "finish_reason": finish,
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }


def q(text):
    return {"role": "user", "content": text}


def a(text, reasoning=""):
    return {"role": "assistant", "content": text, "reasoning": reasoning}


GOOD = [
    record("g0", [q("what is 2 + 3 ?"), a("it is 5")]),
    record("g1", [q("hello"), a("hi"), q("why ?"), a("sure ok")]),
    record("g2", [q("tell me a joke"), a("no " * 12)]),  # truncated to MAX_LENGTH, kept
    record("g3", [q("write code"), a("def")], finish="length"),  # cut at max tokens, kept
    record("g4", [q("add two numbers"), a("five", reasoning="add two")]),  # no place for it
]
BAD = [
    record("b0", [a("hi")]),  # no user turn
    record("b1", [q("hello"), a("")]),  # empty response
    record("b2", [q("red " * 20), a("yes")]),  # response entirely beyond MAX_LENGTH
    record("g0", [q("hello"), a("hi")]),  # duplicate id
    {"messages": []},  # no id
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(*argv) -> int:
    return capture.main([str(x) for x in argv])


def test_capture_equals_the_targets_own_forward(chat_llama, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", GOOD + BAD)
    out = tmp_path / "shards"
    assert run_cli("--target", chat_llama, "--data", data, "--out", out, "--max-length", MAX_LENGTH,
                   "--long-records", "cut", "--shard-mb", 0, "--batch-tokens", 100) == 0  # fmt: skip
    ds = ShardDataset(out)
    assert sorted(e["id"] for e in ds.index) == ["g0", "g1", "g2", "g3", "g4"]
    meta = ds.meta
    assert meta["target"] == chat_llama.name and meta["vocab_size"] == 256
    assert meta["target_hidden_size"] == 64 and meta["aux_layer_ids"] == [1, 3, 4]
    assert meta["num_layers"] == 8 and meta["max_length"] == MAX_LENGTH
    assert meta["sources"] == [str(data.resolve())] and meta["models"] == {"fake/target": 5}
    assert meta["providers"] == {"local test": 5}
    assert meta["summary"] == {
        "kept": 5,
        "kept: longer than --max-length (cut)": 1,
        "kept: response cut at max tokens (no end-of-turn token)": 1,
        "kept: reasoning left out (the template has no place for it)": 1,
        "skipped: no user turn": 1,
        "skipped: empty response": 1,
        "skipped: too long (no response token within --max-length)": 1,
        "skipped: duplicate id": 1,
        "skipped: bad record": 1,
    }
    assert "captured 5 records" in capsys.readouterr().out

    target = load_target(chat_llama, device="cpu")
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(target.tokenizer)  # the ids'
    by_id = {r["id"]: r for r in GOOD}
    for i in range(len(ds)):
        got = ds[i]
        want = render_record(target.tokenizer, by_id[got["id"]], max_length=MAX_LENGTH)
        assert got["input_ids"].tolist() == want.input_ids
        assert got["loss_mask"].tolist() == want.loss_mask
        aux, last = target.capture(torch.tensor([want.input_ids]))
        torch.testing.assert_close(got["aux_hidden"], aux[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got["last_hidden"], last[0], rtol=2e-2, atol=2e-2)
    assert meta["num_tokens"] == sum(ds.lengths)


def hidden(ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [B, T, 3H], last [B, T, H] (H = 4) of the tokens alone; padded positions zero."""
    x = (ids.float() * attn)[..., None] * torch.arange(1.0, 13.0) / 7
    return x, x[..., :4] * 3


class FakeTarget:
    """Target.capture's contract, with hidden states that depend on the tokens alone."""

    served = False
    hidden_size = 4

    def __init__(self, log: list[str]):
        self.tokenizer, self.log = SimpleNamespace(pad_token_id=0), log

    def capture(self, ids, attn):
        self.log.append("forward")
        return hidden(ids, attn)

    def stop(self) -> None:
        pass


class FakeServed(FakeTarget):
    """Served: capture_async's futures finish in a random order, as an engine's requests do."""

    served = True

    def __init__(self, log: list[str]):
        super().__init__(log)
        self.pool = ThreadPoolExecutor(4)

    def capture_async(self, ids, attn):
        self.log.append("request")

        def forward():
            time.sleep(random.random() * 0.01)
            return hidden(ids, attn)

        return self.pool.submit(forward)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_one_loop_writes_the_same_shards_for_an_in_process_and_a_served_target(tmp_path, dtype):
    """capture_items: the same batches in the same order, hence byte-identical shards and
    index; the served target gets every batch's requests before the first batch is written
    (its requests stay in flight across batches), the in-process one forwards batch by batch."""
    rng = random.Random(0)
    items = [Item(f"r{i}", "chat", [rng.randrange(1, 256) for _ in range(n)], [1] * n)
             for i, n in enumerate(rng.randrange(1, 40) for _ in range(30))]  # fmt: skip

    def captured(target_class, out: Path) -> tuple[dict[str, bytes], list[str]]:
        log: list[str] = []
        with ShardWriter(out, {"target": "fake"}, dtype, 2000) as writer:
            add_batch = writer.add_batch
            writer.add_batch = lambda *a, **k: (log.append("write"), add_batch(*a, **k))
            tokens = capture.capture_items(target_class(log), items, writer, batch_tokens=60)
        assert tokens == sum(len(it.input_ids) for it in items)
        files = [p for p in sorted(out.iterdir()) if p.suffix in (".safetensors", ".jsonl")]
        return {p.name: p.read_bytes() for p in files}, log

    here, here_log = captured(FakeTarget, tmp_path / "in-process")
    served, served_log = captured(FakeServed, tmp_path / "served")
    assert len(served) > 3 and served == here
    n = len(capture.batches(items, 60))
    assert served_log == ["request"] * n + ["write"] * n
    assert here_log == ["forward", "write"] * n


def test_long_records_are_captured_as_windows_and_resumed_window_by_window(
    chat_llama, tmp_path, caplog
):
    """--long-records window (the default): a record longer than --max-length becomes windows
    <id>#wI, each the target's forward over the window alone, every response token in exactly
    one window's loss mask; the length report names what a cut would have dropped. A window
    lost with its shard is captured again alone (the record's other windows stay)."""
    from eagle3.data.windows import split_windows, window_mask

    long = [GOOD[2], BAD[2], GOOD[0]]  # g2: cut before; b2: its whole response past the cut
    data = write_jsonl(tmp_path / "long.jsonl", long)
    out = tmp_path / "shards"
    args = ["--target", chat_llama, "--data", data, "--out", out, "--max-length", 24,
            "--window-context", 8, "--shard-mb", 0]  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert run_cli(*args) == 0
    report = [r.message for r in caplog.records if r.message.startswith("records to capture")]
    target = load_target(chat_llama, device="cpu")
    n_long = sum(len(render_record(target.tokenizer, r).input_ids) > 24 for r in long)
    assert report and f"{n_long} longer than max_length 24, whose cut would drop" in report[0]
    ds = ShardDataset(out)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    for rec in long:
        whole = render_record(target.tokenizer, rec)
        mask = torch.tensor(whole.loss_mask)
        windows = split_windows(mask, 24, 8)
        ids = (
            [f"{rec['id']}#w{i}" for i in range(len(windows))] if len(windows) > 1 else [rec["id"]]
        )
        trained = torch.zeros_like(mask)
        for wid, w in zip(ids, windows):
            row = got.pop(wid)
            assert row["input_ids"].tolist() == whole.input_ids[w.start : w.end]
            assert torch.equal(row["loss_mask"], window_mask(mask, w))
            trained[w.start : w.end] += row["loss_mask"]
            aux, last = target.capture(row["input_ids"][None])  # the window alone
            torch.testing.assert_close(row["aux_hidden"], aux[0], rtol=2e-2, atol=2e-2)
        assert torch.equal(trained, mask)  # every response token once
    assert not got

    lost = next(e for e in read_index(out) if e["id"] == "g2#w1")
    (out / lost["shard"]).write_bytes(b"cut")  # that window's shard (one record a shard)
    before = {e["id"]: e["shard"] for e in read_index(out)}
    assert run_cli(*args) == 0
    after = {e["id"]: e["shard"] for e in read_index(out)}
    assert set(after) == set(before)
    assert [i for i in after if after[i] != before[i]] == ["g2#w1"]  # recaptured alone


def test_resume_skips_what_is_captured(chat_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("eagle3.progress.EVERY_S", 0.0)  # a progress line at every batch
    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    first = write_jsonl(tmp_path / "a.jsonl", GOOD[:3])
    out = tmp_path / "shards"
    args = [
        "--target",
        chat_llama,
        "--out",
        out,
        "--max-length",
        MAX_LENGTH,
        "--shard-mb",
        0,
        "--long-records",
        "cut",
        "--batch-tokens",
        30,  # one record a batch
    ]  # fmt: skip  (windows resume: the test above)
    assert run_cli(*args, "--data", first) == 0
    index = (out / "index.jsonl").read_text()
    before = sum(e["length"] for e in read_index(out))
    capsys.readouterr()
    assert run_cli(*args, "--data", first) == 0  # nothing new
    assert (out / "index.jsonl").read_text() == index
    assert read_meta(out)["summary"] == {"already captured": 3}
    err = capsys.readouterr().err
    assert f"capture: {before:,}/{before:,} tokens (100%, {before:,} already done) in " in err
    second = write_jsonl(tmp_path / "b.jsonl", GOOD[3:])
    assert run_cli(*args, "--data", first, second) == 0
    ds = ShardDataset(out)
    assert sorted(e["id"] for e in ds.index) == ["g0", "g1", "g2", "g3", "g4"]
    assert ds.meta["summary"]["already captured"] == 3 and ds.meta["summary"]["kept"] == 2
    assert len(ds.meta["sources"]) == 2 and ds.meta["models"] == {"fake/target": 5}
    # progress in tokens, the 3 records of the first run already done; the last line says where
    total = ds.meta["num_tokens"]
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("capture: ")]
    done = f"{before:,}/{total:,} tokens ({100 * before // total}%, {before:,} already done)"
    assert lines[0] == f"capture: {done}, eta -; 0/2 sequences in this run"
    assert ", eta " in lines[1] and lines[1].endswith("; 1/2 sequences in this run")
    assert lines[-1].startswith(f"capture: {total:,}/{total:,} tokens (100%, {before:,} already")
    assert captured.out.splitlines()[-1] == (
        f"capture: 5 records, {total} tokens in {ds.meta['num_shards']} shards -> {out} "
        "(meta.json, index.jsonl)"
    )


def test_settings_that_change_the_data_are_refused_on_resume(chat_llama, tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", GOOD[:1])
    out = tmp_path / "shards"
    assert run_cli("--target", chat_llama, "--data", data, "--out", out) == 0
    capsys.readouterr()
    assert run_cli("--target", chat_llama, "--data", data, "--out", out, "--dtype", "fp8") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "different capture" in err and err.count("\n") == 1
    assert "Loading weights" not in err  # refused before the target is loaded


def test_an_unknown_dtype_is_one_line(capsys):
    """~0.1 s. --dtype not a storage mode: one line naming the modes, exit 2 (not argparse's
    usage block)."""
    assert run_cli("--target", "kimi-k2.5", "--estimate", "--tokens", "1M", "--dtype", "fp4") == 2
    err = capsys.readouterr().err
    assert err == "error: --dtype fp4: not a storage dtype; use one of bf16, fp16, fp8, fp8-aux\n"


def test_target_without_a_chat_template_is_one_line(tiny_llama_dir, tmp_path, capsys):
    bare = tc.chat_model_dir(
        tiny_llama_dir, tmp_path / "bare", tc.word_tokenizer(tc.CHATML_SPECIALS)
    )
    data = write_jsonl(tmp_path / "a.jsonl", GOOD[:1])
    assert run_cli("--target", bare, "--data", data, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: ") and "no chat template" in err and "--chat-template" in err
    # given one, it works
    assert run_cli("--target", bare, "--data", data, "--out", tmp_path / "o",
                   "--chat-template", tc.CHATML_TEMPLATE) == 0  # fmt: skip


def test_kimi_style_target_with_reasoning(tiny_deepseek_dir, tmp_path):
    """DeepSeek-V3 architecture (Kimi-K2.5's) and a Kimi-style template with thinking."""
    model = tc.chat_model_dir(tiny_deepseek_dir, tmp_path / "kimi", tc.kimi_tokenizer())
    records = [
        record("k0", [q("what is 2 + 3 ?"), a("it is 5", reasoning="add two numbers")]),
        record(
            "k1", [q("hello"), a("hi", reasoning="tell me"), q("why ?"), a("sure", reasoning="ok")]
        ),
    ]
    data = write_jsonl(tmp_path / "kimi.jsonl", records)
    out = tmp_path / "shards"
    assert run_cli("--target", model, "--data", data, "--out", out, "--dtype", "fp8-aux") == 0
    ds = ShardDataset(out)
    assert ds.meta["summary"] == {"kept": 2} and ds.meta["dtype"] == "fp8-aux"
    assert ds.meta["fp8_scales"] == {"aux_hidden": "aux_scale"}  # the last state is bf16
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    tok = tc.kimi_tokenizer()
    masked = [
        t for t, m in zip(tc.tokens(tok, got["k0"]["input_ids"]), got["k0"]["loss_mask"]) if m
    ]
    assert masked == [
        "add",
        " ",
        "two",
        " ",
        "numbers",
        "</think>",
        "it",
        " ",
        "is",
        " ",
        "5",
        "<|im_end|>",
    ]
    assert got["k1"]["aux_hidden"].shape == (len(got["k1"]["input_ids"]), 3 * 64)


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import eagle3.data.shards.writer as shards  # where ShardWriter looks up save_file
    from datagen import capture

    calls = [0]
    real = shards.save_file

    def save_then_die(*args, **kwargs):  # the 3rd shard is written to its temp name, then -9
        real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    shards.save_file = save_then_die
    sys.exit(capture.main(sys.argv[1:]))
    """
)


def many_records(n: int) -> list[dict]:
    words = ["red", "green", "blue", "one", "three", "four", "six", "seven"]
    return [
        record(f"m{i}", [q(f"what is {words[i % 8]} ?"), a(" ".join(words[: 1 + i % 8]))])
        for i in range(n)
    ]


@pytest.mark.slow
def test_killed_run_resumes_with_every_record_once(chat_llama, tmp_path, capsys):
    """A capture SIGKILLed right after its 3rd shard reached its temp name (2 records indexed, a
    .tmp left behind): the resume keeps the 2, captures the other 8 and removes the temp file, so
    every record is in the index exactly once. Only a real kill -9 in a subprocess skips every
    cleanup path. Costs ~4 s (its call; measured on 2 xdist workers)."""
    data = write_jsonl(tmp_path / "a.jsonl", many_records(10))
    out = tmp_path / "shards"
    args = ["--target", str(chat_llama), "--data", str(data), "--out", str(out), "--shard-mb", "0",
            "--batch-tokens", "64"]  # fmt: skip
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(read_index(out)) == 2 and any(p.name.endswith(".tmp") for p in out.iterdir())
    assert run_cli(*args) == 0
    ds = ShardDataset(out)
    assert sorted(e["id"] for e in ds.index) == sorted(f"m{i}" for i in range(10))
    assert (
        len(list(e["id"] for e in ds.index)) == 10 and ds.meta["summary"]["already captured"] == 2
    )
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    capsys.readouterr()


@pytest.mark.slow
def test_two_processes_capture_every_record_exactly_once(chat_llama, tmp_path):
    """A capture launched by torchrun as 2 processes splits 13 records between them: each record
    once, both processes write shards, one meta.json (processes: 2) and one summary line, and every
    stored record equals the target's own capture: the only multi-process capture. Costs ~9 s (its
    call; measured on 2 xdist workers)."""
    records = many_records(13)
    data = write_jsonl(tmp_path / "a.jsonl", records)
    out = tmp_path / "shards"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "datagen.capture", "--target", str(chat_llama), "--data", str(data),
        "--out", str(out), "--shard-mb", "0", "--batch-tokens", "64",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = ShardDataset(out)
    ids = list(e["id"] for e in ds.index)
    assert len(ids) == len(set(ids)) == 13 and set(ids) == {r["id"] for r in records}
    parts = {e["shard"].split("-")[1] for e in ds.index}
    assert parts == {"000", "001"}  # both processes wrote shards
    assert ds.meta["processes"] == 2 and ds.meta["summary"] == {"kept": 13}
    assert proc.stdout.count("captured 13 records") == 1  # printed once, by process 0
    target = load_target(chat_llama, device="cpu")
    by_id = {r["id"]: r for r in records}
    for i in range(len(ds)):
        got = ds[i]
        want = render_record(target.tokenizer, by_id[got["id"]], max_length=4096)
        assert got["input_ids"].tolist() == want.input_ids
        _, last = target.capture(torch.tensor([want.input_ids]))
        torch.testing.assert_close(got["last_hidden"], last[0], rtol=2e-2, atol=2e-2)


def damage(path: Path, how: str) -> None:
    """What a full disk or a copy cut short leaves (truncated), or bit rot (same size)."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # flipped bytes in the tensor data, the header intact
        i = len(data) * 2 // 3
        path.write_bytes(data[:i] + bytes(b ^ 0xFF for b in data[i : i + 4]) + data[i + 4 :])


def records_by_id(out: Path) -> dict[str, dict]:
    ds = ShardDataset(out)
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_damaged_shard_is_found_named_and_recaptured_by_a_resume(chat_llama, tmp_path, capsys, how):
    data = write_jsonl(tmp_path / "a.jsonl", many_records(8))
    clean, out = tmp_path / "clean", tmp_path / "shards"
    args = [
        "--target",
        chat_llama,
        "--data",
        data,
        "--max-length",
        MAX_LENGTH,
        "--shard-mb",
        0.03,
        "--batch-tokens",
        1,
    ]  # fmt: skip (~2 records a shard, 1 a forward)
    assert run_cli(*args, "--out", clean) == 0
    shutil.copytree(clean, out)  # byte-identical, mtimes kept
    names = sorted({e["shard"] for e in read_index(out)})
    victim = out / names[1]
    held = sum(e["shard"] == victim.name for e in read_index(out))
    assert len(names) >= 3 and held >= 2
    damage(victim, how)
    others = {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns) for n in names}
    del others[victim.name]
    assert run_cli("--verify", "--out", clean) == 0
    capsys.readouterr()

    # --verify: one line naming the shard, a summary with the command, exit 1
    assert run_cli("--verify", "--out", out) == capture.EXIT_DAMAGED == 1
    lines = capsys.readouterr().out.splitlines()
    problem = "truncated (" if how == "truncated" else "damaged ("
    assert len(lines) == 2 and lines[0] == f"{victim}: {lines[0].split(': ', 1)[1]}"
    assert problem in lines[0] and lines[0].endswith(f", {held} record(s)")
    assert lines[1].startswith(f"1 of {len(names)} shards damaged or missing, {held} of 8 records")

    # training's reader: one line naming the shard, its records and the command that repairs
    with pytest.raises(Eagle3Error) as err:
        records_by_id(out)
    message = str(err.value)
    assert "\n" not in message and f"shard {victim} is {problem}" in message
    assert f"it held {held} record(s)" in message
    command = shlex.split(message.split("by resuming the capture: ")[1])
    assert command[:3] == ["python", "-m", "datagen.capture"] and command[-2:] == [
        "--out",
        str(out),
    ]
    assert lines[1].endswith(shlex.join(command))  # --verify names the same command

    # that command (a resume) recaptures exactly the damaged shard's records
    assert run_cli(*command[3:]) == 0
    assert read_meta(out)["summary"] == {
        "dropped: damaged shards": 1,
        "dropped: records": held,
        "already captured": 8 - held,
        "kept": held,
    }
    assert (
        f"dropped 1 damaged or missing shard(s) holding {held} records" in capsys.readouterr().out
    )
    assert {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns) for n in others} == others
    assert run_cli("--verify", "--out", out) == 0
    assert "are intact (8 records; size and xxh3)" in capsys.readouterr().out
    want, got = records_by_id(clean), records_by_id(out)
    assert got.keys() == want.keys()
    for rid, record in want.items():
        for key, value in record.items():
            assert value == got[rid][key] if key == "id" else torch.equal(value, got[rid][key])


def test_verify_of_what_is_not_a_capture_is_one_line(tmp_path, capsys):
    assert run_cli("--verify", "--out", tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no meta.json" in err and err.count("\n") == 1
