"""The run's draft vocab (d2t / t2d): built once from the training data, then always reused.

It is saved as `draft_vocab.safetensors` in train.out_dir before any training step, so a
resumed run, a restarted one and a fine-tuning run on model.init_from train over the same
draft tokens (unless model.revocab re-chooses them from the data); `read_vocab` also takes it
out of an exported draft, ours or a published layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from eagle3.errors import Eagle3Error
from eagle3.published import vocab_offsets
from eagle3.vocab import DraftVocab, build_draft_vocab, revocab_summary, vocab_from_d2t
from train.config import ModelConfig
from train.datasets import token_counts

VOCAB_FILE = "draft_vocab.safetensors"


def read_vocab(path: Path, vocab_size: int) -> DraftVocab:
    """A vocab from a run dir, a draft_vocab.safetensors file, or a draft checkpoint dir."""
    if path.is_dir() and (path / VOCAB_FILE).is_file():
        path = path / VOCAB_FILE
    if path.is_dir():  # a checkpoint: its d2t, or the whole vocab for a draft without one
        d2t = vocab_offsets(path)
    elif path.is_file():
        d2t = load_file(str(path))["d2t"]
    else:
        raise Eagle3Error(
            f"no draft vocab at {path}: pass a run dir, {VOCAB_FILE} or a draft checkpoint"
        )
    top = int((d2t.long() + torch.arange(d2t.numel())).max())  # the largest target id it maps
    if top >= vocab_size:  # checked before vocab_from_d2t, which would index past the end
        raise Eagle3Error(
            f"the draft vocab in {path} is for a larger target vocab than {vocab_size} "
            f"(it maps target id {top}): use a vocab built for this target"
        )
    return vocab_from_d2t(d2t, vocab_size)


def setup_vocab(
    model: ModelConfig, accelerator: Accelerator, dataset: Dataset, vocab_size: int, out_dir: Path
) -> DraftVocab:
    """The run's draft vocab: its saved one (resume), else model.draft_vocab / model.init_from's,
    else built from the training data on the main process; saved once, read by every rank."""
    saved = out_dir / VOCAB_FILE
    revocab = model.revocab  # with init_from: choose anew from the data (train.draft maps)
    source = model.draft_vocab or (None if revocab else model.init_from)
    exists = saved.is_file()
    accelerator.wait_for_everyone()  # every rank looked before the main process writes it
    if exists:  # resume (or a restarted run): the run's own vocab wins
        vocab = read_vocab(saved, vocab_size)
        if source is not None and not torch.equal(
            read_vocab(Path(source), vocab_size).d2t, vocab.d2t
        ):
            raise Eagle3Error(
                f"{saved} differs from the vocab of {source}; use a fresh train.out_dir to change vocab"
            )
        return vocab
    if source is not None:
        vocab = read_vocab(Path(source), vocab_size)
        how = f"copied from {source}"
    else:
        if accelerator.is_main_process:
            counts = token_counts(dataset, vocab_size)
            vocab = build_draft_vocab(counts, model.draft_vocab_size)
            if revocab:
                start = read_vocab(Path(model.init_from), vocab_size)
                print(revocab_summary(counts, vocab, start), flush=True)
        how = "built from the training data's loss-masked tokens"
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(saved), metadata={"source": how})
        print(f"draft vocab: {vocab.size} tokens, {how} -> {saved}", flush=True)
    accelerator.wait_for_everyone()  # other ranks read the main process's vocab
    return read_vocab(saved, vocab_size)
