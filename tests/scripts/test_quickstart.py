"""scripts/quickstart.py: its stages never train on what it measures, and the whole pipeline at
a tiny scale through the same entry point users type.

The end-to-end run is killed once in the middle (SIGKILL of the whole process group during
capture) and run again: the finished stage is skipped, the rest resumes, and every artifact must
be there.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import quickstart

from eagle3.data.decontaminate import BenchmarkIndex

REPO = Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def tiny_run(run_dir: Path) -> list[str]:
    script = str(REPO / "scripts" / "quickstart.py")
    return [sys.executable, script, "--scale", "tiny", "--run-dir", str(run_dir)]


def stage_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "manifest.json").read_text())["stages"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.parametrize("scale", ["default", "large"])
def test_quickstart_training_prompts_miss_its_benchmarks(scale, tmp_path, capsys):
    """The prompts the quickstart's generate stage answers (its own command, parsed and selected
    by datagen.local) share no 13-word run with MT-bench, HumanEval or GSM8K test."""
    from datagen import local

    args = quickstart.parse_args(["--scale", scale, "--run-dir", str(tmp_path)])
    cmd = dict(quickstart.stage_commands(args, tmp_path))["generate"]
    assert cmd[1:3] == ["-m", "datagen.local"]
    generate = local.parse_args(cmd[3:])
    assert generate.exclude_benchmarks == args.bench  # what the evaluate stage measures on
    prompts = local.select_prompts(generate)
    assert "--exclude-benchmarks: dropped 0 of " in capsys.readouterr().out
    assert len(prompts) > 0.9 * quickstart.SCALES[scale].prompts  # the train split of --limit
    sources = ["mt_bench", "humaneval"]
    if GSM8K_TEST.is_file():
        sources.append(f"gsm8k={GSM8K_TEST}")
    index = BenchmarkIndex.from_sources(sources)
    _, dropped = index.split(prompts)
    assert dropped == [], [p.id for p in dropped]


@pytest.mark.parametrize("scale", ["default", "large"])
def test_quickstart_offpolicy_conversations_miss_its_benchmarks(scale, tmp_path, capsys):
    # --offpolicy 2000: as many conversations as --scale large regenerates
    """The off-policy stage trains on ShareGPT's own answers too: its selected conversations,
    answers included, share no 13-word run with MT-bench, HumanEval or GSM8K test."""
    from datagen import offpolicy

    argv = ["--scale", scale, "--run-dir", str(tmp_path), "--offpolicy", "2000"]
    args = quickstart.parse_args(argv)  # the stage is off by default (results/README.md: data mix)
    cmd = dict(quickstart.stage_commands(args, tmp_path))["offpolicy"]
    assert cmd[1:3] == ["-m", "datagen.offpolicy"]
    stage = offpolicy.parse_args(cmd[3:])
    assert stage.exclude_benchmarks == args.bench
    pairs = offpolicy.select(stage)
    assert "--exclude-benchmarks: dropped 0 of " in capsys.readouterr().out
    assert len(pairs) > 0.9 * 2000
    sources = ["mt_bench", "humaneval"]
    if GSM8K_TEST.is_file():
        sources.append(f"gsm8k={GSM8K_TEST}")
    index = BenchmarkIndex.from_sources(sources)
    leaked = [p.id for p, conversation in pairs if index.hit(conversation)]
    assert leaked == []


def test_quickstart_evaluates_chain_tree_and_prompt_lookup_against_one_plain_run(tmp_path):
    """One evaluate stage measures the drafter as a chain of the trained depth and as the tree
    (topk 4, that depth, 16 tokens) next to prompt lookup; --no-tree drops the tree, and the
    EAGLE-2-style ablation is measured as a chain only."""
    from eagle3 import evaluate
    from eagle3.evaluation.measure import decode_config, drafter_name

    def evaluate_args(*argv: str):
        args = quickstart.parse_args(["--run-dir", str(tmp_path), *argv])
        cmd = dict(quickstart.stage_commands(args, tmp_path))["evaluate"]
        assert cmd[1:3] == ["-m", "eagle3.evaluate"]
        return evaluate.build_parser().parse_args(cmd[3:])

    final = str(tmp_path / "train" / "final")
    stage = evaluate_args()
    assert [drafter_name(d) for d in stage.draft] == [
        "train/final",
        "train/final [tree]",
        "prompt-lookup",
    ]
    assert stage.draft[:2] == [final, f"tree:{final}"]
    cfg = decode_config(stage)
    assert (cfg.mode, cfg.steps, cfg.topk, cfg.depth, cfg.total_tokens) == ("chain", 4, 4, 4, 16)
    cfg = decode_config(evaluate_args("--train-override", "model.ttt_steps=3"))
    assert (cfg.steps, cfg.depth) == (3, 3)  # both follow the depth trained
    stage = evaluate_args("--no-tree", "--ablation")
    assert stage.draft == [final, str(tmp_path / "train-eagle2" / "final"), "prompt-lookup"]


def test_quickstart_table_splits_turns_and_says_what_the_speedups_mean(tmp_path):
    from eagle3.decoding.acceptance import AcceptanceStats
    from eagle3.decoding.decoder import Generation
    from eagle3.evaluation.measure import Tally
    from eagle3.evaluation.report import result_row

    def tally(accepted_per_turn: list[int]) -> Tally:
        out = Tally()
        out.start("81")
        for accepted in accepted_per_turn:  # one verification step a turn
            stats = AcceptanceStats()
            stats.record(accepted, 4)
            out.add(Generation([0] * (accepted + 1), stats, 1.0))
        return out

    plain = Tally()
    plain.start("81")
    for tokens in (2, 4):
        plain.add(Generation([0] * tokens, AcceptanceStats(steps=tokens), 1.0))
    rows = [
        result_row(name, "mt_bench", plain, tally(turns), 4)
        for name, turns in [("train/final", [1, 1]), ("train/final [tree]", [1, 2]),
                            ("prompt-lookup", [0, 3])]
    ]  # fmt: skip
    report = {"device": "cpu", "config": {"topk": 4, "depth": 4, "total_tokens": 16}}
    (tmp_path / "eval.json").write_text(json.dumps({**report, "results": rows}))
    table = quickstart.results_table(tmp_path)
    assert table.startswith("| drafter | bench | τ |")
    assert "| prompt-lookup | mt_bench turn 2 | 4.00 |" in table
    assert "| plain | mt_bench turn 1 | 1.00 |" in table
    assert "[tree]: EAGLE-2 dynamic tree, topk 4, depth 4, 16 tokens" in table
    assert "a speedup below 1 here says nothing about a GPU engine" in table


@pytest.mark.slow
def test_quickstart_tiny_killed_then_resumed(tmp_path):
    """~2.5 min (154 s in a loaded CI-like run): the quickstart a user types, at --scale tiny,
    SIGKILLed during capture and rerun, then rerun once more and with --ablation. It alone
    proves the stages' manifest resumes a killed run (finished stages skipped, every artifact
    there once) and that a third run only reprints the table."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        tiny_run(run_dir),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while stage_status(run_dir).get("capture", {}).get("status") != "running":
        assert proc.poll() is None, "quickstart ended before reaching the capture stage"
        assert time.monotonic() < deadline, "quickstart never reached the capture stage"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert stage_status(run_dir)["generate"]["status"] == "done"

    done = subprocess.run(tiny_run(run_dir), cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "generate: done, skipped" in done.stdout
    # the console says what each stage does, where its files go and how it goes, nothing more:
    # no launcher warning, no resolved config (its file is named), no DeepSpeed or loading bar
    assert f"resolved config -> {run_dir / 'train' / 'config.yaml'}" in done.stdout
    for noise in ("were not passed", "\noptim:", "Setting accelerator", "Loading weights"):
        assert noise not in done.stdout + done.stderr, noise
    stages = stage_status(run_dir)
    names = ("generate", "offpolicy", "capture", "capture-offpolicy", "train", "evaluate")
    assert [stages[s]["status"] for s in names] == ["done"] * 6

    # Every artifact exists and parses.
    records = [json.loads(line) for line in (run_dir / "responses" / "sharegpt.jsonl").open()]
    assert len(records) == 4 and len({r["id"] for r in records}) == 4
    meta = json.loads((run_dir / "shards" / "meta.json").read_text())
    assert meta["complete"] and meta["target"] == "smollm2-135m-q4"
    index = (run_dir / "shards" / "index.jsonl").read_text().splitlines()
    assert len(index) == 4
    offpolicy = [json.loads(line) for line in (run_dir / "offpolicy" / "sharegpt.jsonl").open()]
    assert len(offpolicy) == 4 and all(r["provider"] == "offpolicy" for r in offpolicy)
    assert len((run_dir / "shards-offpolicy" / "index.jsonl").read_text().splitlines()) == 4
    provenance = json.loads((run_dir / "train" / "provenance.json").read_text())
    assert provenance["sequences"] == 8  # both shard dirs train (tiny: nothing held out)
    final = run_dir / "train" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (final / "model.safetensors").is_file()
    assert (run_dir / "train" / "metrics.jsonl").read_text().strip()
    report = json.loads((run_dir / "eval.json").read_text())
    cells = {(r["drafter"], r["bench"]) for r in report["results"]}
    assert {b for _, b in cells} == {"mt_bench", "humaneval"}
    assert len(cells) == 6  # chain, tree, prompt lookup on both (plain decoding in every row)
    assert {d for d, _ in cells} == {"train/final", "train/final [tree]", "prompt-lookup"}
    mt_bench = next(r for r in report["results"] if r["bench"] == "mt_bench")
    assert [t["turn"] for t in mt_bench["per_turn"]] == [1, 2]
    assert all(r["tau"] >= 1.0 for r in report["results"])
    table = (run_dir / "results.md").read_text()
    assert table.startswith("| drafter | bench | τ |") and table in done.stdout
    assert "| train/final [tree] | mt_bench turn 2 |" in table and "| plain | humaneval |" in table
    assert "says nothing about a GPU engine" in table
    assert "Rerun any stage by hand" in (run_dir / "README.md").read_text()

    # A third run skips everything and prints the same table.
    again = subprocess.run(tiny_run(run_dir), cwd=REPO, env=env, capture_output=True, text=True)
    assert again.returncode == 0
    assert again.stdout.count("done, skipped") == 6 and table in again.stdout

    # --ablation on the same run: data, capture and the EAGLE-3 training are reused; the
    # EAGLE-2-style drafter is trained on the same shards and evaluated beside it.
    ablation = subprocess.run(
        [*tiny_run(run_dir), "--ablation"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert ablation.returncode == 0, ablation.stdout[-3000:] + ablation.stderr[-3000:]
    assert ablation.stdout.count("done, skipped") == 5  # data, both captures, train
    eagle2 = json.loads((run_dir / "train-eagle2" / "final" / "config.json").read_text())
    assert eagle2["feature"] == "last"
    report = json.loads((run_dir / "eval.json").read_text())
    drafters = {r["drafter"] for r in report["results"]}
    assert {"train/final", "train/final [tree]", "train-eagle2/final", "prompt-lookup"} == drafters
    table = (run_dir / "results.md").read_text()
    assert "τ EAGLE-3 / EAGLE-2-style (same data and steps): mt_bench " in table


def test_quickstart_method_is_one_value_with_its_own_run(tmp_path):
    """--method eagle3.1 trains model.draft.method=eagle3.1 in train-eagle3.1/ (a first run of
    eagle3 in train/ is never resumed as another layer) and evaluates that drafter; the
    EAGLE-2-style ablation stays plain EAGLE-3 (~0.1 s)."""
    args = quickstart.parse_args(["--run-dir", str(tmp_path), "--method", "eagle3.1", "--ablation"])
    stages = dict(quickstart.stage_commands(args, tmp_path))
    train = stages["train"]
    assert "model.draft.method=eagle3.1" in train
    assert f"train.out_dir={tmp_path / 'train-eagle3.1'}" in train
    assert str(tmp_path / "train-eagle3.1" / "final") in stages["evaluate"]
    assert stages["train-eagle2"][-1] == "model.draft.method=eagle3"
    default = dict(
        quickstart.stage_commands(quickstart.parse_args(["--run-dir", str(tmp_path)]), tmp_path)
    )
    assert "model.draft.method=eagle3" in default["train"]
    assert f"train.out_dir={tmp_path / 'train'}" in default["train"]
    peagle = quickstart.parse_args(["--run-dir", str(tmp_path), "--method", "p-eagle"])
    evaluate = dict(quickstart.stage_commands(peagle, tmp_path))["evaluate"]
    assert not any(arg.startswith("tree:") for arg in evaluate)  # chains only


def test_quickstart_launch_warns_of_nothing_and_adds_no_traceback_to_an_error(tmp_path):
    """The train stage's `accelerate launch` passes every value accelerate would otherwise
    default and list in a warning, and on the recipe's `error:` line (exit 2) the launcher adds
    no traceback of its own: its whole output is that line (9.5 s measured beside other
    jobs on 2 cores: the launcher's imports and a child that only fails; OMP_NUM_THREADS unset,
    as on a user's machine)."""
    child = tmp_path / "fails.py"
    child.write_text('import sys\nprint("error: bad key", file=sys.stderr)\nsys.exit(2)\n')
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [*quickstart.launch_command(cpu=True), str(child)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1  # accelerate's, under --quiet: the stage's failure is reported
    assert proc.stdout + proc.stderr == "error: bad key\n"
