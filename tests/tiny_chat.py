"""Test helpers: tiny word-level chat tokenizers (ChatML and Kimi-K2.5 style) built in code.

Every word, punctuation mark and whitespace run is one token, so loss-mask positions can be
checked by hand. Loaded by path from the datagen tests (tests are not a package).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

# SmolLM2-135M-Instruct's template (ChatML with a default system prompt), verbatim.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Kimi-K2.5's structure (scripts/kimi_chat_template.jinja, shared with make_tiny_kimi.py): every assistant turn up to the last one is history and gets an empty
# `<think></think>` (its reasoning is dropped); turns after it keep `<think>reasoning</think>`;
# the generation prompt opens `<think>` (thinking on by default). `preserve_thinking=True`
# (Kimi-K2.6) keeps the reasoning of every turn.
KIMI_TEMPLATE = (Path(__file__).parents[1] / "scripts" / "kimi_chat_template.jinja").read_text()

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
KIMI_SPECIALS = [
    "[EOS]",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
]
PIECE = r"\s+|\w+|[^\w\s]"
CORPUS = (
    "system user assistant You are a helpful AI assistant named SmolLM, trained by Hugging Face "
    "You are Kimi, an AI assistant created by Moonshot AI. hello hi what is 2 + 3 = 5 ? ! "
    "add two numbers the answer first then more tell me a joke why sure ok no yes it was "
    "one three four six seven eight nine ten red green blue write code def return print"
)
WHITESPACE = [" ", "\n", "\n\n", "  "]


def word_tokenizer(specials: list[str], vocab_size: int = 256, corpus: str = CORPUS):
    """A PreTrainedTokenizerFast over the pieces of `corpus`, padded to `vocab_size` ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {"[UNK]": 0}
    for token in specials:
        vocab.setdefault(token, len(vocab))
    for piece in [*WHITESPACE, *re.findall(PIECE, corpus)]:
        vocab.setdefault(piece, len(vocab))
    filler = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{filler}", len(vocab))
        filler += 1
    assert len(vocab) == vocab_size, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        additional_special_tokens=specials,
    )


def chatml_tokenizer(vocab_size: int = 256):
    tok = word_tokenizer(CHATML_SPECIALS, vocab_size)
    tok.eos_token, tok.pad_token, tok.bos_token = "<|im_end|>", "<|im_end|>", "<|im_start|>"
    tok.chat_template = CHATML_TEMPLATE
    return tok


def kimi_tokenizer(vocab_size: int = 256):
    tok = word_tokenizer(KIMI_SPECIALS, vocab_size)
    tok.eos_token, tok.pad_token = "[EOS]", "[EOS]"
    tok.chat_template = KIMI_TEMPLATE
    return tok


def chat_model_dir(model_dir: Path, out_dir: Path, tokenizer) -> Path:
    """A copy of a saved tiny model directory with `tokenizer` saved beside it."""
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tokens(tokenizer, ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(ids))
