"""`python -m eagle3.evaluate` on the tiny random target with a chat tokenizer."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import save_draft
from eagle3.data.decontaminate import parse_benches
from eagle3.errors import Eagle3Error
from eagle3.evaluation.measure import drafter_name
from eagle3.evaluation.run import main
from eagle3.methods import from_target_config
from eagle3.model import Eagle3Draft

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


pytestmark = pytest.mark.usefixtures("one_thread")


def make_ckpt(
    target_dir: Path, out: Path, aux=(1, 3, 4), vocab: int = 256, hidden: int = 64
) -> Path:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target_dir)
    hf.vocab_size, hf.hidden_size = vocab, hidden
    cfg = from_target_config(hf, 200, list(aux))
    return save_draft(Eagle3Draft(cfg), out, extra_config={"target": "tiny-llama"})


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "mine.jsonl"
    records = [
        {"id": "a", "turns": ["hello what is 2 + 3 ?", "tell me a joke"]},  # MT-bench shape
        {"id": "b", "prompt": "write code def add two numbers"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_parse_benches():
    assert parse_benches("mt_bench,humaneval") == [
        ("mt_bench", "mt_bench"),
        ("humaneval", "humaneval"),
    ]
    assert parse_benches("gsm8k=/x/test.jsonl") == [("gsm8k", "/x/test.jsonl")]
    with pytest.raises(Eagle3Error, match="gsm8k=PATH/gsm8k/test.jsonl"):
        parse_benches("gsm8k")
    with pytest.raises(Eagle3Error, match="unknown benchmark 'nope'"):
        parse_benches("nope")
    if GSM8K.is_file():  # a generic file stem takes its directory's name
        assert parse_benches(str(GSM8K)) == [("gsm8k", str(GSM8K))]
    assert drafter_name("/runs/exp1/final") == "exp1/final"
    assert drafter_name("prompt-lookup") == "prompt-lookup"


def test_a_drafter_trained_on_another_tokenizers_ids_is_refused(
    chat_target_dir, prompts_file, tmp_path, capsys
):
    """~1 s. A checkpoint whose config.json records another tokenizer fingerprint than the
    target's tokenizer loaded here: one line, exit 2, before any decoding."""
    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    config = json.loads((ckpt / "config.json").read_text())
    config["extra_config"]["tokenizer_fingerprint"] = "0123456789abcdef"
    (ckpt / "config.json").write_text(json.dumps(config))
    argv = ["--target", str(chat_target_dir), "--device", "cpu", "--draft", f"tree:{ckpt}",
            "--bench", f"mine={prompts_file}", "--limit", "1", "--max-new-tokens", "4"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: the training data of drafter tree:{ckpt} were tokenized "
                              "by another tokenizer (fingerprint 0123456789abcdef)")  # fmt: skip
    assert "evaluate: " not in "\n".join(err)  # nothing decoded


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_evaluate_cli_reports_every_drafter_and_benchmark(
    mode, chat_target_dir, prompts_file, tmp_path, capsys
):
    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    benches = f"mine={prompts_file}"
    if GSM8K.is_file():
        benches += f",gsm8k={GSM8K}"
    out = tmp_path / "eval.json"
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu",
        "--draft", str(ckpt), "--draft", "prompt-lookup,none",
        "--bench", benches, "--limit", "2", "--max-new-tokens", "10",
        "--mode", mode, "--steps", "3", "--topk", "3", "--total-tokens", "10", "--depth", "3",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    table = captured.out
    assert table.splitlines()[0].startswith("| drafter | bench | τ | τ 95% CI | α1 | α2 | α3 |")
    # progress: every turn (prompt a has two) decoded plainly and by each of the 3 drafters
    decodes = 4 * (3 + (2 if GSM8K.is_file() else 0))
    benches_n = 1 + GSM8K.is_file()
    assert (
        f"evaluate: 0/{decodes} decodes (0%), eta -; plain + 3 drafters on {benches_n} benchmarks"
        in captured.err
    )
    assert f"evaluate: {decodes}/{decodes} decodes (100%) in " in captured.err
    names = "gsm8k 2 prompts, mine 2 prompts" if GSM8K.is_file() else "mine 2 prompts"
    assert table.splitlines()[-1] == (
        f"evaluate: {3 * benches_n} rows, 3 drafters x {benches_n} benchmarks ({names}) -> {out}"
    )
    report = json.loads(out.read_text())
    rows = {(r["drafter"], r["bench"]): r for r in report["results"]}
    expected_benches = ["mine"] + (["gsm8k"] if GSM8K.is_file() else [])
    assert set(rows) == {
        (d, b) for d in ("exp/final", "prompt-lookup", "none") for b in expected_benches
    }
    mine = rows[("exp/final", "mine")]
    assert mine["prompts"] == 2 and mine["turns"] == 3  # both MT-bench-style turns were answered
    assert mine["tokens"] == mine["plain_tokens"] == 30  # T=0: the same tokens, 10 per turn
    assert len(mine["alpha"]) == 3 and mine["tau"] >= 1 and mine["speedup"] > 0
    assert rows[("none", "mine")]["tau"] == 1.0 and rows[("none", "mine")]["alpha"] == []
    # per prompt (both turns of "a" together) and the interval bootstrapped over them
    assert [p["id"] for p in mine["per_prompt"]] == ["a", "b"]
    assert sum(p["steps"] for p in mine["per_prompt"]) == mine["verify_steps"]
    assert sum(p["tokens"] for p in mine["per_prompt"]) == mine["tokens"]
    accepted = sum(p["accepted"] for p in mine["per_prompt"])
    assert mine["tau"] == pytest.approx((accepted + mine["verify_steps"]) / mine["verify_steps"])
    lo, hi = mine["tau_ci95"]
    assert lo <= mine["tau"] <= hi
    assert min(p["tau"] for p in mine["per_prompt"]) <= lo and hi <= max(
        p["tau"] for p in mine["per_prompt"]
    )
    lo, hi = mine["speedup_ci95"]
    assert 0 < lo <= hi
    assert rows[("none", "mine")]["tau_ci95"] == [1.0, 1.0]  # tau = 1 on every prompt
    assert f"| {mine['tau']:.2f} | [{mine['tau_ci95'][0]:.2f}, " in table
    assert report["config"]["mode"] == mode and report["target"] == chat_target_dir.name


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(aux=(1, 3, 9)), r"aux layers \[1, 3, 9\] outside the target's 8 layers"),
        (dict(vocab=300), "vocab 300 vs the target's 256"),
        (dict(hidden=32), "target hidden size 32 vs 64"),
    ],
)
def test_drafter_for_another_target_is_refused(
    change, message, chat_target_dir, prompts_file, tmp_path, capsys
):
    ckpt = make_ckpt(chat_target_dir, tmp_path / "other", **change)
    argv = [
        "--target",
        str(chat_target_dir),
        "--device",
        "cpu",
        "--draft",
        str(ckpt),
        "--bench",
        str(prompts_file),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # above it: HF's loading bar
    assert err.startswith("error: drafter ")
    assert "trained for tiny-llama" in err
    import re

    assert re.search(message, err), err


def test_drafter_on_non_default_aux_layers_is_evaluated_on_its_own_layers(
    chat_target_dir, prompts_file, tmp_path, capsys
):
    """A drafter trained on aux ids other than the target's default (here [0, 2, 6] vs the
    default [1, 3, 4]) is evaluated, and the decoder feeds it exactly those layers' outputs."""
    from eagle3.decoding.decode_config import DecodeConfig
    from eagle3.decoding.decoder import SpeculativeDecoder
    from eagle3.evaluation.measure import load_drafter
    from eagle3.targets import load_target

    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final", aux=(0, 2, 6))
    target = load_target(chat_target_dir, device="cpu")
    assert target.aux_layer_ids == [1, 3, 4]
    cfg = DecodeConfig(steps=2, max_new_tokens=6)
    drafter = load_drafter(str(ckpt), target, cfg)
    decoder = SpeculativeDecoder(target, drafter, cfg)
    assert decoder.aux_ids == [0, 2, 6]
    seen: list[torch.Tensor] = []
    update = drafter.update
    drafter.update = lambda tokens, aux: (seen.append(aux), update(tokens, aux))[1]
    prompt = [1, 5, 9, 12, 7]
    decoder.generate(prompt)
    with torch.no_grad():
        hs = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in (0, 2, 6)], dim=-1)  # outputs of layers 0, 2, 6
    assert torch.allclose(seen[0], want, atol=1e-5)
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu", "--draft", str(ckpt),
        "--bench", str(prompts_file), "--limit", "1", "--max-new-tokens", "4", "--steps", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "| exp/final | " in capsys.readouterr().out


