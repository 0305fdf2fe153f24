"""Kimi-K2.5 in miniature: scripts/make_tiny_kimi.py writes a random checkpoint in the real
layout (kimi_k25 wrapper, Kimi's tensor names, INT4 experts packed by compressed-tensors) and
load_target loads it the way it loads the real one. The miniature is the session's
(tests/conftest.py, kimi_miniature): ~30 s to build, paid by the first test on a worker that
needs it; each test's cost below is its own after that build."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from eagle3 import targets as target_mod
from eagle3.compute import matmul_dtype
from eagle3.errors import Eagle3Error
from eagle3.targets import load_target, resolve

REPO = Path(__file__).resolve().parents[2]
MISSING = {  # what the miniature needs -> the skip reason when it is not installed
    "compressed_tensors": "needs compressed-tensors (pip install -e '.[kimi]'; install.sh has it)",
    "tiktoken": "the miniature's tokenizer is remote code over tiktoken (pip install -e '.[dev]')",
}


@pytest.fixture(scope="module")
def kimi_dirs(request) -> tuple[Path, Path]:
    """(INT4 miniature, its de-quantised bf16 copy): the session's (tests/conftest.py)."""
    for module, reason in MISSING.items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(reason)
    return request.getfixturevalue("kimi_miniature")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("cannot load target"), message
    return message


