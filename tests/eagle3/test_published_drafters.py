"""Published drafters load as published (eagle3.published): miniatures of their layouts.

Each miniature is written here with exactly the config keys and tensor names of its source,
at scaled-down shapes (hidden 64, a 256-token target of 8 layers, MLA dims of a few dozen):
- "torchspec-llama": lightseekorg/kimi-k2.5-eagle3 as TorchSpec's kimi_k25_eagle3.json and
  convert_to_hf.py write it (no draft_vocab_size / target_hidden_size / eagle_config, YaRN,
  embed_tokens inside, the whole vocab, no d2t/t2d), in one file or save_pretrained shards;
- "torchspec-mla" / "torchspec-mla-vllm": lightseekorg/kimi-k2.5-eagle3-mla as
  kimi_k25_eagle3_mla.json and kimi_k3_eagle3_mla.json (kimi_k2, mla_use_nope true,
  eagle_config switches) with a reduced vocab (draft_vocab_size, d2t, no t2d), as `midlayer.*`
  or as the `--vllm` export (`layers.0.*`, aux ids + 1);
- "speculators": vLLM's trainer (Eagle3DraftModel, speculators_config,
  transformer_layer_config, top-level aux ids in vLLM's convention, layers.0.*, d2t/t2d).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eagle3.checkpoint import load_config, load_draft, save_draft
from eagle3.errors import Eagle3Error
from eagle3.published import read_tensors, vocab_offsets
from eagle3.vocab import build_draft_vocab, carry_rows, revocab_summary, vocab_from_d2t

H, V, L = 64, 256, 8  # draft/target hidden, target vocab, target layers
VD = 32  # a reduced draft vocab (32,000 of 163,840 scaled down)
PROJECT_AUX = [1, 3, 4]  # what every miniature below means: output of decoder layers 1, 3, 4
LLAMA_LAYER = {  # GQA layer tensor names -> shapes (heads 4 x 16, kv heads 4: TorchSpec's)
    "input_layernorm.weight": (H,),
    "hidden_norm.weight": (H,),
    "self_attn.q_proj.weight": (64, 2 * H),
    "self_attn.k_proj.weight": (64, 2 * H),
    "self_attn.v_proj.weight": (64, 2 * H),
    "self_attn.o_proj.weight": (H, 64),
    "post_attention_layernorm.weight": (H,),
    "mlp.gate_proj.weight": (96, H),
    "mlp.up_proj.weight": (96, H),
    "mlp.down_proj.weight": (H, 96),
}
MLA_LAYER = {  # heads 4, q_lora 32, kv_lora 16, nope 16 + rope 8, v 16
    "input_layernorm.weight": (H,),
    "hidden_norm.weight": (H,),
    "self_attn.q_a_proj.weight": (32, 2 * H),
    "self_attn.q_a_layernorm.weight": (32,),
    "self_attn.q_b_proj.weight": (4 * 24, 32),
    "self_attn.kv_a_proj_with_mqa.weight": (16 + 8, 2 * H),
    "self_attn.kv_a_layernorm.weight": (16,),
    "self_attn.kv_b_proj.weight": (4 * (16 + 16), 16),
    "self_attn.o_proj.weight": (H, 4 * 16),
    "post_attention_layernorm.weight": (H,),
    "mlp.gate_proj.weight": (96, H),
    "mlp.up_proj.weight": (96, H),
    "mlp.down_proj.weight": (H, 96),
}
YARN = {  # TorchSpec's rope_scaling keys ("type", DeepSeek's mscale terms)
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 64.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
    "type": "yarn",
}


def torchspec_llama_config() -> dict:
    """configs/draft_models/kimi_k25_eagle3.json's keys, scaled down."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 250,
        "eos_token_id": 251,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "max_window_layers": 36,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(YARN),
        "rope_theta": 50000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }


def torchspec_mla_config(aux: list[int]) -> dict:
    """configs/draft_models/kimi_k25_eagle3_mla.json's keys, scaled down, as convert_to_hf.py
    exports it with --prune-vocab (draft_vocab_size, torch_dtype, _torchspec_version)."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": H,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,  # kimi_k3_eagle3_mla.json's; inert (eagle3.published)
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "torch_dtype": "bfloat16",
        "rope_theta": 50000.0,
        "rope_scaling": {**YARN, "beta_fast": 1.0},
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux,
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        },
        "bos_token_id": 250,
        "eos_token_id": 251,
        "pad_token_id": 0,
        "_torchspec_version": "0.1.0",
    }


def speculators_config(**switches) -> dict:
    """Eagle3DraftModel.save_pretrained's config.json (speculators 0.9), scaled down: the
    layer config is transformers' diff against LlamaConfig's defaults."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": H,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "num_hidden_layers": 1,
            "vocab_size": V,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": VD,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in PROJECT_AUX],  # vLLM's
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]},
        },
        "dtype": "float32",
        "transformers_version": "5.0.0",
        **switches,
    }


def _weights(layer: dict, prefix: str, vocab_rows: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 3 * H),
        **{prefix + k: s for k, s in layer.items()},
        "norm.weight": (H,),
        "lm_head.weight": (vocab_rows, H),
    }
    return {
        k: (0.1 * torch.randn(s, generator=g) + (k.endswith("norm.weight"))).to(dtype)
        for k, s in shapes.items()
    }


def reduced_vocab() -> tuple[torch.Tensor, torch.Tensor]:
    vocab = build_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(1)), VD)
    return vocab.d2t, vocab.t2d


