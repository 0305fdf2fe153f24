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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is far faster than several competing for shared cores. A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def transformers_warnings():
    """The messages transformers logs during the test. Its warning_once cache is cleared first,
    so a warning an earlier test already triggered in this process is seen again."""
    import logging

    from transformers.utils import logging as hf_logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


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
def chat_target_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama with a word-level ChatML tokenizer and template (tests/tiny_chat.py):
    a target the chat-rendering stages (evaluation, rollouts) can ask."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("tiny_chat.py")
    spec = importlib.util.spec_from_file_location("tiny_chat", path)
    tiny_chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_chat)
    out = tmp_path_factory.mktemp("chat_target")
    return tiny_chat.chat_model_dir(tiny_llama_dir, out, tiny_chat.chatml_tokenizer(256))


@pytest.fixture(scope="session")
def chat_drafter(chat_target_dir, tmp_path_factory):
    """A random EAGLE-3 checkpoint for chat_target_dir (draft vocab 200, aux [1, 3, 4])."""
    from transformers import AutoConfig

    from eagle3.checkpoint import save_draft
    from eagle3.methods import from_target_config
    from eagle3.model import Eagle3Draft

    with torch.random.fork_rng():
        torch.manual_seed(0)
        cfg = from_target_config(AutoConfig.from_pretrained(chat_target_dir), 200, [1, 3, 4])
        draft = Eagle3Draft(cfg)
    out = tmp_path_factory.mktemp("chat_drafter") / "final"
    return save_draft(draft, out, extra_config={"target": "tiny-llama"})


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory):
    """A saved random DeepseekV3ForCausalLM (hidden 64, 8 layers, 8 routed experts)."""
    return _save_tiny(tiny_deepseek_config(), tmp_path_factory.mktemp("tiny_deepseek"), seed=2)


@pytest.fixture
def tiny_llama_target(tiny_llama_dir):
    from eagle3.targets import load_target

    return load_target(tiny_llama_dir, device="cpu")


@pytest.fixture
def tiny_deepseek_target(tiny_deepseek_dir):
    from eagle3.targets import load_target

    return load_target(tiny_deepseek_dir, device="cpu")


@pytest.fixture(scope="session")
def smollm2_target():
    """The embedded 4-bit SmolLM2 target (converted once into ~/.cache/eagle3, then ~1 s)."""
    from eagle3.targets import load_target

    return load_target("smollm2-135m-q4", device="cpu")