def test_wandb_offline_logs_to_the_training_run_and_compare_reads_it(
    chat_target_dir, prompts_file, tmp_path, monkeypatch, capsys
):
    from eagle3.evaluation.side_by_side import main as compare_main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "exp"  # looks like a training out_dir: run id + config.yaml
    ckpt = make_ckpt(chat_target_dir, run_dir / "final")
    (run_dir / "wandb_run_id").write_text("abc123")
    (run_dir / "config.yaml").write_text("wandb:\n  project: p1\n  group: g1\n")
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu", "--draft", str(ckpt),
        "--bench", str(prompts_file), "--limit", "1", "--max-new-tokens", "4", "--steps", "2", "--wandb",
    ]  # fmt: skip
    assert main(argv) == 0
    logged = list((run_dir / "wandb").rglob("eagle3_eval.json"))
    assert logged and "abc123" in str(logged[0])
    capsys.readouterr()
    assert compare_main([str(run_dir / "wandb"), "--out", str(tmp_path / "cmp")]) == 0
    assert "| exp/final | " in capsys.readouterr().out
    assert (tmp_path / "cmp" / "tau.png").is_file() and (
        tmp_path / "cmp" / "acceptance.png"
    ).is_file()


@pytest.mark.parametrize("failure", ["disabled", "init raises"])
def test_wandb_never_costs_the_results(
    chat_target_dir, prompts_file, tmp_path, monkeypatch, capsys, failure
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if failure == "disabled":
        monkeypatch.setenv("WANDB_MODE", "disabled")
    else:
        import wandb

        monkeypatch.setenv("WANDB_MODE", "offline")

        def broken_init(**kwargs):
            raise RuntimeError("wandb backend is gone")

        monkeypatch.setattr(wandb, "init", broken_init)
    run_dir = tmp_path / "exp"
    ckpt = make_ckpt(chat_target_dir, run_dir / "final")
    (run_dir / "wandb_run_id").write_text("abc123")
    out_json = tmp_path / "eval.json"
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu", "--draft", str(ckpt),
        "--bench", str(prompts_file), "--limit", "1", "--max-new-tokens", "4", "--steps", "2",
        "--wandb", "--json", str(out_json),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out_json.read_text())
    assert [r["drafter"] for r in report["results"]] == ["exp/final"]
    assert "| exp/final | " in capsys.readouterr().out


