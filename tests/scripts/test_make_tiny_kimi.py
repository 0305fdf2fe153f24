"""The Kimi miniature's tokenizer is remote code over tiktoken, as Kimi-K2.5's is (~1 s)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs tiktoken (pip install -e '.[dev]')")
    spec = importlib.util.spec_from_file_location(
        "make_tiny_kimi", REPO / "scripts/make_tiny_kimi.py"
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    out = tmp_path_factory.mktemp("kimi_tokenizer")
    maker.write_tokenizer(out)
    return out


def test_it_is_laid_out_as_kimis_and_needs_remote_code(tokenizer_dir):
    from transformers import AutoTokenizer

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    assert (tokenizer_dir / "tokenization_kimi.py").is_file()
    assert (tokenizer_dir / "tiktoken.model").is_file()
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(tokenizer_dir)  # as the real one: refused without it
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer"


def test_text_and_special_tokens_round_trip(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    for text in [
        "Hello wörld! 17+25=42",
        "日本語 and emoji 🙂",
        "<think>plan</think>answer<|im_end|>",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    specials = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<think>", "</think>"]
    ids = tok.convert_tokens_to_ids(specials)
    assert len(set(ids)) == len(specials) and min(ids) >= 256 + 300  # after the BPE's ids
    assert tok.encode("<think>", add_special_tokens=False) == [ids[3]]  # one token, not bytes
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == ids[0]
    assert tok.decode(ids, skip_special_tokens=True) == ""


def test_the_chat_template_is_kimis_shape(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith(
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )


def test_every_id_of_the_padded_vocabulary_decodes(tokenizer_dir):
    """A random model samples any id below its vocab size: Kimi's reserved tokens fill the
    padding, so decoding never meets an id without a token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    assert len(tok) % 64 == 0
    ids = list(range(len(tok)))
    assert tok.convert_ids_to_tokens(ids)[-1] == f"<|reserved_token_{len(tok) - 1}|>"
    assert tok.decode(ids, skip_special_tokens=True)  # no id without a token
