"""The MLA draft layer (DraftConfig.attention "mla"): its attention equals transformers' own
DeepSeek-V3 attention (an independent implementation of the maths vLLM serves), its TTT unroll
equals incremental decoding, and its checkpoint is vLLM's Eagle3DeepseekV3ForCausalLM layout,
read back exactly; configs vLLM would refuse are refused here first, in one line.
Whole file ~3 s."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.checkpoint import MLA_ARCHITECTURE, load_config, load_draft, save_draft
from eagle3.errors import Eagle3Error
from eagle3.layers import MLAAttention
from eagle3.methods import from_target_config
from eagle3.model import DraftConfig, Eagle3Draft
from tests.eagle3.test_model import check_ttt_equals_decoding

# The miniature's YaRN (scripts/make_tiny_kimi.py) over a tiny original context, so that a few
# positions reach the scaled band; mscale_all_dim != mscale so both mscale terms matter.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}
MLA = dict(
    attention="mla",
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=12,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,  # != qk head dim, as Kimi's 128 vs 192
    rope_theta=50000.0,
)


@pytest.fixture
def mla_config(tiny_config):
    def make(**overrides) -> DraftConfig:
        return tiny_config(**{**MLA, **overrides})

    return make


def _hf_attention(cfg: DraftConfig):
    """transformers' DeepseekV3Attention over the draft's 2H input, its rotary and its scale."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    rope = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale")
        rope = {"rope_type": "yarn", **{k: cfg.rope_scaling[k] for k in keys}}
        rope["mscale_all_dim"] = cfg.rope_scaling["mscale_all_dim"]
    hf = DeepseekV3Config(
        hidden_size=2 * cfg.hidden_size,  # the attention's input width; o_proj padded below
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_parameters={**rope, "rope_theta": cfg.rope_theta},
        max_position_embeddings=64,
        rms_norm_eps=cfg.rms_norm_eps,
        attn_implementation="eager",
    )
    return DeepseekV3Attention(hf, layer_idx=0).eval(), DeepseekV3RotaryEmbedding(hf)