def test_module_entry_point_prints_usage():
    out = subprocess.run(
        [sys.executable, "-m", "eagle3.evaluate", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0 and "--total-tokens" in out.stdout


def test_engine_only_needs_the_engine(chat_target_dir, prompts_file, capsys):
    argv = ["--target", str(chat_target_dir), "--draft", "prompt-lookup",
            "--bench", str(prompts_file), "--engine-only"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --engine-only needs --engine vllm (it keeps only the engine's rows)"


def test_engine_only_loads_no_weight_and_tells_the_engine_its_context(
    chat_target_dir, prompts_file, tmp_path, monkeypatch
):
    """--engine-only (a 1T target): the tokenizer, config and generation config, never the
    weights; the drafter is checked against the config; every server gets --max-model-len
    from the prompts and the new tokens. (~1 s: the engine is a stand-in recording its calls.)"""
    import eagle3.evaluation.measure as measure
    import eagle3.evaluation.run as evaluation_run

    def no_weights(*args, **kwargs):
        raise AssertionError("--engine-only loaded the target's weights")

    monkeypatch.setattr(evaluation_run, "load_target", no_weights)
    monkeypatch.setattr(evaluation_run, "load_drafter", no_weights)
    monkeypatch.setattr(evaluation_run, "check_servable", lambda *a: None)
    started = []

    class Engine:  # what managed_engine returns, recorded instead of started
        startup_seconds, log_path, serving = 0.0, None, argparse.Namespace(describe=str)

        def __init__(self, engine, model, **kwargs):
            started.append((engine, model, kwargs))

        def __enter__(self):
            raise RuntimeError("recorded")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(measure, "managed_engine", Engine)
    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    argv = ["--target", str(chat_target_dir), "--draft", str(ckpt), "--bench", str(prompts_file),
            "--engine", "vllm", "--engine-only", "--max-new-tokens", "20"]  # fmt: skip
    with pytest.raises(RuntimeError, match="recorded"):
        evaluation_run.run(evaluation_run.build_parser().parse_args(argv))
    ((engine, model, kwargs),) = started
    assert engine == measure.EngineSettings(kind="vllm")  # the flags, read once by the CLI
    assert model.hf_dir == str(chat_target_dir) and kwargs["served_model_name"] == model.name
    from eagle3.data.prompts import load_prompts, user_turns
    from eagle3.targets import load_tokenizer

    tok, prompts = load_tokenizer(chat_target_dir), load_prompts(str(prompts_file))
    longest = max(len(measure.prompt_ids(tok, p.messages)) + user_turns(p) * (20 + 32)
                  for p in prompts)  # fmt: skip
    assert kwargs["max_model_len"] == longest


def test_a_target_that_cannot_fit_is_refused_before_loading(
    chat_target_dir, prompts_file, monkeypatch, capsys
):
    import eagle3.evaluation.run as evaluation_run

    monkeypatch.setattr(evaluation_run, "device_memory_bytes", lambda device: 1000)
    argv = ["--target", str(chat_target_dir), "--draft", "prompt-lookup",
            "--bench", str(prompts_file), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "GB of weights and cpu 0 GB" in err and "--engine vllm --engine-only" in err


def test_one_run_measures_a_checkpoint_as_chain_and_tree_with_rows_per_turn(
    chat_target_dir, prompts_file, tmp_path, monkeypatch, capsys
):
    """`--draft DIR --draft tree:DIR` (what the quickstart runs): one plain decoding, the chain
    of --steps and the tree of --topk/--depth/--total-tokens of the same checkpoint, each exact
    at T=0; the two-turn prompt adds rows per turn; vLLM is never asked to serve the tree."""
    from eagle3.decoding.decode_config import DecodeConfig
    from eagle3.decoding.eagle import EagleDrafter
    from eagle3.engine.server import EngineSettings
    from eagle3.evaluation.measure import engine_runs
    from eagle3.targets import load_target, resolve

    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    proposed: list[tuple[str, object]] = []
    propose = EagleDrafter.propose

    def recording(self, tokens, generator=None):
        tree = propose(self, tokens, generator)
        proposed.append((self.name, self.cfg.mode, tree))
        return tree

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    out = tmp_path / "eval.json"
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu", "--draft", str(ckpt),
        "--draft", f"tree:{ckpt}", "--draft", "prompt-lookup", "--bench", f"mine={prompts_file}",
        "--max-new-tokens", "10", "--steps", "2", "--topk", "3", "--depth", "3",
        "--total-tokens", "8", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    modes = {(name, mode) for name, mode, _ in proposed}
    assert modes == {("exp/final", "chain"), ("exp/final", "tree")}
    trees = [tree for _, mode, tree in proposed if mode == "tree"]
    assert all(len(t) <= 7 for t in trees) and any(not t.is_chain() for t in trees)
    assert all(t.is_chain() and len(t) == 2 for _, mode, t in proposed if mode == "chain")
    report = json.loads(out.read_text())
    rows = {r["drafter"]: r for r in report["results"]}
    assert list(rows) == ["exp/final", "exp/final [tree]", "prompt-lookup"]
    tree = rows["exp/final [tree]"]
    assert tree["tokens"] == tree["plain_tokens"] == rows["exp/final"]["tokens"] == 30
    assert len(tree["alpha"]) == 3 and len(rows["exp/final"]["alpha"]) == 2
    first, second = tree["per_turn"]  # prompt "a" has two turns, "b" one
    assert (first["turn"], first["prompts"], second["turn"], second["prompts"]) == (1, 2, 2, 1)
    assert first["tokens"] + second["tokens"] == tree["tokens"]
    assert "| exp/final [tree] | mine turn 2 |" in table and "| plain | mine turn 1 |" in table

    target = load_target(chat_target_dir, device="cpu")
    tree_only = {"exp/final [tree]": f"tree:{ckpt}"}
    model = resolve(chat_target_dir)
    engine = EngineSettings(kind="vllm")
    assert engine_runs(engine, model, target, [], tree_only, DecodeConfig(), (1, 8)) == []
    argv[argv.index(f"tree:{ckpt}")] = "tree:prompt-lookup"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --draft tree:prompt-lookup: tree: takes a checkpoint directory"


def test_engine_context_is_the_longest_conversation_at_most_the_targets():
    """Pure (~0.01 s): every user turn of the longest prompt plus an answer of max_new_tokens
    (and slack) per turn, capped at the target's context."""
    from eagle3.data.prompts import Prompt
    from eagle3.engine.sizing import ANSWER_SLACK, engine_context

    class Chars:  # a tokenizer of one token per character; its template joins the contents
        chat_template = "contents"

        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}

        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    one = Prompt(id="a", dataset="x", messages=[{"role": "user", "content": "x" * 10}])
    two = Prompt(id="b", dataset="x", messages=[{"role": "user", "content": "y" * 4},
                                                {"role": "user", "content": "z" * 4}])  # fmt: skip
    per_turn = 100 + ANSWER_SLACK
    assert engine_context(Chars(), [one, two], 100, None) == 8 + 2 * per_turn
    assert engine_context(Chars(), [one, two], 100, 200) == 200


def test_long_context_benchmark_reports_tau_by_context_position(chat_target_dir, tmp_path, capsys):
    """In-house on the tiny chat target, the long_context benchmark up to 300 tokens: every
    step in one context bucket, overall tau the step-weighted mean of the buckets'. ~4 s."""
    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    out = tmp_path / "eval.json"
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu",
        "--draft", str(ckpt), "--draft", "prompt-lookup,none",
        "--bench", "long_context", "--limit", "6", "--long-context-max", "300",
        "--max-new-tokens", "12", "--steps", "3", "--context-buckets", "0,200,250",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["context_buckets"] == [0, 200, 250]
    lengths = report["benchmarks"]["long_context"]
    assert lengths["prompts"] == 6 and lengths["first_turn_tokens"]["max"] <= 300
    rows = {r["drafter"]: r for r in report["results"]}
    for name in ("exp/final", "prompt-lookup"):
        row = rows[name]
        buckets = row["by_context"]
        assert sum(b["steps"] for b in buckets) == row["verify_steps"]
        weighted = sum(b["tau"] * b["steps"] for b in buckets) / row["verify_steps"]
        assert weighted == pytest.approx(row["tau"])
        assert sum(b["accepted"] for b in buckets) == sum(p["accepted"] for p in row["per_prompt"])
        assert [b["context_lo"] for b in buckets] == sorted(b["context_lo"] for b in buckets)
        assert all(len(b["alpha"]) == 3 and b["prompts"] >= 1 for b in buckets)
        for b in buckets:
            assert (
                f"| {name} | long_context | {b['label']} | {b['steps']} | {b['prompts']} |" in table
            )
    # prompts from about 300 / 32 (at least twice the template) to 300 tokens: more than one bucket
    assert len(rows["exp/final"]["by_context"]) >= 2
    assert (
        "τ by context position" in table
        and "| none | long_context |" not in table.split("τ by context position")[1]
    )


def write_records(out: Path, per_dataset: int = 12) -> Path:
    """A datagen output directory: DIR/<dataset>.jsonl, one and two answered turns."""
    out.mkdir(parents=True, exist_ok=True)
    for dataset in ("alpha", "beta"):
        with open(out / f"{dataset}.jsonl", "w") as f:
            for i in range(per_dataset):
                messages = []
                for t in range(1 + i % 2):
                    messages.append({"role": "user", "content": f"what is {i} + {t} ?"})
                    messages.append({"role": "assistant", "content": f"{i} + {t} is a number",
                                     "reasoning": ""})  # fmt: skip
                f.write(json.dumps({"id": f"{dataset}{i}", "dataset": dataset,
                                    "messages": messages}) + "\n")  # fmt: skip
    return out


def test_held_out_conversations_give_tau_per_dataset_from_their_prompts_counts(
    chat_target_dir, tmp_path, capsys
):
    """~3 s. `--held-out DIR --bench ''`: one row per dataset ("held_out/<dataset>", with
    `dataset`), each prompt a held-out record asked its last turn only; a dataset's tau is
    its prompts' counts pooled, its prompts the ones `held_out` names, all in training's
    validation split; `weakest` and the last table rank each trained drafter's datasets."""
    from eagle3.data.held_out import in_validation

    ckpt = make_ckpt(chat_target_dir, tmp_path / "exp" / "final")
    records = write_records(tmp_path / "records")
    out = tmp_path / "eval.json"
    argv = [
        "--target", str(chat_target_dir), "--device", "cpu",
        "--draft", str(ckpt), "--draft", "prompt-lookup", "--bench", "",
        "--held-out", str(records), "--held-out-prompts", "2", "--val-fraction", "0.5",
        "--val-seed", "1", "--max-new-tokens", "6", "--steps", "2", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["held_out"]["val_fraction"] == 0.5 and report["held_out"]["val_seed"] == 1
    rows = {(r["drafter"], r["bench"]): r for r in report["results"]}
    assert set(rows) == {
        (d, f"held_out/{s}") for d in ("exp/final", "prompt-lookup") for s in ("alpha", "beta")
    }
    for (_, bench), row in rows.items():
        dataset = bench.split("/")[1]
        assert row["dataset"] == dataset
        ids = [p["id"] for p in row["per_prompt"]]
        assert ids == report["held_out"]["datasets"][dataset]["ids"] and len(ids) == 2
        assert all(in_validation(i, 0.5, 1) for i in ids)
        assert all(len(p["per_turn"]) == 1 for p in row["per_prompt"])  # the last turn only
        accepted = sum(p["accepted"] for p in row["per_prompt"])
        steps = sum(p["steps"] for p in row["per_prompt"])
        assert row["tau"] == pytest.approx((accepted + steps) / steps)
        assert row["tau_ci95"][0] <= row["tau"] <= row["tau_ci95"][1]
    assert report["benchmarks"]["held_out/alpha"]["turns"] == 2
    weakest = report["weakest"]
    assert [w["drafter"] for w in weakest] == ["exp/final"] * 2  # baselines left out
    assert weakest[0]["tau"] <= weakest[1]["tau"] and weakest[1]["behind_best"] == 0
    assert "where each drafter is weakest" in table
    assert f"| exp/final | {weakest[0]['dataset']} | {weakest[0]['tau']:.2f} |" in table

    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, why in (
        (["--held-out", str(empty)], "--held-out"),
        (["--held-out", str(records), "--val-fraction", "0"], "--val-fraction must be in (0, 1]"),
    ):
        assert main([*argv[: argv.index("--held-out")], *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and why in err
