"""Training fixtures: token records and captured shards of the tiny random Llama target.

The recipe runs as a real CLI (`python train/train_drafter.py ...`) in a subprocess, with W&B
disabled, on records of 24 random sequences (lengths 20-59, the first third is "prompt").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.captured_shards import write_captured_shards
from tests.processes import descendants

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "train" / "train_drafter.py"
NUM_RECORDS = 24


def make_records(n: int = NUM_RECORDS, vocab: int = 256, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        T = int(torch.randint(20, 60, (1,), generator=g))
        ids = torch.randint(1, vocab, (T,), generator=g).tolist()
        prompt = T // 3
        records.append(
            {"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * (T - prompt)}
        )
    return records


@pytest.fixture(scope="session")
def records_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("records") / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    return path


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory, tiny_llama_dir, records_file) -> Path:
    """The records captured through the tiny target into fp16 shards (eagle3.data.shards format)."""
    from eagle3.targets import load_target

    target = load_target(tiny_llama_dir, device="cpu")
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    out = tmp_path_factory.mktemp("shards")
    return write_captured_shards(target, records, out, max_length=2048, sources=["test-records"])


@pytest.fixture(scope="session")
def online_run(tmp_path_factory, tiny_llama_dir, records_file) -> Path:
    """The small recipe (common_args) trained online on records_file, once a session (~10 s):
    the online side of test_train_drafter's offline/online pair, test_vocab's fine-tune start
    and test_errors' existing run. Tests only read it (a run refused at its out_dir writes
    nothing there)."""
    out = tmp_path_factory.mktemp("online_run") / "online"
    run_cli(common_args(tiny_llama_dir, out, **online(records_file)))
    return out


def common_args(target_dir: Path, out_dir: Path, **extra) -> list[str]:
    """A small, fast recipe: vocab 200 of 256, 7 TTT steps, warmup 2, log every step."""
    values = {
        "target.name": str(target_dir),
        "model.draft_vocab_size": 200,
        "optim.warmup_steps": 2,
        "optim.lr": 1e-3,
        "train.out_dir": str(out_dir),
        "train.log_every": 1,
        "train.max_steps": 6,
        "train.save_every": 100,
        "wandb.mode": "disabled",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def offline(shard_dir: Path) -> dict:
    return {"data.mode": "offline", "data.shard_dirs": f"[{shard_dir}]"}


def online(records_file: Path) -> dict:
    return {"data.mode": "online", "data.records": f"[{records_file}]"}


def env() -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_cli(args: list[str], launcher: list[str] | None = None, check: bool = True):
    cmd = (launcher or [sys.executable]) + [str(SCRIPT), *args]
    # own session: a timeout kills torchrun's workers too, not just the launcher
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # the whole tree: torchrun's workers sit in their own sessions, out of the launcher's
        # group, and hold its pipes open (communicate would then wait for them forever)
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out:\n{stderr[-3000:]}") from None
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def metric_lines(out_dir: Path, split: str | None = None) -> list[dict]:
    """metrics.jsonl lines: training ones (no "split") or those of `split` ("val")."""
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split]


def losses(out_dir: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in metric_lines(out_dir)]


@pytest.fixture(scope="session")
def helpers():
    """This module's helpers (tests cannot import conftest under --import-mode=importlib); for
    module- and session-scoped fixtures too."""
    return sys.modules[__name__]
