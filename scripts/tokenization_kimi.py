"""The Kimi miniature's tokenizer: remote code over tiktoken, laid out as Kimi-K2.5's is.

scripts/make_tiny_kimi.py copies this file into the miniature's directory next to
`tiktoken.model` (one `base64(token bytes) rank` per line) and a tokenizer_config.json whose
`auto_map` names `tokenization_kimi.TikTokenTokenizer`, so that, as with the real model,
`AutoTokenizer.from_pretrained(dir)` needs `trust_remote_code=True`. Special tokens come from
tokenizer_config.json's `added_tokens_decoder` and take the ids after the BPE's.

Tokens are byte strings; as strings they are written with GPT-2's byte-to-character table, so
that every token is printable and `convert_tokens_to_string` gives the bytes back exactly.
"""

from __future__ import annotations

import base64
import os
import shutil
from functools import lru_cache

import tiktoken
from transformers import PreTrainedTokenizer

# Pre-tokenisation: contractions, words (with their leading space), numbers, punctuation runs,
# whitespace; the BPE merges inside each piece.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB_FILE = "tiktoken.model"


@lru_cache
def byte_chars() -> dict[int, str]:
    """GPT-2's table: each byte -> a printable character (printable bytes stand for
    themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def read_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, added_tokens_decoder=None, **kwargs):
        ranks = read_ranks(vocab_file)
        specials = {str(t): int(i) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(vocab_file)) or "kimi-miniature",
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        chars = byte_chars()
        self.decoder = {i: "".join(chars[b] for b in t) for t, i in ranks.items()}
        self.decoder.update({i: t for t, i in specials.items()})
        self.encoder = {t: i for i, t in self.decoder.items()}
        self.byte_of = {c: b for b, c in chars.items()}
        super().__init__(added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # special tokens were split off by the base class: here everything is ordinary text
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, pending = [], bytearray()
        for token in tokens:
            if token in self.added_tokens_encoder:  # a special token is text as it is
                out.append(pending.decode("utf-8", errors="replace") + token)
                pending = bytearray()
            else:
                pending.extend(self.byte_of[c] for c in token)
        return "".join(out) + pending.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE
        path = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(path):
            shutil.copyfile(self.vocab_file, path)
        return (path,)
