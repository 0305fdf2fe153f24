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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import quickstart  # noqa: E402

from eagle3.data.decontaminate import BenchmarkIndex  # noqa: E402

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
    # --offpolicy 2000: the most the README suggests
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


@pytest.mark.slow
def test_quickstart_tiny_killed_then_resumed(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
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
    assert len(cells) == 4  # drafter and prompt lookup on both (plain decoding in every row)
    assert all(r["tau"] >= 1.0 for r in report["results"])
    table = (run_dir / "results.md").read_text()
    assert table.startswith("| drafter | bench | τ |") and table in done.stdout
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
    assert {"train/final", "train-eagle2/final", "prompt-lookup"} == drafters
    table = (run_dir / "results.md").read_text()
    assert "τ EAGLE-3 / EAGLE-2-style (same data and steps): mt_bench " in table