@pytest.fixture(scope="session")
def kimi_miniature(tmp_path_factory):
    """scripts/make_tiny_kimi.py's miniature, seed 3, written once a session (~30 s at load 6 on
    2 cores): (INT4 dir, its de-quantised copy), both named kimi-mini so that shards of either
    name the same target. Tests only read them (copy a directory to break it). A module that
    needs it checks compressed_tensors and tiktoken first, with its own skip reason."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_kimi.py"
    spec = importlib.util.spec_from_file_location("make_tiny_kimi", script)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    root = tmp_path_factory.mktemp("kimi_miniature")
    int4, plain = root / "int4" / "kimi-mini", root / "bf16" / "kimi-mini"
    maker.make_tiny_kimi(int4, seed=3, dequantized=plain)
    return int4, plain


# -- the serving engine (vLLM in .venv-engine) -------------------------------------------------
EMBEDDED = "smollm2-135m-q4"


@pytest.fixture(scope="session")
def engine():
    """Engine tests need `bash scripts/install_engine.sh` (scripts/test.sh runs it). Without the
    engine they skip with that reason, except in CI (CI=true), where they fail: CI must run them."""
    import os

    from eagle3.engine.venv import engine_available, engine_python

    if engine_available():
        return engine_python()
    reason = "the vLLM engine venv is not installed (run `bash scripts/install_engine.sh`)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def embedded_target_dir():
    """The HF dir of the embedded target (the de-quantised fp32 SmolLM2 dir engines serve)."""
    from eagle3.errors import Eagle3Error
    from eagle3.targets import resolve

    try:
        return resolve(EMBEDDED).hf_dir
    except Eagle3Error as err:
        pytest.skip(f"embedded target unavailable: {err}")


@pytest.fixture(scope="session")
def embedded_answers(tmp_path_factory, embedded_target_dir):
    """The embedded target's own greedy answers to 6 MT-bench first turns (48 new tokens each),
    captured once per session (~1 min): what the acceptance drafters below train on.
    -> (shard dir, prompts file)."""
    import json

    from eagle3.data.prompts import load_prompts

    work = tmp_path_factory.mktemp("embedded_answers")
    prompts = load_prompts("mt_bench", dataset="mt_bench", limit=6)
    bench = work / "mt_bench6.jsonl"
    bench.write_text(
        "".join(
            json.dumps({"id": p.id, "turns": [p.messages[0]["content"]]}) + "\n" for p in prompts
        )
    )
    _run_repo("-m", "datagen.local", "--target", EMBEDDED, "--prompts", str(bench),
              "--max-new-tokens", "48", "--temperature", "0", "--batch-size", "6",
              "--out", str(work / "responses"))  # fmt: skip
    _run_repo("-m", "datagen.capture", "--target", EMBEDDED, "--data", str(work / "responses"),
              "--out", str(work / "shards"))  # fmt: skip
    return work / "shards", bench


def embedded_drafter_command(shards, out, *overrides: str) -> list[str]:
    """Training a drafter for the embedded target that ACCEPTS tokens: 30 steps over the 6
    captured answers (lr 2e-3), long enough to learn them. Evaluated on those same prompts it
    accepts many drafts: what an acceptance comparison (engine vs in-house) needs."""
    return ["train/train_drafter.py", "--config", "configs/train/smollm2-q4-cpu.yaml",
            f"data.shard_dirs=[{shards}]", f"train.out_dir={out}",
            "train.max_steps=30", "train.epochs=1000", "optim.lr=2e-3", "optim.warmup_steps=3",
            "data.batch_size=6", "model.draft_vocab_size=2048", "train.save_every=1000",
            "data.val_fraction=0",  # all 6 conversations train: it is measured on them
            "train.progress=false", "wandb.mode=disabled", *overrides]  # fmt: skip


def _run_repo(*cmd: str) -> None:
    _run_repo_at_once([list(cmd)])


def _run_repo_at_once(commands: list[list[str]], **env: str) -> None:
    """`python CMD...` from the repo root, every command at once."""
    import os
    import sys
    from pathlib import Path

    from tests.processes import run_at_once

    repo = Path(__file__).resolve().parents[1]
    run_at_once(
        [[sys.executable, *cmd] for cmd in commands],
        cwd=repo,
        env={
            **os.environ,
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(repo),
            **env,
        },  # fmt: skip
    )


@pytest.fixture(scope="session")
def embedded_drafters(tmp_path_factory, embedded_answers):
    """The embedded target's answers trained as an EAGLE-3, an EAGLE-3.1 and a P-EAGLE drafter
    (the EAGLE-3 layer + 1 plain layer, parallel depth 4), named train/final, eagle3.1/final and
    train-peagle/final, the three at once on one thread each (87-110 s beside another xdist
    worker; 91-487 s one after the other in one process, under varying load).
    -> ({method: checkpoint dir}, prompts file)."""
    shards, bench = embedded_answers
    root = tmp_path_factory.mktemp("embedded_drafter")  # reports name them by their dir
    overrides = {
        "eagle3": ("train", ()),
        "eagle3.1": ("eagle3.1", ("model.draft.method=eagle3.1",)),
        "p-eagle": ("train-peagle", ("model.draft.method=p-eagle", "model.draft.num_layers=2",
                                     "model.draft.parallel_depth=4")),
    }  # fmt: skip
    _run_repo_at_once(
        [embedded_drafter_command(shards, root / out, *extra) for out, extra in overrides.values()],
        OMP_NUM_THREADS="1",
    )
    return {method: root / out / "final" for method, (out, _) in overrides.items()}, bench


@pytest.fixture
def tiny_config():
    """A factory of tiny DraftConfigs (hidden 32, 4 heads of 8, vocab 50 -> 40): overrides
    as keyword arguments."""
    from eagle3.methods import make_draft_config
    from eagle3.model import DraftConfig

    def make(**overrides) -> DraftConfig:
        values = dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=50,
            draft_vocab_size=40,
            target_hidden_size=32,
            aux_layer_ids=[0, 1, 2],
        )
        values.update(overrides)
        return make_draft_config(**values)

    return make
