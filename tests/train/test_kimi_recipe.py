"""The Kimi-K2.5 recipes run end to end on the Kimi-format miniature (INT4, kimi_k25 wrapper),
scaled down by config values only: responses (datagen.local, in-process) -> capture
(datagen.capture, bf16 as the recipe says) -> offline train (configs/train/kimi-k2.5-offline.yaml)
-> evaluate (eagle3.evaluate); the fine-tune recipe (configs/train/kimi-k2.5-finetune.yaml) from a
drafter in TorchSpec's published MLA layout (scripts/make_tiny_kimi.py's), evaluated in-house
and by vLLM-CPU prompt by prompt; online training (configs/train/kimi-k2.5-online.yaml) with the
target served by a real vLLM-CPU server to 2 ZeRO-2 ranks, equal to the in-process target's
run; and the ZeRO-2 accelerate config (configs/accelerate/8gpu-zero2.yaml) on 2 CPU processes,
whose losses equal the plain run's. Every command is the real CLI in a subprocess."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import descendants, run_at_once

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?",
    "Add 17 and 25.",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Convert 3 km to metres.",
    "Give a synonym for happy.",
    "What does CPU stand for?",
]
AUX = [1, 3, 4]  # the miniature's 8 text layers: default_aux_layers(8), what every stage takes
SCALED = [  # what the recipes set for 8 H200s that a 2-core CPU cannot afford
    "data.num_workers=0",
    "wandb.mode=disabled",
    "train.progress=false",
    "train.log_every=1",
    "model.draft_vocab_size=256",  # the miniature's tokenizer has 572 tokens, Kimi's 163,840
]


def _env(**extra: str) -> dict:
    return {
        **os.environ,
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        **extra,
    }


def run(*cmd: str, **env_extra: str) -> subprocess.CompletedProcess:
    """`python CMD...` from the repo root; fails with the stderr tail."""
    proc = subprocess.run(
        [sys.executable, *cmd],
        cwd=REPO,
        env=_env(**env_extra),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def metrics(out_dir: Path) -> list[dict]:
    """The training steps' rows of metrics.jsonl (validation rows carry "split": "val")."""
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "split" not in row]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> dict[str, Path]:
    """The miniature, its own greedy answers to PROMPTS, and their bf16 capture."""
    for module in ("compressed_tensors", "tiktoken"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the Kimi miniature needs {module} (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("kimi_recipe")
    mini, prompts = root / "kimi-mini", root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))
    )
    plain = (
        root / "kimi-mini-bf16"
    )  # the same model with de-quantised experts: what vLLM-CPU serves
    run("scripts/make_tiny_kimi.py", str(mini), "--seed", "3", "--dequantized", str(plain))
    # the target's own answers, as datagen gives them: soft labels agree with the tokens
    run(
        "-m", "datagen.local", "--prompts", str(prompts), "--target", str(mini),
        "--out", str(root / "responses"), "--max-new-tokens", "24", "--batch-size", "8",
    )  # fmt: skip
    run(
        "-m", "datagen.capture", "--target", str(mini), "--data", str(root / "responses"),
        "--out", str(root / "shards"), "--dtype", "bf16",
    )  # fmt: skip
    bench = root / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["What is two plus two?"]}) + "\n")
    return {
        "root": root,
        "mini": mini,
        "plain": plain,
        "responses": root / "responses",
        "shards": root / "shards",
        "bench": bench,
    }


def offline_args(kimi: dict, out: Path, *extra: str) -> list[str]:
    return [
        "train/train_drafter.py",
        "--config",
        "configs/train/kimi-k2.5-offline.yaml",
        f"target.name={kimi['mini']}",
        f"data.shard_dirs=[{kimi['shards']}]",
        f"train.out_dir={out}",
        "train.max_steps=2",
        *SCALED,
        *extra,
    ]


