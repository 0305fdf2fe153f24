"""`python -m datagen.capture --estimate` (datagen.estimate): tokens, bytes and hours of a
capture, no weights loaded."""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from datagen import capture
from datagen.estimate import human_bytes, parse_count
from datagen.render import Rendering, render_all
from eagle3.targets import load_target


def _helper():
    spec = importlib.util.spec_from_file_location(
        "tiny_chat", Path(__file__).resolve().parents[1] / "tiny_chat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _helper()


@pytest.fixture(scope="module")
def chat_llama(tiny_llama_dir, tmp_path_factory):
    return tc.chat_model_dir(
        tiny_llama_dir, tmp_path_factory.mktemp("chat_llama"), tc.chatml_tokenizer()
    )


def run_cli(*argv) -> int:
    return capture.main([str(x) for x in argv])


def test_estimate_for_kimi_shows_terabytes_and_online_training(capsys):
    assert (
        run_cli("--target", "kimi-k2.5", "--estimate", "--tokens", "40M", "--tokens-per-s", "20000")
        == 0
    )
    text = capsys.readouterr().out
    assert "hidden size 7168" in text and "40,000,000 tokens" in text
    assert "57,349 bytes/token" in text and "2.3 TB" in text  # bf16
    assert "28,693 bytes/token" in text and "1.1 TB" in text  # fp8
    assert "35,857 bytes/token      1.4 TB on disk  (aux fp8, last bf16)" in text  # fp8-aux
    assert "0.56 h at 20,000 tok/s" in text
    assert "train online" in text and "data.mode=online" in text


def test_estimate_counts_the_records(chat_llama, tmp_path, capsys):
    """The tokens counted are those the capture would run: rendered, windows included."""
    records = [
        {"id": f"r{i}", "messages": [{"role": "user", "content": "hello " * i},
                                     {"role": "assistant", "content": "no " * (8 * i)}]}
        for i in range(1, 6)
    ]  # fmt: skip
    records.append({"id": "bad", "messages": [{"role": "assistant", "content": "hi"}]})
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_cli("--target", chat_llama, "--data", data, "--estimate", "--max-length", 32) == 0
    text = capsys.readouterr().out
    assert "hidden size 64" in text and "rendered with the target's tokenizer" in text
    assert "train online" not in text
    tokenizer = load_target(chat_llama, device="cpu").tokenizer
    items = render_all(records, tokenizer, Rendering(32, "window"), Counter())
    assert f": {sum(len(it.input_ids) for it in items):,} tokens" in text


@pytest.mark.parametrize(
    ("text", "count"),
    [("40M", 40_000_000), ("1.5k", 1_500), ("2B", 2_000_000_000), ("1_000", 1_000), ("7", 7)],
)
def test_token_counts_read_with_a_suffix(text, count):
    assert parse_count(text) == count


def test_a_token_count_that_is_not_one_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="not a token count"):
        parse_count("lots")


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 4_613_000, 2.3e12)] == ["512 B", "4.6 MB", "2.3 TB"]
