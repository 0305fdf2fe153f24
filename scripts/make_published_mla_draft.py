"""A random EAGLE-3 MLA drafter for the Kimi miniature, in the layout lightseekorg's Kimi MLA
drafters are published in (TorchSpec's `convert_to_hf.py --prune-vocab --vllm`): what a
fine-tune from a published drafter starts from, in miniature.

    python scripts/make_tiny_kimi.py OUT --published-draft OUT3   # the command that writes one

As a module (tests): `make_published_mla_draft(out, target_dir, seed=...)` for a random one,
`write_published_mla(draft, out, target_dir)` for a given MLA Eagle3Draft.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# ModelOpt's eagle_config switches TorchSpec's MLA configs carry beside the aux ids
TORCHSPEC_SWITCHES = {
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
}


def published_mla_config(draft, text: dict) -> dict:
    """config.json as TorchSpec publishes an MLA drafter, for `draft` (an MLA Eagle3Draft):
    exactly the keys of configs/draft_models/kimi_k3_eagle3_mla.json (lightseekorg/TorchSpec),
    in its order, at the draft's dims, `draft_vocab_size` and `torch_dtype` as
    tools/convert_to_hf.py writes them, and the aux ids as its `--vllm` export writes them for a
    kimi_k2 draft (vLLM's convention: the project's + 1). `text` is the target's text config
    (its special token ids)."""
    cfg = draft.config
    scaling = dict(cfg.rope_scaling or {})
    rope = None
    if scaling:  # TorchSpec's keys: "type", DeepSeek's mscale terms
        rope = {
            "type": scaling["rope_type"],
            "factor": scaling["factor"],
            "original_max_position_embeddings": scaling["original_max_position_embeddings"],
            "beta_fast": scaling["beta_fast"],
            "beta_slow": scaling["beta_slow"],
            "mscale": scaling.get("mscale", 1.0),
            "mscale_all_dim": scaling.get("mscale_all_dim", 1.0),
        }
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": "bfloat16",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
            "use_aux_hidden_state": True,
            **TORCHSPEC_SWITCHES,
        },
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "pad_token_id": text.get("pad_token_id"),
    }


def write_published_mla(draft, out: Path, target_dir: Path) -> Path:
    """Write `draft` (an MLA Eagle3Draft, with its own embeddings) to `out` as TorchSpec's
    `convert_to_hf.py --prune-vocab --vllm` publishes it: published_mla_config's config.json,
    and one model.safetensors of bf16 `embed_tokens.weight`, `fc.weight`, `layers.0.*` (vLLM's
    name for the decoder layer), `norm.weight`, `lm_head.weight` [draft vocab, H] and `d2t`
    (int64, target id - draft id), no `t2d`. -> out."""
    if draft.config.attention != "mla":
        raise ValueError("write_published_mla writes MLA drafters only")
    text = json.loads((Path(target_dir) / "config.json").read_text())["text_config"]
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = {}
    for name, value in draft.state_dict().items():
        if name == "t2d":
            continue
        if name.startswith("midlayer."):  # the --vllm export's name for the decoder layer
            name = "layers.0." + name.removeprefix("midlayer.")
        value = value.detach().cpu()
        tensors[name] = (value.to(torch.bfloat16) if value.is_floating_point() else value).clone()
    config = published_mla_config(draft, text)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_published_mla_draft(
    out: Path, target_dir: Path, *, seed: int = 0, draft_vocab_size: int = 256
) -> Path:
    """A random EAGLE-3 MLA drafter for the Kimi miniature at `target_dir`, written to `out` in
    TorchSpec's published layout (write_published_mla): one MLA layer at the target's MLA dims
    and rope, `model_type` kimi_k2 with `mla_use_nope` true, the engines' default aux layers,
    a reduced vocab of `draft_vocab_size` tokens (a seeded choice; d2t, no t2d) and its own
    embed_tokens, seeded, unlike the target's. -> out."""
    from transformers import AutoConfig

    from eagle3.methods import draft_for, from_target_config
    from eagle3.published import engine_default_aux_ids
    from eagle3.vocab import build_draft_vocab

    text = AutoConfig.from_pretrained(target_dir).get_text_config()
    if not 0 < draft_vocab_size < text.vocab_size:  # vLLM refuses a d2t beside a full lm_head
        raise ValueError(f"draft_vocab_size must be in 1..{text.vocab_size - 1} (a reduced vocab)")
    aux = engine_default_aux_ids(text.num_hidden_layers)
    cfg = from_target_config(text, draft_vocab_size, aux, attention="mla")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        draft = draft_for(cfg)
    vocab = build_draft_vocab(torch.randperm(cfg.vocab_size, generator=generator), draft_vocab_size)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    own = 0.1 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(own)  # its own: the target's are 0.1-std, other values
        for name, weight in draft.named_parameters():
            if name.endswith("norm.weight"):  # trained norms are not all ones
                weight.add_(0.1 * torch.randn(weight.shape, generator=generator))
    return write_published_mla(draft, out, target_dir)