def test_capture_offline_train_evaluate(kimi):
    """The offline recipe as written (kimi-k2.5-offline.yaml, scaled by config values only) trains
    on the miniature's bf16 capture, exports the MLA draft with the miniature's MLA dims and YaRN
    rope, and eagle3.evaluate decodes with it: the Kimi offline path end to end through the real
    CLIs. Costs ~21 s of fixture setup (the module's kimi fixture: the miniature, its answers and
    their capture, shared with the file's other tests) + ~15 s (its call; measured on 2 xdist
    workers, whole files to each)."""
    meta = json.loads((kimi["shards"] / "meta.json").read_text())
    assert meta["dtype"] == "bf16" and meta["aux_layer_ids"] == AUX and meta["complete"]
    out = kimi["root"] / "offline"
    log = run(*offline_args(kimi, out)).stdout
    assert "offline training on 1 process(es)" in log
    steps = metrics(out)
    assert [m["step"] for m in steps] == [1, 2] and all(m["loss"] > 1 for m in steps)
    config = json.loads((out / "final" / "config.json").read_text())
    # the recipe's MLA draft with the miniature's MLA dims and YaRN rope (make_tiny_kimi's)
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert (config["num_attention_heads"], config["kv_lora_rank"]) == (4, 512)
    assert (config["qk_rope_head_dim"], config["q_lora_rank"]) == (64, 32)
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"]["rope_type"] == "yarn"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX

    report = kimi["root"] / "eval.json"
    run(
        "-m", "eagle3.evaluate", "--target", str(kimi["mini"]), "--draft", str(out / "final"),
        "--bench", str(kimi["bench"]), "--limit", "1", "--max-new-tokens", "8",
        "--json", str(report),
    )  # fmt: skip
    (row,) = json.loads(report.read_text())["results"]
    assert row["tokens"] == 8 and 1.0 <= row["tau"] <= 8


# -- starting from a published drafter -------------------------------------------------------------
# configs/draft_models/kimi_k3_eagle3_mla.json's keys (lightseekorg/TorchSpec): what a published
# MLA drafter's config.json holds (convert_to_hf.py adds draft_vocab_size and torch_dtype, which
# it already has)
TORCHSPEC_MLA_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "hidden_act",
    "rms_norm_eps", "vocab_size", "draft_vocab_size", "torch_dtype", "rope_theta", "rope_scaling",
    "max_position_embeddings", "eagle_config", "bos_token_id", "eos_token_id", "pad_token_id",
}  # fmt: skip


def published_maker():
    """scripts/make_published_mla_draft.py as a module (a script, not a package)."""
    path = REPO / "scripts" / "make_published_mla_draft.py"
    spec = importlib.util.spec_from_file_location("make_published_mla_draft", path)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker


@pytest.fixture(scope="module")
def published(kimi) -> Path:
    """A random MLA drafter for the miniature in TorchSpec's published layout (kimi_k2,
    mla_use_nope true, layers.0.*, eagle_config ids in vLLM's convention, a 256-token vocab with
    d2t and no t2d, its own embed_tokens): make_published_mla_draft, ~0.2 s."""
    return published_maker().make_published_mla_draft(
        kimi["root"] / "published", kimi["mini"], seed=5, draft_vocab_size=256
    )


def finetune_args(kimi: dict, start: Path, out: Path, *extra: str) -> list[str]:
    """The fine-tune recipe as written, on the miniature's shards (replayed too), from `start`."""
    return [
        "train/train_drafter.py", "--config", "configs/train/kimi-k2.5-finetune.yaml",
        f"target.name={kimi['mini']}", f"data.shard_dirs=[{kimi['shards']}]",
        f"data.replay_shard_dirs=[{kimi['shards']}]", f"model.init_from={start}",
        f"train.out_dir={out}", *SCALED, *extra,
    ]  # fmt: skip