@pytest.mark.parametrize("q_lora", [16, 0], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("rope", [None, YARN], ids=["plain", "yarn"])
def test_mla_draft_attention_equals_transformers_deepseek_v3(rope, q_lora, mla_config):
    cfg = mla_config(rope_scaling=rope, q_lora_rank=q_lora)
    ours = MLAAttention(cfg).eval()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    hf, rotary = _hf_attention(cfg)
    state = {k: v for k, v in ours.state_dict().items() if k != "o_proj.weight"}
    H = cfg.hidden_size
    o_proj = torch.zeros(2 * H, ours.o_proj.weight.shape[1])
    o_proj[:H] = ours.o_proj.weight  # HF's o_proj goes back to its hidden size (2H)
    hf.load_state_dict({**state, "o_proj.weight": o_proj})
    T = 9
    x, pos = torch.randn(2, T, 2 * H), torch.arange(T)[None].expand(2, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x, rotary(x, pos), causal)[0][..., :H]
        q, k, v = ours.qkv(x, pos)
        got = ours.attend(q, k, v, torch.ones(T, T, dtype=torch.bool).tril()[None])
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("rope", [None, YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("impl", ["chunked", "flash", "sdpa", "split"])
def test_mla_draft_ttt_step_equals_incremental_decoding(impl, rope, mla_config):
    """TTT step k at position t is what the drafter computes after k chained steps."""
    model = Eagle3Draft(mla_config(rope_scaling=rope)).eval()
    model.midlayer.self_attn.ttt_impl = impl
    check_ttt_equals_decoding(model)


def test_mla_draft_ttt_gradients_agree_across_kernels(mla_config):
    model = Eagle3Draft(mla_config(rope_scaling=YARN))
    input_ids, aux = torch.randint(0, 50, (2, 6)), torch.randn(2, 6, 96)
    grads = {}
    for impl in ("chunked", "flash", "sdpa"):
        model.zero_grad()
        model.midlayer.self_attn.ttt_impl = impl
        sum(x.square().mean() for x in model.ttt_forward(input_ids, aux, 3)).backward()
        grads[impl] = model.midlayer.self_attn.kv_b_proj.weight.grad.clone()
    for impl in ("chunked", "flash"):
        assert torch.allclose(grads["sdpa"], grads[impl], atol=1e-5)


def test_mla_draft_checkpoint_is_vllms_layout_and_round_trips(mla_config, tmp_path):
    model = Eagle3Draft(mla_config(rope_scaling=YARN)).eval()
    save_draft(model, tmp_path, dtype=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == [MLA_ARCHITECTURE] and raw["model_type"] == "deepseek_v2"
    assert (raw["num_hidden_layers"], raw["n_routed_experts"]) == (1, 1)
    assert (raw["q_lora_rank"], raw["kv_lora_rank"], raw["v_head_dim"]) == (16, 16, 6)
    assert not any(raw[s] for s in ("norm_before_residual", "fc_norm", "norm_output"))  # eagle3
    assert "head_dim" not in raw  # vLLM sizes MLA from the qk / v dims
    assert "attention_factor" not in raw["rope_scaling"]  # 1.0 would turn off vLLM's mscale^2
    assert raw["rope_scaling"]["mscale_all_dim"] == 0.5
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's convention
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    attn = {n.removeprefix("midlayer.self_attn.") for n in names if ".self_attn." in n}
    assert attn == {
        f"{m}.weight"
        for m in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")
        + ("kv_a_layernorm", "kv_b_proj", "o_proj")
    }
    check_round_trip(model, tmp_path)


def check_round_trip(model: Eagle3Draft, ckpt) -> None:
    """The checkpoint at ckpt (saved with dtype=None) loads back to the same config and the
    same TTT logits, bit for bit."""
    back = load_draft(ckpt, embed_weight=model.embed_tokens.weight)
    assert back.config == model.config
    ids, aux = torch.randint(0, 50, (1, 7)), torch.randn(1, 7, 96)
    with torch.no_grad():
        for a, b in zip(model.ttt_forward(ids, aux, 2), back.ttt_forward(ids, aux, 2)):
            assert torch.equal(a, b)


def test_gqa_checkpoint_has_no_mla_keys(tiny_config, tmp_path):
    save_draft(Eagle3Draft(tiny_config()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "llama" and "kv_lora_rank" not in raw and "attention" not in raw
    assert load_config(tmp_path)[0].attention == "gqa"


@pytest.mark.parametrize(
    "edit, expected",
    [
        ({"model_type": "deepseek_v3"}, "MTP"),
        ({"n_routed_experts": None}, "n_routed_experts"),
        ({"norm_before_residual": True}, "norm_before_residual is on"),
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"kv_lora_rank": None}, "MLA dims"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "YaRN"),
    ],
    ids=[
        "deepseek_v3",
        "experts-null",
        "norm-before-residual",
        "two-layers",
        "no-kv-lora",
        "linear-rope",
    ],
)
def test_mla_draft_checkpoint_vllm_would_refuse_is_one_line_error(
    mla_config, tmp_path, edit, expected
):
    save_draft(Eagle3Draft(mla_config()), tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(Eagle3Error) as err:
        load_draft(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_mla_draft_from_an_mla_target_takes_its_dims():
    from tests.conftest import tiny_deepseek_config

    cfg = from_target_config(tiny_deepseek_config(), 40, [1, 3, 5], attention="mla")
    assert (cfg.attention, cfg.num_attention_heads, cfg.num_key_value_heads) == ("mla", 4, 4)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim) == (32, 16, 16)
    assert cfg.head_dim == 16 + 8
    small = from_target_config(
        tiny_deepseek_config(), 40, [1, 3, 5], attention="mla", kv_lora_rank=8, q_lora_rank=0
    )
    assert (small.kv_lora_rank, small.q_lora_rank) == (8, 0)


def test_mla_draft_for_a_target_without_mla_is_one_line_error():
    from tests.conftest import tiny_llama_config

    with pytest.raises(Eagle3Error, match="no MLA attention to copy"):
        from_target_config(tiny_llama_config(), 40, [0, 1, 2], attention="mla")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"num_key_value_heads": 2}, "one latent KV"),
        ({"head_dim": 16}, "head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"rope_scaling": {**YARN, "mscale": None, "mscale_all_dim": None}}, None),
    ],
    ids=["gqa-heads", "head-dim", "no-latent", "plain-yarn-ok"],
)
def test_mla_draft_config_errors_are_one_line(mla_config, overrides, expected):
    overrides = {
        k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
        for k, v in overrides.items()
    }
    if expected is None:
        mla_config(**overrides)
        return
    with pytest.raises(Eagle3Error, match=expected) as err:
        mla_config(**overrides)
    assert "\n" not in str(err.value)


def test_mla_draft_latent_vllm_cpu_refuses_is_one_line_error(mla_config, tmp_path):
    """kv_lora_rank 16 + rope 4 = 20: vLLM-CPU's MLA kernels take 320 / 512 / 576 only."""
    from eagle3.engine.choice import check_draft_servable

    save_draft(Eagle3Draft(mla_config()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    check_draft_servable(raw, cpu_build=False, target_mla=True)  # a GPU build decides for itself
    with pytest.raises(Eagle3Error, match="320, 512, 576") as err:
        check_draft_servable(raw, cpu_build=True, target_mla=True)
    assert "\n" not in str(err.value)
    check_draft_servable(
        {**raw, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, cpu_build=True, target_mla=True
    )


def test_gqa_draft_next_to_an_mla_target_on_vllm_cpu_is_one_line_error(tiny_config, tmp_path):
    """vLLM-CPU: "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"."""
    from eagle3.engine.choice import check_draft_servable

    save_draft(Eagle3Draft(tiny_config()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    check_draft_servable(raw, cpu_build=True, target_mla=False)  # a Llama target: fine
    check_draft_servable(raw, cpu_build=False, target_mla=True)  # GPU backends: not refused
    with pytest.raises(Eagle3Error, match="model.draft.attention: mla") as err:
        check_draft_servable(raw, cpu_build=True, target_mla=True)
    assert "\n" not in str(err.value)
