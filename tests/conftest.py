"""Shared fixtures: seeding, the gpu skip, tiny random targets (no download), the embedded target."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

TINY_VOCAB = 256


@pytest.fixture(autouse=True)
def seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,  # default aux layers [1, 3, 4]
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,  # large enough that neighbouring layers differ clearly
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def tiny_deepseek_config():
    """DeepSeek-V3 (Kimi-K2.5's architecture) in miniature: MLA attention, 2 dense + 6 MoE layers."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=0,
    )


def _save_tiny(config, path, seed: int):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A saved random LlamaForCausalLM (hidden 64, 8 layers, vocab 256, untied lm_head)."""
    return _save_tiny(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"), seed=1)


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory):
    """A saved random DeepseekV3ForCausalLM (hidden 64, 8 layers, 8 routed experts)."""
    return _save_tiny(tiny_deepseek_config(), tmp_path_factory.mktemp("tiny_deepseek"), seed=2)


@pytest.fixture
def tiny_llama_target(tiny_llama_dir):
    from eagle3.target import load_target

    return load_target(tiny_llama_dir, device="cpu")


@pytest.fixture
def tiny_deepseek_target(tiny_deepseek_dir):
    from eagle3.target import load_target

    return load_target(tiny_deepseek_dir, device="cpu")


@pytest.fixture(scope="session")
def smollm2_target():
    """The embedded 4-bit SmolLM2 target (converted once into ~/.cache/eagle3, then ~1 s)."""
    from eagle3.target import load_target

    return load_target("smollm2-135m-q4", device="cpu")