def test_fine_tune_recipe_from_the_published_mla_layout_keeps_its_own_embeddings(kimi, published):
    """The fine-tune recipe (kimi-k2.5-finetune.yaml, scaled by config values only; lr 1e-3 so
    that 2 steps move bf16 weights) starts from a drafter exactly as TorchSpec publishes its MLA
    heads: its own embed_tokens stay frozen (bit-identical in the export, which carries them as
    vLLM serves them), its draft vocab and aux layers are kept, the export reloads as the same
    drafter beside the target, and eagle3.evaluate decodes with the published directory and the
    export. Costs ~15 s (its call: 2 steps and one in-house evaluate) after the module's kimi
    fixture."""
    import torch

    from eagle3.checkpoint import load_draft
    from eagle3.published import read_tensors
    from eagle3.targets import load_embeddings

    config = json.loads((published / "config.json").read_text())
    assert set(config) == TORCHSPEC_MLA_KEYS
    assert (config["model_type"], config["mla_use_nope"]) == ("kimi_k2", True)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in AUX]
    raw = read_tensors(published)
    assert "t2d" not in raw and raw["d2t"].numel() == 256 < config["vocab_size"]
    assert any(k.startswith("layers.0.") for k in raw) and not any("midlayer" in k for k in raw)
    out = kimi["root"] / "published-ft"
    log = run(*finetune_args(kimi, published, out, "train.max_steps=2", "optim.lr=1e-3",
                             "optim.warmup_steps=1")).stdout  # fmt: skip
    assert f"draft vocab: 256 tokens, copied from {published}" in log
    tuned = read_tensors(out / "final")
    assert torch.equal(tuned["embed_tokens.weight"], raw["embed_tokens.weight"])  # frozen
    assert torch.equal(tuned["d2t"], raw["d2t"])  # the start's vocab
    assert not torch.equal(tuned["fc.weight"], raw["fc.weight"])  # it trained
    target_embed = load_embeddings(kimi["mini"])
    start = load_draft(published, embed_weight=target_embed, target_layers=8)
    again = load_draft(out / "final", embed_weight=target_embed)
    assert start.config.own_embeddings and again.config.own_embeddings
    assert again.config.aux_layer_ids == start.config.aux_layer_ids == AUX
    assert torch.equal(again.embed_tokens.weight, start.embed_tokens.weight)

    report = kimi["root"] / "published-eval.json"
    run(
        "-m", "eagle3.evaluate", "--target", str(kimi["mini"]), "--draft", str(published),
        "--draft", str(out / "final"), "--bench", str(kimi["bench"]), "--limit", "1",
        "--max-new-tokens", "8", "--json", str(report),
    )  # fmt: skip
    rows = {r["drafter"]: r for r in json.loads(report.read_text())["results"]}
    assert set(rows) == {"published", "published-ft/final"}
    assert all(r["tokens"] == 8 and r["tau"] >= 1.0 for r in rows.values())


def online_args(kimi: dict, out: Path, *extra: str) -> list[str]:
    return [
        "train/train_drafter.py", "--config", "configs/train/kimi-k2.5-online.yaml",
        f"data.records=[{kimi['responses']}]", f"train.out_dir={out}", "train.max_steps=2",
        "data.val_fraction=0", "data.max_length=1000", *SCALED, *extra,  # the mini: 1,024 ctx
    ]  # fmt: skip


@pytest.fixture(scope="module")
def online_in_process(kimi) -> Path:
    """The online recipe with the packed INT4 target in this process (one process, 2 x 2)."""
    out = kimi["root"] / "online"
    run(*online_args(kimi, out, f"target.name={kimi['mini']}", "target.engine.kind=null",
                     "data.batch_size=2", "optim.grad_accum=2"))  # fmt: skip
    return out


