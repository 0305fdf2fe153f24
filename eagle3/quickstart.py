"""The whole pipeline on the embedded default target, one command, resumable.

    python -m eagle3.quickstart [--run-dir runs/quickstart] [--scale tiny|default|large]
                                [--prompts N] [--epochs E] [--target smollm2-135m-q4]
                                [--engine vllm [--engine-arg=ARG ...]]

Stages, each the real CLI run as a subprocess (the exact command is printed and saved in the
run directory, so any stage can be rerun by hand):

  1. generate  python -m datagen.local        ShareGPT prompts, responses regenerated in-process
  2. capture   python -m datagen.capture      aux + final hidden states into shards
  3. train     accelerate launch train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml
  4. evaluate  python -m eagle3.evaluate      MT-bench + HumanEval, chain k=7, T=0, against the
                                              same 4-bit target: drafter vs prompt lookup vs plain;
                                              --engine vllm adds the vLLM rows ("[vllm]": the
                                              drafter served by vLLM vs plain vLLM, batch 1 and 8)

A stage that finished with the same command is skipped on the next run ("done, skipped");
one that was interrupted is rerun, and the stage's own resume logic (result store, complete
shards, `train.resume_from=latest`) keeps what it had already produced.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import Eagle3Error

REPO = Path(__file__).resolve().parents[1]
TRAIN_RECIPE = REPO / "configs" / "train" / "smollm2-q4-cpu.yaml"
MANIFEST = "manifest.json"
ABLATION = ("model.feature=last", "model.ttt_steps=1")  # EAGLE-2-style: last hidden, no TTT


@dataclass(frozen=True)
class Scale:
    prompts: int  # ShareGPT conversations to regenerate
    max_new_tokens: int  # per assistant turn
    epochs: int
    eval_limit: int  # prompts per benchmark
    eval_tokens: int  # max new tokens per evaluated turn


# Sized on 2 CPU cores (README "Quickstart" has the measured stage times).
SCALES = {
    "tiny": Scale(prompts=4, max_new_tokens=16, epochs=1, eval_limit=1, eval_tokens=12),
    "default": Scale(prompts=240, max_new_tokens=128, epochs=6, eval_limit=5, eval_tokens=96),
    "large": Scale(prompts=2000, max_new_tokens=128, epochs=3, eval_limit=5, eval_tokens=128),
}

FOLDERS = {
    "responses/": "generated conversations (eagle3.data.records format: <dataset>.jsonl, failed.jsonl)",
    "shards/": "captured hidden states (datagen.capture: meta.json, index.jsonl, shard-*.safetensors)",
    "train/": "training run: config.yaml, metrics.jsonl, checkpoints/, final/ (SGLang EAGLE-3 draft)",
    "train-eagle2/": "with --ablation: the EAGLE-2-style drafter (last hidden state, ttt_steps 1)",
    "eval.json": "acceptance-length results (eagle3.evaluate --json)",
    "logs/": "each stage's full output",
    "manifest.json": "stage status, commands and timings",
}


def wandb_group(args: argparse.Namespace, run: Path) -> str:
    return args.wandb_group or f"quickstart-{run.name}"


def train_command(args: argparse.Namespace, run: Path, out: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *(["--cpu"] if args.cpu else []),
        str(REPO / "train" / "train_drafter.py"),
        "--config",
        str(TRAIN_RECIPE),
        f"target.name={args.target}",
        f"data.shard_dirs=[{run / 'shards'}]",
        f"data.max_length={args.max_length}",
        f"train.out_dir={run / out}",
        f"train.epochs={args.epochs}",
        "train.resume_from=latest",
        f"wandb.group={wandb_group(args, run)}",
        *overrides,
        *args.train_override,
    ]


def stage_commands(args: argparse.Namespace, run: Path) -> list[tuple[str, list[str]]]:
    py = sys.executable
    group = wandb_group(args, run)
    # The ablation: same shards, recipe and steps, but EAGLE-2's recipe (the final hidden state
    # only, no training-time test); evaluated next to the EAGLE-3 drafter.
    ablation = [("train-eagle2", train_command(args, run, "train-eagle2", *ABLATION))]
    drafts = [run / "train" / "final", *([run / "train-eagle2" / "final"] if args.ablation else [])]
    return [
        (
            "generate",
            [
                py,
                "-m",
                "datagen.local",
                "--target",
                args.target,
                "--prompts",
                "sharegpt",
                "--limit",
                str(args.prompts),
                "--split",
                "train",
                "--max-turns",  # first user turn only: every extra turn is another CPU answer
                "1",
                "--max-prompt-tokens",  # ShareGPT's long tail (up to 6k tokens) crawls on a CPU
                "384",
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--temperature",
                "0",
                "--out",
                str(run / "responses"),
            ],
        ),
        (
            "capture",
            [
                py,
                "-m",
                "datagen.capture",
                "--target",
                args.target,
                "--data",
                str(run / "responses"),
                "--out",
                str(run / "shards"),
                "--max-length",
                str(args.max_length),
            ],
        ),
        ("train", train_command(args, run, "train")),
        *(ablation if args.ablation else []),
        (
            "evaluate",
            [
                py,
                "-m",
                "eagle3.evaluate",
                "--target",
                args.target,
                *[arg for d in drafts for arg in ("--draft", str(d))],
                "--draft",
                "prompt-lookup",
                "--draft",
                "none",
                "--bench",
                args.bench,
                "--mode",
                "chain",
                "--steps",
                "7",
                "--temperature",
                "0",
                "--limit",
                str(args.eval_limit),
                "--max-new-tokens",
                str(args.eval_tokens),
                "--json",
                str(run / "eval.json"),
                *(["--wandb", "--wandb-group", group] if args.wandb else []),
                *(["--engine", args.engine] if args.engine else []),
                *[f"--engine-arg={a}" for a in args.engine_arg],
            ],
        ),
    ]


def load_manifest(run: Path) -> dict:
    path = run / MANIFEST
    if not path.is_file():
        return {"stages": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"stages": {}}  # a manifest cut by a crash: stages rerun and resume themselves


def save_manifest(run: Path, manifest: dict) -> None:
    tmp = run / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, run / MANIFEST)  # never a half-written manifest


def write_readme(run: Path, commands: list[tuple[str, list[str]]]) -> None:
    lines = ["# Quickstart run", "", "What each entry is:", ""]
    lines += [f"- `{name}`: {what}" for name, what in FOLDERS.items()]
    lines += ["", "Rerun any stage by hand (from the repository root):", ""]
    for name, cmd in commands:
        lines += [f"{name}:", "", "    " + shlex.join(cmd), ""]
    (run / "README.md").write_text("\n".join(lines))


def run_stage(name: str, cmd: list[str], run: Path, env: dict[str, str]) -> float:
    """Run one stage, its output shown live and kept in logs/<name>.log; seconds taken."""
    log_path = run / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            sys.stdout.write("  " + line.decode(errors="replace"))
            sys.stdout.flush()
        code = proc.wait()
    if code != 0:
        raise StageFailed(name, code, log_path)
    return time.monotonic() - start


class StageFailed(Exception):
    def __init__(self, name: str, code: int, log: Path):
        super().__init__(f"stage {name} failed with exit code {code}; its output is in {log}")
        self.code = code


def results_table(run: Path) -> str:
    from eagle3.evaluate import format_table

    results = json.loads((run / "eval.json").read_text())["results"]
    table = format_table(results)
    tau = {(r["drafter"], r["bench"]): r["tau"] for r in results}
    ratios = [
        f"{bench} {tau[('train/final', bench)] / value:.2f}"
        for (drafter, bench), value in tau.items()
        if drafter == "train-eagle2/final" and ("train/final", bench) in tau
    ]
    if ratios:  # --ablation: the EAGLE-3 paper's own ablation reads x1.51 (LLaMA-3.1-8B)
        table += "\n\nτ EAGLE-3 / EAGLE-2-style (same data and steps): " + ", ".join(ratios)
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle3.quickstart",
        description="Generate data, capture, train and measure a drafter for the embedded target.",
    )
    p.add_argument("--run-dir", default="runs/quickstart", help="all artifacts go here")
    p.add_argument("--scale", choices=sorted(SCALES), default="default")
    p.add_argument("--target", default="smollm2-135m-q4", help="registry name, HF dir or .gguf")
    p.add_argument("--prompts", type=int, help="ShareGPT conversations (overrides --scale)")
    p.add_argument("--max-new-tokens", type=int, help="per generated turn (overrides --scale)")
    p.add_argument("--epochs", type=int, help="training epochs (overrides --scale)")
    p.add_argument("--eval-limit", type=int, help="prompts per benchmark (overrides --scale)")
    p.add_argument("--eval-tokens", type=int, help="new tokens per evaluated turn")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per training record")
    p.add_argument(
        "--bench",
        default="mt_bench,humaneval",
        help="eagle3.evaluate benchmarks, e.g. mt_bench,humaneval,gsm8k=PATH/gsm8k/test.jsonl",
    )
    switch = argparse.BooleanOptionalAction  # --x / --no-x
    p.add_argument(
        "--ablation",
        action=switch,
        default=False,
        help="also train and evaluate the EAGLE-2-style drafter (last hidden only, ttt_steps 1) "
        "on the same data and steps",
    )
    p.add_argument("--wandb", action=switch, default=True, help="log training and evaluation "
                   "to one W&B group (offline without a key)")  # fmt: skip
    p.add_argument("--wandb-group", help="default: quickstart-<run dir name>")
    p.add_argument("--cpu", action=switch, default=True, help="train on the CPU even if a GPU "
                   "is visible (the recipe is a CPU recipe)")  # fmt: skip
    p.add_argument(
        "--train-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra train_drafter.py override, e.g. optim.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--engine",
        choices=("vllm",),
        help="also evaluate the drafter served by vLLM (bash scripts/install_engine.sh first)",
    )
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra vLLM server argument, e.g. --engine-arg=--enforce-eager")  # fmt: skip
    args = p.parse_args(argv)
    scale = SCALES[args.scale]
    for field in ("prompts", "max_new_tokens", "epochs", "eval_limit", "eval_tokens"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(scale, field))
        elif getattr(args, field) < 1:
            p.error(f"--{field.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Path(args.run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    commands = stage_commands(args, run)
    write_readme(run, commands)
    manifest = load_manifest(run)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # the embedded target needs no hub; never wait on it
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"  # stage progress shows live, not when a pipe buffer fills
    if args.wandb and not env.get("WANDB_API_KEY"):
        env.setdefault("WANDB_MODE", "offline")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    print(
        f"quickstart: run directory {run} (scale {args.scale}: {args.prompts} prompts, "
        f"{args.epochs} epochs)",
        flush=True,
    )
    for i, (name, cmd) in enumerate(commands, 1):
        entry = manifest["stages"].get(name, {})
        if entry.get("status") == "done" and entry.get("command") == cmd:
            print(
                f"[{i}/{len(commands)}] {name}: done, skipped "
                f"(took {entry['seconds']:.0f} s; delete {run / MANIFEST} to redo)",
                flush=True,
            )
            continue
        print(f"[{i}/{len(commands)}] {name}: {shlex.join(cmd)}", flush=True)
        manifest["stages"][name] = {"status": "running", "command": cmd}
        save_manifest(run, manifest)
        try:
            seconds = run_stage(name, cmd, run, env)
        except StageFailed as err:
            manifest["stages"][name]["status"] = "failed"
            save_manifest(run, manifest)
            print(f"error: {err}; fix it and run the same command again to resume", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(
                f"\ninterrupted in stage {name}; run the same command again to resume",
                file=sys.stderr,
            )
            return 130
        manifest["stages"][name] = {"status": "done", "command": cmd, "seconds": seconds}
        save_manifest(run, manifest)
        print(f"[{i}/{len(commands)}] {name}: done in {seconds:.0f} s", flush=True)
    table = results_table(run)
    (run / "results.md").write_text(table + "\n")
    print("\nAcceptance length against the 4-bit target (chain k=7, T=0):\n")
    print(table)
    print(f"\nartifacts: {run} (README.md there says what each folder is)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
