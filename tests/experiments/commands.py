"""Helpers of the tests that run an experiment's command as docs print it, at its smallest size
(tests import it, as tests/processes.py): tiny shards, the embedded recipe made tiny, the
command in a subprocess, its printed table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.captured_shards import write_captured_shards

REPO = Path(__file__).resolve().parents[2]


def tiny_recipe(target_dir: Path) -> list[str]:
    """configs/train/smollm2-q4-cpu.yaml's overrides for the tiny target: its shards' target,
    a draft vocab of 200 (of 256), batches of 2, a 1-step warm-up, no progress bar (the log is
    a file) and no wandb."""
    return [f"target.name={target_dir}", "model.draft_vocab_size=200", "data.batch_size=2",
            "optim.warmup_steps=1", "train.save_every=1000", "train.progress=false",
            "wandb.mode=disabled"]  # fmt: skip


def run_experiment(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python experiments/SCRIPT ARGS...` from the repo root, as a user types it (one torch
    thread: the tiny models are faster on one, and the suite's other worker has the other
    core). Fails with the output's tail when it exits nonzero."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, f"experiments/{script}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def capture(target, out: Path, n: int, seed: int) -> Path:
    """`n` random sequences (20-39 tokens, the first third prompt) captured through `target`
    into fp16 shards, with the meta.json fields datagen.capture writes (training checks the
    target's and the tokenizer's)."""
    from eagle3.targets import tokenizer_fingerprint

    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        T = int(torch.randint(20, 40, (1,), generator=g))
        ids = torch.randint(1, target.vocab_size, (T,), generator=g).tolist()
        mask = [0] * (T // 3) + [1] * (T - T // 3)
        records.append({"id": f"s{seed}-{i}", "input_ids": ids, "loss_mask": mask})
    return write_captured_shards(
        target, records, out, max_length=1024, sources=["test-records"],
        tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
    )  # fmt: skip


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of every markdown table row printed (its header and separator included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("|")]  # fmt: skip


def finished_arm(out: Path) -> bool:
    """What train_arm skips on a rerun: the arm's final/ and its timing."""
    final = out / "final" / "model.safetensors"
    return final.is_file() and (out / "bench_seconds.json").is_file()


def rerun_in_process(main, argv: list[str], monkeypatch, capsys) -> str:
    """The same command again, in this process (its imports are loaded: <1 s, where a new
    process costs seconds) and with subprocesses refused: a resumable experiment whose stages
    all finished trains and evaluates nothing again. -> what it printed."""

    def refuse(cmd, *args, **kwargs):
        raise AssertionError(f"a finished stage ran again: {cmd}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    capsys.readouterr()
    assert main(argv) in (0, None)
    return capsys.readouterr().out