def test_online_train_with_the_in_process_target(online_in_process):
    """The online recipe (kimi-k2.5-online.yaml) with the packed INT4 target in the trainer's
    process trains 2 steps and exports a draft with the default aux ids; the run is also the
    reference the served run must equal. Costs ~8 s of fixture setup (online_in_process: the
    training run itself, shared with the served-run test) + < 0.1 s, after the module's kimi
    fixture."""
    steps = metrics(online_in_process)
    assert [m["step"] for m in steps] == [1, 2] and all(m["loss"] > 1 for m in steps)
    assert (online_in_process / "final" / "model.safetensors").is_file()
    config = json.loads((online_in_process / "final" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX  # the default


def test_online_recipe_as_written_serves_the_target_to_two_zero2_ranks(
    engine, kimi, online_in_process
):
    """The recipe's own launch (8gpu-zero2.yaml, --num_processes 2 instead of 8): the first
    rank starts ONE vLLM server for the node (the de-quantised copy, eagerly, as vLLM-CPU
    serves the wrapper), both ranks send it their sequences and train a ZeRO-2 drafter; the
    per-step loss equals the in-process INT4 run's with the same sequences per step (1 x 2 per
    rank x 2 ranks = 2 x 2). The engine serves float32 with the CPU_MLA backend on every CPU
    (an AMX Xeon would pick AMX_MLA, which refuses fp32 weights).
    Tolerance, for a float32 engine: the hidden states agree to ~4e-7 relative
    (tests/datagen/test_capture_engine_kimi.py), ZeRO-2 vs plain to 1.7e-8; measured: loss 7e-9
    and 5e-8 relative at steps 1 and 2, so rel 1e-4. Costs ~43 s (its call: a vLLM-CPU start and 2
    ZeRO-2 ranks; measured on 2 xdist workers), after the module's kimi and online_in_process
    fixtures."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed (pip install -e '.[dev]')")
    out = kimi["root"] / "online-served"
    log = run(
        "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/8gpu-zero2.yaml",
        "--num_processes", "2", "--main_process_port", "29551",
        *online_args(kimi, out, f"target.name={kimi['plain']}", "target.engine.tensor_parallel_size=null",
                     "target.engine.args=[--enforce-eager]", "data.batch_size=1", "optim.grad_accum=2"),
        DS_ACCELERATOR="cpu",
    ).stdout  # fmt: skip
    assert "online training on 2 process(es) (DEEPSPEED, DeepSpeedEngine)" in log
    assert log.count("starting vLLM") == 1  # one server for the node, port 29551 + 1
    engine_log = (out / f"engine-{os.uname().nodename}.log").read_text()
    assert "Using auxiliary layers from speculative config: (2, 4, 5, 8)" in engine_log
    # the tolerance is the float32 engine's: the dtype served, on whichever CPU this is
    serving = json.loads((out / "provenance.json").read_text())["served_by"]["serving"]
    backend = "CPU_MLA"  # AMX_MLA (an AMX Xeon's default) refuses float32 weights
    assert (serving["dtype"], serving["attention_backend"]) == ("float32", backend), serving
    assert f"Using {backend} backend" in engine_log
    a, b = metrics(online_in_process), metrics(out)
    assert [m["step"] for m in b] == [1, 2]
    for key, rel in (("loss", 1e-4), ("acc_0", 1e-6)):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=rel), key


TAU_RTOL = 0.03  # vLLM's tau vs the in-house decoder's, T = 0, the same prompts


@pytest.fixture(scope="module")
def mla_drafters(kimi, published) -> dict[str, Path]:
    """The Kimi offline recipe's default MLA draft as EAGLE-3 and as EAGLE-3.1, and the
    published-layout miniature fine-tuned (model.init_from, its vocab re-chosen from the data,
    its own embeddings frozen), trained on the miniature's own answers to PROMPTS until they
    accept them (one batch of all its answers, lr 2e-3; all: a random model may end an answer
    at its first token, which capture skips), the three at once on one thread each (~1 min
    here). The random miniature's greedy answers repeat a few tokens: from step 2 all predict
    them at acc 0.63 on every depth (measured over 60 steps: flat after step 2), so 12 steps.
    -> {"eagle3" | "eagle3.1" | "published": final checkpoint dir}."""
    kept = json.loads((kimi["shards"] / "meta.json").read_text())["num_records"]
    outs = {
        "eagle3": (kimi["root"] / "mla", ["model.draft.method=eagle3"]),
        "eagle3.1": (kimi["root"] / "mla31", ["model.draft.method=eagle3.1"]),
        "published": (kimi["root"] / "published-ft12",
                      [f"model.init_from={published}", "model.revocab=true"]),
    }  # fmt: skip
    commands = [
        [sys.executable, *offline_args(kimi, out, "train.max_steps=12", "train.epochs=1000",
                                       "optim.lr=2e-3", "optim.warmup_steps=3",
                                       f"data.batch_size={kept}", "data.val_fraction=0",
                                       "train.save_every=1000", "model.ttt_steps=3",
                                       "optim.grad_accum=1", *extra)]
        for out, extra in outs.values()
    ]  # fmt: skip
    run_at_once(commands, cwd=REPO, env=_env())
    return {name: out / "final" for name, (out, _) in outs.items()}


def test_mla_draft_served_by_vllm_accepts_what_the_in_house_decoder_accepts_eagle3_1_and_published(
    engine, kimi, mla_drafters, monkeypatch
):
    """vLLM-CPU serves the de-quantised miniature with the EAGLE-3.1 MLA drafter as an EAGLE-3
    speculator (Eagle3DeepseekV3ForCausalLM, the aux layers it was trained on),
    and its spec-decode counters give the in-house decoder's tau within 3% at T = 0 on the same
    prompts (float32 on both sides: the CPU_MLA backend on every CPU). The EAGLE-3.1 drafter's
    fc_norm weights show in vLLM's debug log: served as EAGLE-3.1. The published MLA layout
    (the fine-tuned published miniature written back as TorchSpec publishes it: kimi_k2,
    mla_use_nope, layers.0.*, d2t without t2d, its own embed_tokens) and the fine-tune's own
    export: vLLM keeps each one's own embeddings (its log says so, twice) and accepts, prompt
    by prompt, exactly what the in-house decoder (on the same own embeddings,
    tests/eagle3/test_published_drafters.py) accepts from the same directory. On the
    miniature's repetitive answers acceptance hardly depends on the embeddings (decoded on the
    target's instead, measured: the same counts), so vLLM's log line is what shows it serves
    them. The EAGLE-3 MLA drafter's vLLM tau is the next test's, through bench_mla_draft. ~2.5
    min (its call 111 s alone on the idle 2-core EPYC: three drafters, a vLLM-CPU start each
    and a plain one, one request at a time: the batched pass is test_evaluate_engine's) after
    its fixtures' 55-100 s (the kimi fixture, then the three drafters at once)."""
    from eagle3.checkpoint import load_draft

    layout = published_maker().write_published_mla(
        load_draft(mla_drafters["published"]), kimi["root"] / "published-layout", kimi["mini"]
    )
    bench = kimi["root"] / "prompts8.jsonl"
    bench.write_text(
        "".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS))
    )
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the engine logs every weight it loads
    report, engine_log = kimi["root"] / "mla-eval.json", kimi["root"] / "mla-vllm.log"
    log = run(
        "-m", "eagle3.evaluate", "--target", str(kimi["plain"]),
        "--draft", str(mla_drafters["eagle3.1"]), "--draft", str(mla_drafters["published"]),
        "--draft", str(layout), "--bench", f"own={bench}", "--max-new-tokens", "24", "--steps", "3",
        "--temperature", "0", "--json", str(report), "--engine", "vllm",
        "--engine-arg=--enforce-eager", "--engine-passes", "single", "--engine-log", str(engine_log),
    ).stdout  # fmt: skip
    print(log)
    text = engine_log.read_text()
    assert "Eagle3DeepseekV3ForCausalLM" in text or "Eagle3DeepseekV2ForCausalLM" in text
    # the project's aux ids [1, 3, 4] are vLLM's (2, 4, 5); the target's own last layer is 8
    assert re.search(r"Using auxiliary layers from speculative config: \(2, 4, 5\)", text)
    assert len(set(re.findall(r"Loaded weight (\S*fc_norm\.\d\.weight)", text))) == 3
    rows = {r["drafter"]: r for r in json.loads(report.read_text())["results"]}
    house, vllm = rows["mla31/final"], rows["mla31/final [vllm]"]
    # 12 steps on its own 8 answers: it accepts most drafts (measured 2026-12-03: tau 3.33,
    # alpha 0.81 / 0.94 / 1.0, in-house and in vLLM), so equal taus are a real test
    assert house["tau"] > 1.3
    assert vllm["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL)
    assert vllm["tokens"] == house["tokens"]  # T = 0: the same answers
    # vLLM keeps a draft's own embed_tokens unless they equal the target's (llm_base_proposer)
    assert text.count("Detected EAGLE model with distinct embed_tokens weights") == 2
    for name in ("published-ft12/final", "published-layout"):
        house, vllm = rows[name], rows[f"{name} [vllm]"]
        assert house["tau"] > 1.3, name  # measured 3.33, as the drafters above
        counts = [[(p["accepted"], p["steps"]) for p in r["per_prompt"]] for r in (house, vllm)]
        assert counts[0] == counts[1], name
        assert vllm["tokens"] == house["tokens"], name


def test_bench_mla_draft_as_documented_serves_the_mla_eagle3_draft_with_the_in_house_tau(
    engine, kimi, mla_drafters, tmp_path, monkeypatch
):
    """experiments/bench_mla_draft.py's command as its docstring prints it, at its smallest,
    resumed in a work dir where this file's fixtures already made its first stages (each stage
    is skipped where its output exists): the miniature of the same seed, the bf16 capture of
    its own answers and the MLA draft (mla_drafters' EAGLE-3, the Kimi offline recipe's
    default). What runs: datagen.local on 2 ShareGPT prompts, the GQA draft's 2 steps, both
    drafts decoded in-house and the MLA one served by vLLM-CPU (a plain server, then the
    drafter's). Its table has both drafts, the GQA one's vLLM cells refused, and vLLM's tau of
    the MLA EAGLE-3 draft is the in-house decoder's on the same MT-bench turns (the test above
    checks EAGLE-3.1 and the published layouts). 74 s in an idle suite, 125 s at load 3
    (datagen 10 s, the GQA draft's training, both decoded in-house, two vLLM-CPU starts) after
    the fixtures it shares with the test above, whose start of this drafter it replaced."""
    work = tmp_path / "work"
    work.mkdir()
    done = {"kimi-mini": kimi["mini"], "kimi-mini-bf16": kimi["plain"],
            "shards": kimi["shards"], "mla": mla_drafters["eagle3"].parent}  # fmt: skip
    for name, made in done.items():
        (work / name).symlink_to(made)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the engine logs every weight it loads
    out = tmp_path / "mla.json"
    table = run(
        "experiments/bench_mla_draft.py", "--work", str(work), "--train-prompts", "2",
        "--limit", "2", "--steps", "2", "--max-new-tokens", "16", "--json", str(out),
    ).stdout  # fmt: skip
    print(table)
    assert (work / "gqa" / "final" / "config.json").is_file()
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines] == ["draft", "mla", "gqa"]
    assert "refused by vLLM-CPU" in lines[2]
    mla, gqa = json.loads(out.read_text())["rows"]
    assert mla["tau_in_house"] > 1.1  # measured 1.45 (one turn 2.6): equal taus are a test
    assert mla["tau_vllm"] == pytest.approx(mla["tau_in_house"], rel=TAU_RTOL)
    assert gqa["tau_vllm"] is None and gqa["tau_in_house"] >= 1
    assert mla["kv_bytes_per_token_kimi"] < gqa["kv_bytes_per_token_kimi"]  # MLA caches less
    text = (work / "vllm.log").read_text()
    assert "Eagle3DeepseekV3ForCausalLM" in text or "Eagle3DeepseekV2ForCausalLM" in text
    assert not re.search(r"Loaded weight \S*fc_norm", text)  # EAGLE-3, not 3.1


# -- two nodes (configs/accelerate/multinode.yaml) ----------------------------------------------
def launch_node(
    rank: int, port: int, args: list[str], log: Path, config: str = "multinode.yaml"
) -> subprocess.Popen:
    """One "machine" of a two-machine accelerate launch on 127.0.0.1, one process each."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"configs/accelerate/{config}", "--num_machines", "2",
        "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(port), *args,
    ]  # fmt: skip
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(DS_ACCELERATOR="cpu"), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            for pid in descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        tails = "\n".join(log.read_text()[-2000:] for log in logs)
        raise AssertionError(f"a node did not finish in {timeout:.0f} s:\n{tails}") from None


KILL_STEPS = ["train.max_steps=8", "train.save_every=4", "optim.warmup_steps=1", "optim.lr=1e-3"]


def test_two_node_zero2_equals_one_node_and_resumes_after_a_node_is_killed(kimi):
    """configs/accelerate/multinode.yaml as two machines of one process each on 127.0.0.1
    (gloo, DeepSpeed ZeRO-2, a shared out_dir as on a shared filesystem), training the Kimi
    miniature's drafter from shards: machine 1's launcher and worker are SIGKILLed once the
    step-4 checkpoint is complete; machine 0 then fails on its next collective within seconds
    (no hang) in one line, exit 69 (gloo's "Connection closed/reset by peer" and what to do),
    and the same two commands with train.resume_from=latest continue from step 4. Every logged
    step (1-4 from the killed run, 5-8 from the resumed one) equals 2 processes on one node
    (configs/accelerate/8gpu-zero2.yaml as is: a DeepSpeedEngine), which equals one plain
    process with the same sequences per step; the checkpoints hold the same files: one model
    state, one optimizer partition and RNG state per rank, one SGLang draft and
    trainer_state.json per save (written by rank 0 alone). Measured: two nodes against one,
    losses and grad norms bit-identical (the same gloo reductions in the same order), asserted
    to rel 1e-7; ZeRO-2 against the plain process, loss 1.7e-8 and grad norm 4.0e-6 relative at
    step 1 (ZeRO-2 sums partitioned fp32 grads). Costs ~100 s (its call: a plain run, a
    one-node run, the two-node run killed after step 4 and its resume) + ~27 s of fixture setup
    (the module's kimi fixture, built on its xdist worker)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed (pip install -e '.[dev]')")
    from eagle3.engine.server import free_port

    root = kimi["root"]
    plain, one, two = root / "plain", root / "one-node", root / "two-node"
    run(*offline_args(kimi, plain, "data.batch_size=2", "optim.grad_accum=2", *KILL_STEPS))
    log = run(
        "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/8gpu-zero2.yaml",
        "--num_processes", "2", "--main_process_port", str(free_port()),
        *offline_args(kimi, one, "data.batch_size=1", "optim.grad_accum=2", *KILL_STEPS),
        DS_ACCELERATOR="cpu",
    ).stdout  # fmt: skip
    assert "on 2 process(es) (DEEPSPEED, DeepSpeedEngine)" in log
    a, b = metrics(plain), metrics(one)
    assert len(a) == len(b) == 8
    for key, rel in (("loss", 1e-6), ("acc_0", 1e-9), ("lr", 1e-9), ("grad_norm", 1e-4)):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=rel), key
    args = offline_args(kimi, two, "data.batch_size=1", "optim.grad_accum=2", *KILL_STEPS,
                        "train.resume_from=latest")  # fmt: skip
    port = free_port()
    logs = [root / f"two-node-{r}.log" for r in (0, 1)]
    nodes = [launch_node(r, port, args, logs[r]) for r in (0, 1)]
    complete = two / "checkpoints" / "step-0000004" / "trainer_state.json"
    deadline = time.monotonic() + 600
    while not complete.is_file():
        assert all(p.poll() is None for p in nodes), "\n".join(x.read_text()[-2000:] for x in logs)
        assert time.monotonic() < deadline, "no step-4 checkpoint in 600 s"
        time.sleep(0.02)
    for pid in descendants(nodes[1].pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    nodes[1].wait()
    code = nodes[0].wait(timeout=120)  # the survivor fails at once (no 30-min collective hang)
    assert code != 0, "machine 0 finished although machine 1 was killed mid-run"
    survivor = logs[0].read_text()
    # its worker's own words: one line, exit 69, naming what to do (then torchrun's summary)
    assert re.search(r"error: another process of this job stopped \(.*Connection (closed|reset) "
                     r"by peer.*train.resume_from=latest", survivor), survivor[-3000:]  # fmt: skip
    assert "exitcode: 69" in survivor and "[rank0]: Traceback" not in survivor
    assert not (two / "final").exists()

    logs = [root / f"two-node-resumed-{r}.log" for r in (0, 1)]
    assert wait_all([launch_node(r, port, args, logs[r]) for r in (0, 1)], logs) == [0, 0]
    resumed = logs[0].read_text()
    assert "on 2 process(es) (DEEPSPEED, DeepSpeedEngine)" in resumed
    assert "resuming from" in resumed and "step-0000004 (step 4)" in resumed
    a, b = metrics(one), metrics(two)
    assert [m["step"] for m in b] == list(range(1, 9))  # none lost, none twice
    for key in ("loss", "grad_norm", "acc_0", "lr"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-7), key

    def files(out: Path) -> list[str]:
        return sorted(str(p.relative_to(out)) for p in (out / "checkpoints").rglob("*"))

    assert files(two) == files(one)
    state = two / "checkpoints" / "step-0000008" / "state"
    assert len(list(state.rglob("*model_states.pt"))) == 1  # the model once, by rank 0
    assert len(list(state.rglob("*optim_states.pt"))) == 2  # ZeRO-2: one partition per rank
    assert (two / "final" / "model.safetensors").is_file()