@pytest.mark.slow
def test_miniature_has_kimis_config_and_files(kimi_dirs):
    """The miniature's config, quantization config, preprocessor config and remote-code tokenizer
    (with its chat template) are Kimi-K2.5's layout: what every other Kimi test relies on for it to
    stand in for the real checkpoint. Costs < 0.1 s after the miniature's build (module docstring);
    slow for that build."""
    int4, plain = kimi_dirs
    config = json.loads((int4 / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    text = config["text_config"]
    assert config["tie_word_embeddings"] is False and text["tie_word_embeddings"] is False
    assert text["model_type"] == "deepseek_v3"
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576  # the MLA size vLLM takes
    assert text["first_k_dense_replace"] == 1 and text["n_shared_experts"] == 1
    assert text["n_routed_experts"] > text["num_experts_per_tok"] > 1
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert text["rope_parameters"]["rope_type"] == "yarn"
    assert config["vision_config"]["model_type"] == "kimi_k25_vision"

    q = config["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == (
        "compressed-tensors",
        "pack-quantized",
        "compressed",
    )
    weights = q["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["strategy"]) == (4, "int", "group")
    assert weights["group_size"] == 32 and weights["symmetric"] is True
    assert {"re:.*vision_tower.*", "re:.*mm_projector.*", "re:.*self_attn.*"} <= set(q["ignore"])
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())

    media = json.loads((int4 / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert media["patch_size"] == 14 and media["merge_kernel_size"] == 2

    from eagle3.targets import load_tokenizer

    tok = load_tokenizer(int4)  # the remote code, as vLLM loads it (without, it is another class)
    for token in ("<|media_begin|>", "<|media_pad|>", "<|kimi_k25_video_placeholder|>"):
        assert tok.convert_tokens_to_ids(token) != tok.unk_token_id
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|media_pad|>")
    assert text["vocab_size"] >= len(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")


@pytest.mark.slow
def test_the_miniature_directory_is_the_registry_target(kimi_dirs):
    """Laid out like the download, the miniature resolves to kimi-k2.5 (its trust flags and chat
    rules) at its own sizes: shards and recipes then name the same target. Costs < 0.1 s after the
    miniature's build (module docstring); slow for that build."""
    for path in kimi_dirs:
        t = resolve(path)
        assert (t.name, t.hf_dir, t.tokenizer_remote_code) == ("kimi-k2.5", str(path), True)
        assert t.spec["num_layers"] == 8 and "aux_layer_ids" not in t.spec


def test_the_whole_miniature_loads_kimis_remote_tokenizer_and_refuses_any_other(kimi_dirs):
    """~0.1 s (after the module's miniature). The whole directory (config.json, tiktoken.model,
    tokenization_kimi.py), as the project and vLLM load it: load_tokenizer gives the registry's
    remote-code TikTokenTokenizer. Without remote code transformers 5 does not refuse: it
    converts tiktoken.model into a class of its own, which splits whitespace runs otherwise
    (other ids, another fingerprint). That tokenizer is refused in one line (exit 2), and shards
    made with the remote code are refused by it."""
    from transformers import AutoTokenizer

    from eagle3.targets import (
        check_fingerprint,
        check_tokenizer_class,
        load_tokenizer,
        tokenizer_fingerprint,
    )

    int4 = kimi_dirs[0]
    assert {"config.json", "tiktoken.model", "tokenization_kimi.py"} <= {
        p.name for p in int4.iterdir()
    }
    model = resolve(int4)
    assert model.spec["tokenizer_class"] == "TikTokenTokenizer"
    remote = load_tokenizer(model)
    assert type(remote).__name__ == "TikTokenTokenizer"
    native = AutoTokenizer.from_pretrained(int4, trust_remote_code=False)
    assert type(native).__name__ != "TikTokenTokenizer"
    text = "def f(x):\n    return x*2"
    assert native.encode(text, add_special_tokens=False) != remote.encode(
        text, add_special_tokens=False
    )
    assert tokenizer_fingerprint(native) != tokenizer_fingerprint(remote)
    with pytest.raises(Eagle3Error) as err:
        check_tokenizer_class(native, model)
    line = str(err.value)
    assert "\n" not in line and err.value.exit_code == 2
    assert f"is a {type(native).__name__}, not the registry's TikTokenTokenizer" in line
    with pytest.raises(Eagle3Error, match="were tokenized by another tokenizer"):
        check_fingerprint(tokenizer_fingerprint(remote), native, "shards S", "re-capture them")


def test_tensor_names_are_kimis(kimi_dirs):
    names = set(_tensors(kimi_dirs[1]))
    prefixes = ("language_model.model.", "vision_tower.", "mm_projector.")
    assert all(n.startswith(prefixes) or n == "language_model.lm_head.weight" for n in names)
    assert "language_model.lm_head.weight" in names  # untied
    assert "language_model.model.embed_tokens.weight" in names
    assert not any(".blocks." in n for n in names if n.startswith("language_model."))
    for kimi_name in (
        "language_model.model.layers.0.mlp.gate_proj.weight",  # dense first layer
        "language_model.model.layers.1.mlp.gate.weight",  # router
        "language_model.model.layers.1.mlp.gate.e_score_correction_bias",  # noaux_tc
        "language_model.model.layers.1.mlp.shared_experts.down_proj.weight",
        "language_model.model.layers.1.mlp.experts.7.up_proj.weight",  # one Linear per expert
        "language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "vision_tower.encoder.blocks.0.norm0.weight",
        "vision_tower.encoder.blocks.0.mlp.fc0.weight",
        "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.pre_norm.weight",
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.weight",
    ):
        assert kimi_name in names, kimi_name
    # every tensor lands in the transformers model: nothing missing, unexpected or renamed wrong
    from transformers import AutoModelForImageTextToText

    for path in kimi_dirs:
        _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info


@pytest.mark.slow
def test_int4_experts_are_packed(kimi_dirs):
    """Every expert of the INT4 copy is stored in compressed-tensors' pack-quantized format (8
    nibbles an int32, offset 8, a bf16 scale per group of 32) and unpacks exactly to the
    de-quantised copy's bf16 weights, and every other tensor is the same in both: the two copies
    hold one model. Costs ~0.05 s after the miniature's build (module docstring)."""
    packed, plain = (_tensors(p) for p in kimi_dirs)
    experts = sorted(
        n.removesuffix(".weight")
        for n in plain
        if ".mlp.experts." in n and n.endswith("_proj.weight")
    )
    text = json.loads((kimi_dirs[0] / "config.json").read_text())["text_config"]
    moe_layers = text["num_hidden_layers"] - text["first_k_dense_replace"]
    assert len(experts) == moe_layers * text["n_routed_experts"] * 3  # x gate/up/down
    for name in experts:
        assert f"{name}.weight" not in packed
        w = plain[f"{name}.weight"]
        out, inp = w.shape
        q, scale = packed[f"{name}.weight_packed"], packed[f"{name}.weight_scale"]
        assert q.dtype == torch.int32 and q.shape == (out, inp // 8)
        assert scale.dtype == torch.bfloat16 and scale.shape == (out, inp // 32)
        assert packed[f"{name}.weight_shape"].tolist() == [out, inp]
        # eight signed 4-bit values per int32, lowest nibble first, stored with offset 8
        nibbles = (q[..., None] >> (4 * torch.arange(8))) & 0xF
        ints = nibbles.reshape(out, inp) - 8
        assert ints.min() >= -8 and ints.max() <= 7 and len(ints.unique()) > 8
        dequantized = ints.float() * scale.float().repeat_interleave(32, dim=1)
        torch.testing.assert_close(dequantized.to(torch.bfloat16), w, atol=0, rtol=0)
    # everything else is the same bf16 tensor in both copies
    others = [n for n in plain if n.removesuffix(".weight") not in experts]
    assert all(
        torch.equal(packed[n], plain[n]) and packed[n].dtype == torch.bfloat16 for n in others
    )


@pytest.mark.slow
def test_load_target_loads_the_wrapper_and_finds_the_text_layers(kimi_dirs):
    """load_target on the INT4 miniature gets the kimi_k25 wrapper, finds its 8 text layers, its
    untied lm_head and remote-code tokenizer, upcasts the de-quantised experts, and captures each
    aux layer as HF's hidden_states[id + 1] (an off-by-one fails): the path every Kimi capture
    takes. Costs ~0.6 s (its call) after the miniature's build (module docstring)."""
    target = load_target(kimi_dirs[0], device="cpu")
    assert type(target.model).__name__ == "Kimi_K25ForConditionalGeneration"
    text_model = target.model.model.language_model
    assert target._decoder is text_model and len(text_model.layers) == target.num_layers == 8
    # 256 bytes + 300 merges + 16 special tokens, padded to a multiple of 64 as Kimi's is
    assert (target.hidden_size, target.vocab_size) == (64, 576)
    assert type(target.tokenizer).__name__ == "TikTokenTokenizer"  # its remote code, trusted
    assert target.aux_layer_ids == [1, 3, 4] == target_mod.default_aux_layers(8)
    assert target.lm_head_weight.data_ptr() != target.embed_weight.data_ptr()  # untied
    assert target.tokenizer is not None and "<think>" in target.tokenizer.chat_template
    # the INT4 experts were de-quantised (compressed-tensors) and upcast to the asked dtype
    assert {p.dtype for p in target.model.parameters()} == {torch.float32}

    # the default ids are < L - 1, so each is compared with HF's pre-norm hidden_states[id + 1]
    ids = torch.randint(0, target.vocab_size, (2, 9))
    aux, last = target.capture(ids)
    with torch.no_grad():
        hs = text_model(ids, output_hidden_states=True).hidden_states
        logits = target.model(ids).logits
    H = target.hidden_size
    for j, layer_id in enumerate(target.aux_layer_ids):
        chunk = aux[..., j * H : (j + 1) * H]
        torch.testing.assert_close(chunk, hs[layer_id + 1], atol=1e-5, rtol=0)
        assert (chunk - hs[layer_id]).abs().max() > 1e-2  # an off-by-one would fail
    torch.testing.assert_close(F.linear(last, target.lm_head_weight), logits, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_capture_equals_dequantized_capture(kimi_dirs, dtype):
    """compressed-tensors unpacks to exactly the values the de-quantised copy stores, and with the
    experts upcast to the asked dtype both run the same arithmetic: the captures are equal bit for
    bit (measured max diff 0.0). Left in bf16 under an fp32 model (transformers' default) they
    differed by up to 0.025 on |h| <= 16, and by >1 when that flipped a router's top-2 choice, so a
    tolerance would hide a real difference. Where the CPU has no native bf16 both compute, and
    capture, in float32 (eagle3.compute). Costs ~0.3-0.4 s a dtype (its call) after the miniature's
    build (module docstring)."""
    int4, plain = (load_target(p, device="cpu", dtype=dtype) for p in kimi_dirs)
    ids = torch.randint(0, int4.vocab_size, (3, 21))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    for aux_ids in ([1, 3, 4], [0, 6, 7]):  # the default; the dense layer and the last two
        int4.aux_layer_ids = plain.aux_layer_ids = aux_ids
        aux4, last4 = int4.capture(ids, mask)
        aux, last = plain.capture(ids, mask)
        assert aux4.dtype == matmul_dtype(dtype, "cpu") and aux4.abs().max() > 1
        torch.testing.assert_close(aux4, aux, atol=0, rtol=0)
        torch.testing.assert_close(last4, last, atol=0, rtol=0)


def test_wrong_path_or_empty_dir_is_one_line_error(tmp_path):
    with pytest.raises(Eagle3Error, match="does not exist"):
        load_target(tmp_path / "no-such-kimi")
    with pytest.raises(Eagle3Error, match="has no config.json") as excinfo:
        load_target(tmp_path, device="cpu")
    _one_line_error(excinfo)


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, edit, expected",
    [
        ("bad-json", None, "not a valid JSON file; pass a HF model directory"),
        ("unknown-type", lambda c: c.update(model_type="kimi_k99"), "upgrade transformers"),
        ("not-an-lm", lambda c: c.update(model_type="vit"), "not a causal LM"),
        ("shape-mismatch", lambda c: c["text_config"].update(hidden_size=96), "do not fit"),
    ],
)
def test_broken_checkpoint_is_one_line_error(kimi_dirs, tmp_path, case, edit, expected):
    """A copy of the miniature with a broken config (not JSON, an unknown model_type, not a causal
    LM, sizes that do not fit the weights) fails load_target in one line saying what to do, not in a
    transformers traceback. Costs ~0.2 s for the four cases (their calls) after the miniature's
    build (module docstring)."""
    path = tmp_path / case
    if edit is None:
        shutil.copytree(kimi_dirs[1], path)
        (path / "config.json").write_text("{ not json")
    else:
        _broken_copy(kimi_dirs[1], path, edit)
    with pytest.raises(Eagle3Error) as excinfo:
        load_target(path, device="cpu")
    assert expected in _one_line_error(excinfo)


@pytest.mark.slow
def test_missing_weights_is_one_line_error(kimi_dirs, tmp_path):
    """A copy of the miniature without model.safetensors fails load_target in one line naming the
    missing safetensors. Costs < 0.1 s after the miniature's build (module docstring); slow for that
    build."""
    path = tmp_path / "no-weights"
    shutil.copytree(kimi_dirs[1], path)
    (path / "model.safetensors").unlink()
    with pytest.raises(Eagle3Error) as excinfo:
        load_target(path, device="cpu")
    assert "safetensors" in _one_line_error(excinfo)


@pytest.mark.slow
def test_missing_compressed_tensors_says_what_to_install(kimi_dirs, monkeypatch):
    """Without compressed-tensors the INT4 checkpoint cannot load: load_target says so in one line
    naming the extra to install (eagle3-forge[kimi]). Costs < 0.1 s after the miniature's build
    (module docstring); slow for that build."""
    from transformers.quantizers import quantizer_compressed_tensors

    monkeypatch.setattr(
        quantizer_compressed_tensors, "is_compressed_tensors_available", lambda: False
    )
    with pytest.raises(Eagle3Error) as excinfo:
        load_target(kimi_dirs[0], device="cpu")
    message = _one_line_error(excinfo)
    assert "compressed-tensors" in message and "eagle3-forge[kimi]" in message


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["AutoConfig", "AutoModelForImageTextToText"])
def test_remote_code_failure_is_one_line_error(kimi_dirs, monkeypatch, stage):
    """Remote config/modelling code can raise anything; simulated here (running real remote code
    would write into the shared ~/.cache/huggingface/modules). Costs < 0.1 s a stage after the
    miniature's build (module docstring); slow for that build."""
    import transformers

    def broken(*args, **kwargs):
        raise AttributeError("module 'modeling_kimi' has no attribute 'X'\n  (traceback ...)")

    monkeypatch.setattr(getattr(transformers, stage), "from_pretrained", broken)
    with pytest.raises(Eagle3Error) as excinfo:
        load_target(kimi_dirs[1], device="cpu")
    assert "has no attribute 'X'; " in _one_line_error(excinfo)
    assert isinstance(excinfo.value.__cause__, AttributeError)  # the full error stays chained


def test_registry_describes_the_real_wrapper():
    spec = target_mod.target_spec("kimi-k2.5")
    assert spec["architecture"] == "KimiK25ForConditionalGeneration"
    assert spec["text_architecture"] == "DeepseekV3ForCausalLM"
    assert spec["aux_layer_ids"] == [1, 29, 57] == target_mod.default_aux_layers(61)
    assert spec["trust_remote_code"] is False and spec["tokenizer_trust_remote_code"] is True