def write(path: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    """config.json + model.safetensors, or save_pretrained's shards and index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return path


def make_layout(tmp_path: Path, layout: str) -> tuple[Path, dict]:
    """-> (the miniature's directory, its raw tensors)."""
    if layout in ("torchspec-llama", "torchspec-llama-sharded"):
        tensors = _weights(LLAMA_LAYER, "midlayer.", V, torch.bfloat16)
        config = torchspec_llama_config()
    elif layout in ("torchspec-mla", "torchspec-mla-vllm"):
        vllm = layout.endswith("vllm")  # convert_to_hf.py --vllm: layers.0.*, kimi_k2 ids + 1
        tensors = _weights(MLA_LAYER, "layers.0." if vllm else "midlayer.", VD, torch.bfloat16)
        tensors["d2t"] = reduced_vocab()[0]  # TorchSpec's vLLM export: no t2d
        config = torchspec_mla_config([i + vllm for i in PROJECT_AUX])
    elif layout == "speculators":
        tensors = _weights(LLAMA_LAYER, "layers.0.", VD, torch.float32)
        tensors["d2t"], tensors["t2d"] = reduced_vocab()
        config = speculators_config()
    else:
        raise ValueError(layout)
    shards = 2 if layout.endswith("sharded") else 1
    return write(tmp_path / layout, config, tensors, shards), tensors


LAYOUTS = [
    "torchspec-llama",
    "torchspec-llama-sharded",
    "torchspec-mla",
    "torchspec-mla-vllm",
    "speculators",
]


def our_name(name: str) -> str:
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layout_lands_in_the_right_parameters(tmp_path, layout):
    """~0.1 s each (the speculators one ~3 s more the first time: it imports transformers for
    LlamaConfig's defaults). Every published tensor lands in the parameter of our name (layers.0. ->
    midlayer.), embeddings from the file, aux ids in our convention (vLLM's minus 1 where the
    export added 1), the d2t mapping (identity for the whole vocab), and fc / norm / lm_head
    computed from the raw tensors give the loaded draft's projection and logits."""
    ckpt, raw = make_layout(tmp_path, layout)
    draft = load_draft(ckpt, target_layers=L)
    cfg = draft.config
    assert cfg.aux_layer_ids == PROJECT_AUX
    assert cfg.attention == ("mla" if "mla" in layout else "gqa")
    assert cfg.target_hidden_size == H and cfg.vocab_size == V
    state = draft.state_dict()
    for name, tensor in raw.items():
        if name not in ("d2t", "t2d"):
            assert torch.equal(state[our_name(name)].to(tensor.dtype), tensor), name
    full = layout.startswith("torchspec-llama")
    assert cfg.draft_vocab_size == (V if full else VD)
    want_d2t = torch.zeros(V, dtype=torch.long) if full else reduced_vocab()[0]
    assert torch.equal(draft.d2t, want_d2t)
    assert torch.equal(draft.t2d, vocab_from_d2t(want_d2t, V).t2d)
    assert torch.equal(vocab_offsets(ckpt), want_d2t)  # what train.run_vocab reads for init_from
    if "llama" in layout:  # TorchSpec's own rope, read from its config
        assert cfg.rope_theta == 50000.0 and cfg.rope_scaling["rope_type"] == "yarn"
        assert cfg.rope_scaling["factor"] == 64.0
    aux, h = torch.randn(2, 5, 3 * H), torch.randn(2, 5, H)
    f32 = {k: v.float() for k, v in raw.items()}
    with torch.no_grad():
        assert torch.allclose(
            draft.project(aux.to(draft.fc.weight.dtype)).float(),
            aux @ f32["fc.weight"].T,
            atol=0.05,
        )
        logits = rms(h, f32["norm.weight"], cfg.rms_norm_eps) @ f32["lm_head.weight"].T
        got = draft.float().compute_logits(h)
        assert torch.allclose(got, logits, atol=1e-4)
        best = got.argmax(-1)
        assert torch.equal(draft.draft_to_target(best), best + want_d2t[best])


def reference_logits(raw: dict, cfg, token: int, h: torch.Tensor) -> torch.Tensor:
    """The draft layer's logits for one token at position 0, from the raw tensors alone: one
    key, so attention returns its value (rotary at 0 only scales q and k), per head."""
    w = {our_name(k): v.float() for k, v in raw.items()}
    eps = cfg.rms_norm_eps
    x = torch.cat(
        [
            rms(w["embed_tokens.weight"][token], w["midlayer.input_layernorm.weight"], eps),
            rms(h, w["midlayer.hidden_norm.weight"], eps),
        ]
    )
    if cfg.attention == "mla":  # values from the latent: kv_b_proj(kv_a_layernorm(c_kv))
        c_kv = (w["midlayer.self_attn.kv_a_proj_with_mqa.weight"] @ x)[: cfg.kv_lora_rank]
        kv = w["midlayer.self_attn.kv_b_proj.weight"] @ rms(
            c_kv, w["midlayer.self_attn.kv_a_layernorm.weight"], eps
        )
        heads = kv.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        value = heads[:, cfg.qk_nope_head_dim :].reshape(-1)
    else:  # as many KV heads as heads in these miniatures
        value = w["midlayer.self_attn.v_proj.weight"] @ x
    out = h + w["midlayer.self_attn.o_proj.weight"] @ value
    y = rms(out, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = w["midlayer.mlp.gate_proj.weight"] @ y, w["midlayer.mlp.up_proj.weight"] @ y
    out = out + w["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
    return w["lm_head.weight"] @ rms(out, w["norm.weight"], eps)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_step_forward_equals_the_raw_tensors_computation(tmp_path, layout):
    """~0.2 s each. The loaded draft's logits for one token at position 0 equal the same layer
    computed from the published file's tensors by their names (attention reduces to the value
    path there): the wiring of every layer tensor, not only that it is loaded."""
    ckpt, raw = make_layout(tmp_path, layout)
    draft = load_draft(ckpt, target_layers=L, dtype=torch.float32)
    h = torch.randn(H)
    with torch.no_grad():
        _, logits, _ = draft(
            torch.tensor([[7]]), h[None, None], torch.zeros(1, 1, dtype=torch.long)
        )
    assert torch.allclose(logits[0, 0], reference_logits(raw, draft.config, 7, h), atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reexport_writes_our_format_and_round_trips(tmp_path, layout):
    """~0.4 s each. A loaded published draft saved again is this project's format (our
    architecture and model_type, aux ids for both engines, no embeddings, d2t only for a reduced
    vocab: vLLM refuses one beside a full lm_head) and reloads to the same weights and the same
    TTT logits."""
    ckpt, raw = make_layout(tmp_path, layout)
    target_embed = raw["embed_tokens.weight"].float()  # the file's are the target's here
    draft = load_draft(ckpt, embed_weight=target_embed, target_layers=L, dtype=torch.float32)
    assert not draft.config.own_embeddings
    out = save_draft(draft, tmp_path / "ours", dtype=None)
    config = json.loads((out / "config.json").read_text())
    mla = "mla" in layout
    assert config["architectures"] == (
        ["Eagle3DeepseekV3ForCausalLM"] if mla else ["LlamaForCausalLMEagle3"]
    )
    assert config["model_type"] == ("deepseek_v2" if mla else "llama")
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == PROJECT_AUX
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in PROJECT_AUX]
    names = set(read_tensors(out))
    assert "embed_tokens.weight" not in names and not any(n.startswith("layers.") for n in names)
    full = layout.startswith("torchspec-llama")
    assert ("d2t" in names) == ("t2d" in names) == (not full)
    again = load_draft(out, embed_weight=draft.embed_tokens.weight)  # no target_layers needed
    assert_same_drafter(again, draft)


def assert_same_drafter(again, draft) -> None:
    """The same config, weights and TTT logits."""
    assert again.config == draft.config
    for key, value in draft.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    ids, aux = torch.randint(0, V, (1, 7)), torch.randn(1, 7, 3 * H)
    with torch.no_grad():
        for a, b in zip(draft.ttt_forward(ids, aux, 2), again.ttt_forward(ids, aux, 2)):
            assert torch.equal(a, b)


def test_file_embeddings_equal_to_the_targets_are_the_targets(tmp_path):
    """~0.1 s. A published file's embed_tokens equal to the target's (up to bf16) are the
    target's: as vLLM shares them, the draft is not marked as having its own and the export
    carries none (our exports stay as they were)."""
    ckpt, raw = make_layout(tmp_path, "torchspec-llama")
    target = raw["embed_tokens.weight"].float() * (1 + 1e-4)  # a bf16 rounding away
    draft = load_draft(ckpt, embed_weight=target, target_layers=L, dtype=torch.float32)
    assert not draft.config.own_embeddings
    assert torch.equal(draft.embed_tokens.weight, target)  # the target's, unrounded
    out = save_draft(draft, tmp_path / "ours")
    assert "embed_tokens.weight" not in read_tensors(out)


@pytest.mark.parametrize("layout", ["torchspec-mla-vllm", "torchspec-llama", "speculators"])
def test_own_embeddings_are_kept_exported_and_reload_to_the_same_function(tmp_path, layout):
    """< 0.1 s each. Embeddings that differ from the target's are the drafter's own, as vLLM
    serves them: kept (frozen), exported as embed_tokens.weight, and the export reloaded beside
    the same target is the same drafter (same config, weights and TTT logits); installing the
    target's over them is refused. speculators' embed_requires_grad (trained embeddings) loads
    the same way."""
    ckpt, raw = make_layout(tmp_path, layout)
    if layout == "speculators":
        write(ckpt, speculators_config(embed_requires_grad=True), raw)
    target = torch.randn(V, H)
    draft = load_draft(ckpt, embed_weight=target, target_layers=L, dtype=torch.float32)
    assert draft.config.own_embeddings and not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.embed_tokens.weight, raw["embed_tokens.weight"].float())
    out = save_draft(draft, tmp_path / "ours", dtype=None)
    assert "own_embeddings" not in json.loads((out / "config.json").read_text())
    assert torch.equal(read_tensors(out)["embed_tokens.weight"], draft.embed_tokens.weight)
    again = load_draft(out, embed_weight=target)
    assert_same_drafter(again, draft)
    with pytest.raises(Eagle3Error, match="has its own embed_tokens"):
        draft.set_embeddings(target)


def test_embeddings_that_cannot_be_reconciled_are_refused_in_one_line(tmp_path):
    """~0.1 s. A file's embed_tokens of another shape than its config's, or a target whose
    embeddings are of another shape than the drafter's own: one line each, exit 2."""
    ckpt, raw = make_layout(tmp_path, "torchspec-mla")
    with pytest.raises(Eagle3Error) as err:
        load_draft(ckpt, embed_weight=torch.randn(V + 64, H), target_layers=L)
    line = str(err.value)
    assert "built for another target" in line and "\n" not in line and err.value.exit_code == 2
    config = json.loads((ckpt / "config.json").read_text())
    write(ckpt, config, {**raw, "embed_tokens.weight": raw["embed_tokens.weight"][:-1]})
    with pytest.raises(Eagle3Error) as err:
        load_draft(ckpt, embed_weight=torch.randn(V, H), target_layers=L)
    line = str(err.value)
    assert "embed_tokens.weight has shape" in line and "\n" not in line


@pytest.mark.parametrize("nope", [True, False])
def test_mla_use_nope_is_inert_as_in_torchspec_and_vllm(tmp_path, nope):
    """~0.1 s each. mla_use_nope, either value, loads the same drafter (TorchSpec's draft layer
    applies its rope whatever it says; vLLM's deepseek_eagle3 never reads it) and our
    re-export does not write it."""
    ckpt, raw = make_layout(tmp_path, "torchspec-mla-vllm")
    config = json.loads((ckpt / "config.json").read_text())
    write(ckpt, {**config, "mla_use_nope": nope}, raw)
    cfg, projected = load_config(ckpt, target_layers=L)
    assert "mla_use_nope" not in projected and cfg.attention == "mla"
    assert cfg.qk_rope_head_dim == 8 and cfg.rope_scaling["rope_type"] == "yarn"


def test_speculators_eagle3_1_switches_load_as_eagle3_1(tmp_path):
    """~0.3 s. speculators' fc_norm + norm_output (EAGLE-3.1) become our method eagle3.1 with
    the fc_norm.{0,1,2} weights in place."""
    ckpt, raw = make_layout(tmp_path, "speculators")
    config = speculators_config(fc_norm=True, norm_output=True)
    raw = {**raw, **{f"fc_norm.{i}.weight": torch.rand(H) + 0.5 for i in range(3)}}
    write(ckpt, config, raw)
    draft = load_draft(ckpt, target_layers=L)
    assert draft.config.method == "eagle3.1"
    assert torch.equal(draft.fc_norm[2].weight, raw["fc_norm.2.weight"])


def _edit(config: dict, path: str, value) -> None:
    *parents, key = path.split(".")
    for part in parents:
        config = config[part]
    config[key] = value


@pytest.mark.parametrize(
    "layout, key, value",
    [
        ("torchspec-mla", "eagle_config.use_mtp_layernorm", True),
        ("torchspec-mla", "eagle_config.use_input_layernorm_in_first_layer", False),
        ("torchspec-mla", "eagle_config.use_last_layernorm", False),
        ("torchspec-mla", "eagle_config.use_aux_hidden_state", False),
        ("torchspec-mla", "model_type", "deepseek_v3"),  # vLLM makes it an MTP model
        ("torchspec-llama", "attention_bias", True),
        ("speculators", "norm_before_fc", True),
        ("speculators", "norm_before_residual", True),
        ("speculators", "transformer_layer_config.model_type", "qwen3"),
        ("speculators", "transformer_layer_config.num_hidden_layers", 2),
        ("speculators", "speculators_model_type", "dflash"),
    ],
)
def test_a_switch_read_as_other_maths_is_refused_in_one_line(tmp_path, layout, key, value):
    """~0.1 s each. A layout whose key says another function than our layer computes is refused
    in one line naming that key, before any weight is read."""
    ckpt, _ = make_layout(tmp_path, layout)
    config = json.loads((ckpt / "config.json").read_text())
    _edit(config, key, value)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3Error) as err:
        load_config(ckpt, target_layers=L)
    assert key.split(".")[-1] in str(err.value) and "\n" not in str(err.value)


def test_ambiguous_or_missing_aux_ids_and_vocab_mapping_are_refused(tmp_path):
    """~0.2 s. One line each: eagle_config ids beside layers.0.* of a non-kimi_k2 draft (which
    convention?) or disagreeing with vLLM's top-level key, no ids without the target's layer
    count, a reduced vocab without d2t."""
    ckpt, raw = make_layout(tmp_path, "torchspec-llama")
    config = torchspec_llama_config()
    with pytest.raises(Eagle3Error, match="eagle_aux_hidden_state_layer_ids.*target"):
        load_config(ckpt)  # the engines' default depends on the target's layer count
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": PROJECT_AUX}
    write(ckpt, config, {our_name(k).replace("midlayer.", "layers.0."): v for k, v in raw.items()})
    with pytest.raises(Eagle3Error, match="eagle_config.eagle_aux_hidden_state_layer_ids"):
        load_config(ckpt, target_layers=L)
    config["eagle_aux_hidden_state_layer_ids"] = PROJECT_AUX  # vLLM's key, naming other layers
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3Error, match="name different layers"):
        load_config(ckpt, target_layers=L)
    mla, raw = make_layout(tmp_path, "torchspec-mla")
    write(
        mla,
        json.loads((mla / "config.json").read_text()),
        {k: v for k, v in raw.items() if k != "d2t"},
    )
    with pytest.raises(Eagle3Error, match="no d2t but a reduced draft vocab"):
        load_draft(mla, target_layers=L)
    with pytest.raises(Eagle3Error, match="no d2t"):
        vocab_offsets(mla)


def test_evaluate_loads_a_published_drafter_with_its_target(tmp_path):
    """~0.3 s. eagle3.evaluate's --draft path (measure.check_drafter + load_drafter) takes a
    published miniature: the target's layer count gives the default aux layers; it decodes on
    the target's embeddings where the file's equal them, else on the file's own (what vLLM
    serves from the same directory)."""
    from eagle3.decoding.decode_config import DecodeConfig
    from eagle3.evaluation.measure import check_drafter, load_drafter

    ckpt, raw = make_layout(tmp_path, "torchspec-llama")
    embed = raw["embed_tokens.weight"].float() * (1 + 1e-4)  # the file's, a bf16 rounding away
    target = SimpleNamespace(
        name="tiny",
        vocab_size=V,
        hidden_size=H,
        num_layers=L,
        embed_weight=embed,
        device=torch.device("cpu"),
        model=SimpleNamespace(dtype=torch.float32),
    )
    check_drafter(str(ckpt), target)
    drafter = load_drafter(str(ckpt), target, DecodeConfig(steps=3))
    draft = drafter.draft
    assert draft.config.aux_layer_ids == PROJECT_AUX
    assert torch.equal(draft.embed_tokens.weight, embed)  # the target's, unrounded
    assert torch.equal(draft.fc.weight, raw["fc.weight"].float())
    target.embed_weight = torch.randn(V, H)  # other embeddings: the drafter keeps its own
    own = load_drafter(str(ckpt), target, DecodeConfig(steps=3)).draft
    assert own.config.own_embeddings
    assert torch.equal(own.embed_tokens.weight, raw["embed_tokens.weight"].float())


def test_revocab_carries_shared_rows_and_says_what_it_covers():
    """~0.01 s. carry_rows keeps the old lm_head row of every token in both vocabs and takes
    the fresh row elsewhere; the summary line gives the new vocab's coverage of the data and of
    the old vocab."""
    old = vocab_from_d2t(torch.tensor([2, 2, 3, 5]), 16)  # target ids 2, 3, 5, 8
    new = vocab_from_d2t(torch.tensor([3, 4, 4]), 16)  # target ids 3, 5, 6
    weight = torch.arange(4.0)[:, None].expand(4, 2)
    fresh = torch.full((3, 2), -1.0)
    rows = carry_rows(weight, old.draft_ids, new.draft_ids, fresh)
    assert rows[:, 0].tolist() == [1.0, 2.0, -1.0]  # 3 and 5 carried, 6 fresh
    counts = torch.zeros(16, dtype=torch.long)
    counts[[3, 5, 6, 9]] = torch.tensor([5, 3, 1, 1])
    line = revocab_summary(counts, new, old)
    assert "3 tokens cover 90.0%" in line and "covered 80.0%" in line
    assert "2 of them are in the start's vocab (50.0% of it)" in line and "\n" not in line
