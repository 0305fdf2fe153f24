"""train/vocab.py: the run's draft vocab is built once, saved with the run, and reused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import Eagle3Error
from eagle3.vocab import build_draft_vocab
from train.vocab import VOCAB_FILE, read_vocab


def test_read_vocab_takes_a_run_dir_its_file_or_an_export(tmp_path):
    vocab = build_draft_vocab(torch.arange(50), 10)
    save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(tmp_path / VOCAB_FILE))
    export = tmp_path / "final"
    export.mkdir()
    save_file({"d2t": vocab.d2t}, str(export / "model.safetensors"))
    for path in (tmp_path, tmp_path / VOCAB_FILE, export):
        assert torch.equal(read_vocab(path, 50).d2t, vocab.d2t)
    with pytest.raises(Eagle3Error, match="no draft vocab"):
        read_vocab(tmp_path / "missing", 50)
    # a vocab built for a larger target is one line, not an IndexError
    big = build_draft_vocab(torch.arange(200), 10)  # the 10 most frequent: ids 190-199
    save_file({"d2t": big.d2t}, str(tmp_path / "big.safetensors"))
    with pytest.raises(Eagle3Error, match="larger target vocab than 50"):
        read_vocab(tmp_path / "big.safetensors", 50)
    assert read_vocab(tmp_path / "big.safetensors", 200).draft_ids.max() < 200


@pytest.mark.slow
def test_fine_tune_reuses_the_saved_vocab(tmp_path, helpers, tiny_llama_dir, records_file):
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    helpers.run_cli(helpers.common_args(tiny_llama_dir, base, **helpers.online(records_file)))
    helpers.run_cli(
        helpers.common_args(
            tiny_llama_dir,
            tuned,
            **helpers.online(records_file),
            **{"model.init_from": base / "final", "model.draft_vocab_size": 50},
        )
    )
    d2t = load_file(str(base / "draft_vocab.safetensors"))["d2t"]
    assert d2t.numel() == 200  # model.draft_vocab_size=50 did not trigger a rebuild
    assert d2t.equal(load_file(str(tuned / "draft_vocab.safetensors"))["d2t"])
    assert helpers.losses(tuned)[0] < helpers.losses(base)[0]  # started from the trained weights
    # an EAGLE-3 checkpoint fine-tuned as EAGLE-3.1 would start with no fc_norm: one line
    other = helpers.common_args(
        tiny_llama_dir,
        tmp_path / "other",
        **helpers.online(records_file),
        **{"model.init_from": base / "final", "model.draft.method": "eagle3.1"},
    )
    proc = helpers.run_cli(other, check=False)
    assert proc.returncode != 0
    assert "is a eagle3 drafter but model.draft.method is 'eagle3.1'" in proc.stderr
