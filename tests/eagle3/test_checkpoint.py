"""Drafter checkpoints: SGLang EAGLE-3 layout, exact round trip, clear errors on bad directories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.checkpoint import load_config, load_draft, save_draft
from eagle3.errors import Eagle3Error
from eagle3.methods import from_target_config, make_draft_config
from eagle3.model import Eagle3Draft

H, V, VD = 64, 256, 32

SAVED_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def make_draft() -> Eagle3Draft:
    cfg = make_draft_config(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        draft_vocab_size=VD,
        target_hidden_size=48,  # differs from H on purpose: fc is [H, 3 * 48]
        aux_layer_ids=[1, 3, 4],
    )
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones: perturb so a skipped tensor shows
            p.add_(0.05 * torch.randn_like(p))
    draft_ids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    model.set_vocab(draft_ids - torch.arange(VD), t2d)
    return model


@pytest.fixture
def saved(tmp_path):
    model = make_draft()
    out = save_draft(
        model, tmp_path / "ckpt", extra_config={"target": "tiny", "ttt_steps": 5}, dtype=None
    )
    return model, out


def test_round_trip_gives_identical_logits(saved):
    model, out = saved
    loaded = load_draft(out, embed_weight=model.embed_tokens.weight)
    ids = torch.randint(0, V, (2, 9))
    aux = torch.randn(2, 9, 3 * 48)
    with torch.no_grad():
        for a, b in zip(model.ttt_forward(ids, aux, 3), loaded.ttt_forward(ids, aux, 3)):
            assert torch.equal(a, b)
        hidden = model.project(aux)
        pos = torch.arange(9)[None].expand(2, 9)
        assert torch.equal(model(ids, hidden, pos)[1], loaded(ids, hidden, pos)[1])
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    assert torch.equal(
        loaded.draft_to_target(torch.arange(VD)), model.draft_to_target(torch.arange(VD))
    )


def test_config_json_carries_every_design_field(saved):
    model, out = saved
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    expected = {
        "hidden_size": H,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "target_hidden_size": 48,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    assert {k: cfg[k] for k in expected} == expected
    for key in ("rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings"):
        assert key in cfg
    assert cfg["eagle_config"] == {  # SGLang reads this and adds 1: the project's ids
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
        "use_aux_hidden_state": True,
        "method": "eagle3",  # ours, checked against fc_norm / norm_output on load
    }
    # vLLM reads the top-level key first and uses it as is ("after k layers"): ids + 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["verifier"]["name_or_path"] == "tiny"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["extra_config"] == {"target": "tiny", "ttt_steps": 5}
    assert load_config(out)[0] == model.config


def test_config_json_is_a_valid_hf_llama_config(saved):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(saved[1])  # what SGLang/vLLM do first
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (H, V, VD)


def test_safetensors_hold_exactly_the_listed_keys(saved):
    _, out = saved
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == SAVED_KEYS  # in particular no embed_tokens.weight
        assert f.get_tensor("fc.weight").shape == (H, 3 * 48)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (4 * 16, 2 * H)
        assert f.get_tensor("lm_head.weight").shape == (VD, H)
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("d2t").shape == (VD,)
        assert f.get_tensor("t2d").dtype == torch.bool and f.get_tensor("t2d").shape == (V,)


def test_bf16_round_trip(tmp_path):
    model = make_draft().to(torch.bfloat16)
    out = save_draft(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_draft(out, embed_weight=model.embed_tokens.weight)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def _rewrite(out, change):
    path = out / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path))


def test_missing_tensor_is_named(saved):
    _, out = saved
    _rewrite(out, lambda s: s.pop("midlayer.mlp.down_proj.weight"))
    with pytest.raises(Eagle3Error, match="midlayer.mlp.down_proj.weight"):
        load_draft(out)


def test_unexpected_tensor_is_named(saved):
    _, out = saved
    _rewrite(out, lambda s: s.update({"midlayer.extra.weight": torch.zeros(2)}))
    with pytest.raises(Eagle3Error, match="midlayer.extra.weight"):
        load_draft(out)


def test_shape_mismatch_is_named(saved):
    _, out = saved
    _rewrite(out, lambda s: s.update({"fc.weight": torch.zeros(H, 3 * H)}))
    with pytest.raises(Eagle3Error, match=r"'fc.weight' has shape \(64, 192\)"):
        load_draft(out)


def test_missing_config_field_is_named(saved):
    _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3Error, match="'draft_vocab_size'"):
        load_draft(out)


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors"])
def test_missing_file_is_named(saved, victim):
    _, out = saved
    (out / victim).unlink()
    with pytest.raises(Eagle3Error, match=victim):
        load_draft(out)


def test_truncated_weights_are_a_clear_error(saved):
    _, out = saved
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(Eagle3Error, match="cannot be read"):
        load_draft(out)


def test_embeddings_saved_by_other_exporters_are_used(saved):
    model, out = saved
    _rewrite(out, lambda s: s.update({"embed_tokens.weight": model.embed_tokens.weight.clone()}))
    assert torch.equal(load_draft(out).embed_tokens.weight, model.embed_tokens.weight)


def test_wrong_embedding_shape_is_rejected(saved):
    with pytest.raises(Eagle3Error, match="another target"):
        load_draft(saved[1], embed_weight=torch.zeros(V + 1, H))


def test_last_feature_drafter_round_trips(tmp_path):
    """The EAGLE-2-style ablation (feature "last"): fc is H wide, flagged in config.json."""
    base = make_draft().config
    cfg = make_draft_config(**{**base.to_dict(), "feature": "last"})
    model = Eagle3Draft(cfg)
    assert model.fc.in_features == cfg.target_hidden_size
    save_draft(model, tmp_path, dtype=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["feature"] == "last" and raw["eagle_config"]["use_aux_hidden_state"] is False
    loaded = load_draft(tmp_path, embed_weight=model.embed_tokens.weight)
    assert loaded.config == cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    feats = torch.randn(1, 5, cfg.target_hidden_size)
    with torch.no_grad():
        want = model.ttt_forward(ids, feats, 2)
        got = loaded.ttt_forward(ids, feats, 2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with pytest.raises(Eagle3Error, match="feature"):
        make_draft_config(**{**base.to_dict(), "feature": "middle"})


def test_default_export_is_bf16_and_keeps_vocab_maps(tmp_path):
    model = make_draft()  # fp32
    out = save_draft(model, tmp_path / "default")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
    loaded = load_draft(out, embed_weight=model.embed_tokens.weight)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    assert model.fc.weight.dtype == torch.float32  # the model itself is not cast


@pytest.mark.parametrize("name,want", [("float32", "float32"), ("fp16", "float16")])
def test_export_dtype_by_name(tmp_path, name, want):
    out = save_draft(make_draft(), tmp_path, dtype=name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == want


def test_non_float_export_dtype_is_refused(tmp_path):
    with pytest.raises(Eagle3Error, match="not a float dtype"):
        save_draft(make_draft(), tmp_path, dtype=torch.int8)


@pytest.mark.parametrize("aux", [[4, 3, 1], [1, 3, 3]])
def test_aux_ids_not_strictly_ascending_are_refused(tmp_path, aux):
    model = make_draft()
    model.config.aux_layer_ids = aux
    with pytest.raises(Eagle3Error, match="strictly ascending") as err:
        save_draft(model, tmp_path / "bad")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()  # refused before anything is written


def test_unsorted_aux_ids_in_a_checkpoint_are_refused(saved):
    _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [4, 1, 3]
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3Error, match="strictly ascending"):
        load_config(out)


def test_older_checkpoint_without_the_vllm_key_still_loads(saved):
    model, out = saved
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]  # what checkpoints before the fix carried
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_config(out)[0].aux_layer_ids == [1, 3, 4]
    assert load_draft(out).config == model.config


def test_vllm_style_config_with_only_the_top_level_key_loads(saved):
    _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_config(out)[0].aux_layer_ids == [1, 3, 4]  # vLLM ids [2, 4, 5] - 1


def test_inconsistent_engine_keys_are_refused(saved):
    _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # project ids where vLLM reads them
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3Error, match=r"should be eagle_config's \[1, 3, 4\] \+ 1"):
        load_config(out)


def test_load_can_cast_a_bf16_export_back_to_fp32(tmp_path):
    model = make_draft()
    out = save_draft(model, tmp_path)  # bf16 on disk
    loaded = load_draft(out, embed_weight=model.embed_tokens.weight, dtype=torch.float32)
    assert loaded.fc.weight.dtype == torch.float32 and loaded.d2t.dtype == torch.int64
    assert torch.equal(loaded.fc.weight, model.fc.weight.to(torch.bfloat16).float())


def test_sglang_loader_captures_the_layers_we_trained_on(tiny_llama_dir, tmp_path):
    """Our config.json read the way SGLang reads it, replayed on a real (tiny) target.

    SGLang, as read from its source (sgl-project/sglang, python/sglang/srt/):
    - model_executor/model_runner.py, ModelRunner.__init__ (EAGLE3 branch): the draft's HF
      config via AutoConfig; `eagle_config = getattr(hf_config, "eagle_config", None)`,
      `eagle_config.get("use_aux_hidden_state", True)` and
      `eagle_config["eagle_aux_hidden_state_layer_ids"]` (the top-level key is never read);
    - models/llama.py, LlamaForCausalLM.set_eagle3_layers_to_capture:
      `self.model.layers_to_capture = [val + 1 for val in layer_ids]`;
    - models/llama.py, LlamaModel.forward: before running layer i, `if i in
      self.layers_to_capture: aux_hidden_states.append(hidden_states + residual)`, i.e. the
      residual stream entering layer i = HF hidden_states[i].
    So SGLang must feed the drafter exactly what eagle3.targets.Target.capture gave in training.
    """
    from transformers import AutoConfig

    from eagle3.targets import load_target

    target = load_target(tiny_llama_dir, device="cpu", aux_layer_ids=[0, 3, 6])
    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    cfg = from_target_config(hf, 100, target.aux_layer_ids)
    out = save_draft(Eagle3Draft(cfg), tmp_path / "ckpt")

    draft_config = AutoConfig.from_pretrained(out)  # SGLang's draft_model_config.hf_config
    eagle_config = getattr(draft_config, "eagle_config", None)
    assert eagle_config.get("use_aux_hidden_state", True) is True
    layer_ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
    layers_to_capture = [val + 1 for val in layer_ids]  # set_eagle3_layers_to_capture

    ids = torch.randint(0, hf.vocab_size, (1, 12))
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states  # hs[i]: into layer i
    sglang_features = torch.cat([hs[i] for i in layers_to_capture], dim=-1)
    trained_features, _ = target.capture(ids)
    assert torch.allclose(sglang_features, trained_features, atol=1e-6)
