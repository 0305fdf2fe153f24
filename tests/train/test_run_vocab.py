"""train/run_vocab.py: the run's draft vocab is built once, saved with the run, and reused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import Eagle3Error
from eagle3.vocab import build_draft_vocab
from train.run_vocab import VOCAB_FILE, read_vocab


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
def test_fine_tune_reuses_the_saved_vocab(
    tmp_path, helpers, tiny_llama_dir, records_file, online_run
):
    """Two CLI runs from the session's online run (133 s measured at load 7 on 2
    cores): a fine-tune keeps the start's saved vocab and starts from its weights, and an
    EAGLE-3 start under model.draft.method=eagle3.1 is refused in one line."""
    base, tuned = online_run, tmp_path / "tuned"  # the start: the session's online run
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


def published_llama(start: Path) -> dict:
    """A TorchSpec Llama head as lightseekorg/kimi-k2.5-eagle3 publishes it, for the tiny
    Llama target (tests/eagle3/test_published_drafters.py: no draft_vocab_size,
    target_hidden_size or eagle_config, so the target's default aux layers [1, 3, 4];
    embed_tokens inside; the whole vocab, no d2t) -> its tensors."""
    H, V = 64, 256
    start.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-06,
        "rope_theta": 50000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64, "type": "yarn"},
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": V,
    }
    (start / "config.json").write_text(json.dumps(config))
    shapes = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (64, 2 * H),
        "midlayer.self_attn.k_proj.weight": (32, 2 * H),
        "midlayer.self_attn.v_proj.weight": (32, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 64),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (96, H),
        "midlayer.mlp.up_proj.weight": (96, H),
        "midlayer.mlp.down_proj.weight": (H, 96),
        "norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    tensors = {k: (0.05 * torch.randn(s)).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(start / "model.safetensors"))
    return tensors


@pytest.mark.slow
def test_fine_tune_from_a_published_drafter_re_chooses_its_vocab(
    tmp_path, helpers, tiny_llama_dir, records_file
):
    """~7 s idle, ~17 s on a loaded 2-core machine (one CLI run of one step; the fast
    test_init_from_a_published_drafter_... below proves the same logic in 0.2 s). model.init_from on a TorchSpec Llama head as
    lightseekorg/kimi-k2.5-eagle3 publishes it (tests/eagle3/test_published_drafters.py: no
    draft_vocab_size, target_hidden_size or eagle_config, so the tiny target's default aux
    layers; embed_tokens inside; the whole vocab, no d2t) with model.revocab trains, says what
    the re-chosen 200-token vocab covers, and exports our format with its d2t."""
    start = tmp_path / "published"
    published_llama(start)
    out = tmp_path / "tuned"
    proc = helpers.run_cli(
        helpers.common_args(
            tiny_llama_dir,
            out,
            **helpers.online(records_file),
            **{"model.init_from": start, "model.revocab": "true", "train.max_steps": 1},
        )
    )
    assert "draft vocab re-chosen from the data: 200 tokens cover" in proc.stdout
    final = json.loads((out / "final" / "config.json").read_text())
    assert final["architectures"] == ["LlamaForCausalLMEagle3"]
    assert final["draft_vocab_size"] == 200
    assert final["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    d2t = load_file(str(out / "final" / "model.safetensors"))["d2t"]
    assert d2t.equal(load_file(str(out / "draft_vocab.safetensors"))["d2t"])


def test_init_from_a_published_drafter_checks_aux_layers_and_re_chooses_the_vocab(tmp_path):
    """~1 s. train.draft.build_draft on a published miniature: model.revocab maps lm_head onto
    the new vocab (from the whole vocab every row is carried over) and keeps the file's own
    embeddings (they differ from the target's), and records captured at
    other aux layers than the drafter reads are one line naming target.aux_layer_ids."""
    from transformers import LlamaConfig

    from train.config import load_config
    from train.draft import build_draft

    start = tmp_path / "published"
    tensors = published_llama(start)
    cfg = load_config(
        None,
        ["data.shard_dirs=[x]", f"model.init_from={start}", "model.revocab=true"],
        check_paths=False,
    )
    hf = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    facts = {"hf_config": hf, "num_layers": 8}
    vocab = build_draft_vocab(torch.arange(256), 50)  # the 50 most frequent: ids 206-255
    data = SimpleNamespace(embed=torch.randn(256, 64), aux_layer_ids=[1, 3, 4])
    draft = build_draft(cfg.model, facts, vocab, data)
    assert draft.config.draft_vocab_size == 50 and torch.equal(draft.d2t, vocab.d2t)
    assert torch.equal(draft.lm_head.weight, tensors["lm_head.weight"].float()[206:])
    assert torch.equal(draft.fc.weight, tensors["fc.weight"].float())
    # its embed_tokens differ from the target's: its own, kept through the new vocab
    assert draft.config.own_embeddings
    assert torch.equal(draft.embed_tokens.weight, tensors["embed_tokens.weight"].float())
    data.aux_layer_ids = [1, 2, 4]
    with pytest.raises(Eagle3Error, match=r"target.aux_layer_ids=\[1, 3, 4\]") as err:
        build_draft(cfg.model, facts, vocab, data)
    assert "\n" not in str(err.value)
