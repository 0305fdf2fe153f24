"""`python -m datagen.capture --engine-url A B`: one capture shared across two REAL vLLM-CPU
capture servers (`--serve`, as one would run on each node), one writer, one index, one meta.json.

One pair of servers for the module (started with `--serve`, eagerly: ~80 s less per start on 2
cores than compiling). The shards of the two-server capture must equal the one-server capture of
the same records (through server A alone), and so must the shards of a capture whose process is
SIGKILLed mid-run and resumed, and of one whose server B is SIGKILLed mid-run (the survivor
takes its requests). Tolerance: both sides are fp32 engines on the same weights; a request's
hidden states may differ in the last fp32 bits with what else the engine batched with it, so
in bf16 shards an element is equal or one bf16 step apart (measured: see the print).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.engine.client import EngineClient
from eagle3.engine.server import free_port
from tests.datagen.test_capture_engine import QA
from tests.processes import descendants

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TARGET = "smollm2-135m-q4"
COMMON = ["--target", TARGET, "--max-length", "512", "--batch-tokens", "512"]


def records() -> list[dict]:
    """48 chat records (6 answers x 8 prompt variants): enough batches to kill a run mid-way."""
    return [
        {
            "id": f"r{k}-{i}",
            "dataset": "chat",
            "messages": [
                {"role": "user", "content": f"Question {k + 1}: {q}"},
                {"role": "assistant", "content": a},
            ],
            "finish_reason": "stop",
        }
        for k in range(8)
        for i, (q, a) in enumerate(QA)
    ]


def env() -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # fmt: skip


def kill_tree(pid: int) -> None:
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class CaptureServer:
    """`python -m datagen.capture --serve` in a subprocess: the command a node would run."""

    def __init__(self, root: Path, name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"serve-{name}.log"
        cmd = [sys.executable, "-m", "datagen.capture", "--serve", *COMMON[:4],
               "--port", str(self.port), "--engine-arg=--enforce-eager",
               "--engine-log", str(root / f"engine-{name}.log")]  # fmt: skip
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait(self, timeout: float = 900) -> None:
        ok = EngineClient(self.url).wait_healthy(time.monotonic() + timeout, alive=self._alive)
        assert ok, f"capture server {self.url} not up in {timeout:.0f} s:\n{self.log.read_text()}"

    def _alive(self) -> None:
        assert self.proc.poll() is None, f"--serve exited:\n{self.log.read_text()[-3000:]}"

    def requests(self) -> int:
        return EngineClient(self.url).requests_served()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # --serve stops its engine on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)


@pytest.fixture(scope="module")
def servers(engine, embedded_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_servers")
    pair = [CaptureServer(root, "a"), CaptureServer(root, "b")]
    try:
        for server in pair:
            server.wait()
        data = root / "records.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records()))
        yield root, data, pair
    finally:
        for server in pair:
            server.stop()
    assert "capture server for smollm2-135m-q4" in pair[0].log.read_text()
    assert not any(p != pair[0].proc.pid and Path(f"/proc/{p}").exists()
                   for p in descendants(pair[0].proc.pid)), "--serve left its engine running"  # fmt: skip


def capture(data: Path, out: Path, urls: list[str], *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "datagen.capture", *COMMON, "--data", str(data),
           "--out", str(out), "--engine-url", *urls, *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"capture failed ({proc.returncode}):\n{stderr[-3000:]}"
    return stdout + stderr


# a record per batch, a batch per shard, one request in flight: the run takes long enough to be
# killed mid-way, and every batch written is a complete shard in the index
ONE_AT_A_TIME = ["--batch-tokens", "64", "--shard-mb", "0.01", "--engine-concurrency", "1"]


def indexed(out: Path) -> int:
    """Records in complete shards: lines of the writer's index part (merged at the end)."""
    return sum(len(p.read_text().splitlines()) for p in out.glob("index*.jsonl"))


def once_some_shards_are_done(proc: subprocess.Popen, out: Path) -> None:
    """Wait until the index names a complete shard (the run is under way) and the run is not."""
    deadline = time.monotonic() + 300
    while not indexed(out):
        assert proc.poll() is None, f"capture ended first:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no shard in 300 s"
        time.sleep(0.02)


def by_id(out: Path) -> dict[str, dict]:
    from eagle3.data.shards import ShardDataset

    ds = ShardDataset(out)
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 step at |x| (8 significant bits): 2^(e-8) for |x| in [2^(e-1), 2^e)."""
    _, e = torch.frexp(x.abs().float().clamp(min=1e-30))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def assert_same_capture(got_dir: Path, want_dir: Path) -> float:
    """Every record once, the same ids, tokens and mask; hidden states equal or one bf16 step
    apart -> the fraction of bit-identical elements."""
    entries = [json.loads(x) for x in (got_dir / "index.jsonl").read_text().splitlines()]
    assert len(entries) == len({e["id"] for e in entries}) == len(records())  # each exactly once
    meta = json.loads((got_dir / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == len(records())
    got, want = by_id(got_dir), by_id(want_dir)
    assert set(got) == set(want) == {r["id"] for r in records()}
    same = total = 0
    for rid, w in want.items():
        assert torch.equal(got[rid]["input_ids"], w["input_ids"])
        assert torch.equal(got[rid]["loss_mask"], w["loss_mask"])
        for key in ("aux_hidden", "last_hidden"):
            a, b = got[rid][key].float(), w[key].float()
            assert a.shape == b.shape
            tol = bf16_ulp(torch.maximum(a.abs(), b.abs()))
            assert ((a - b).abs() <= tol).all(), (rid, key, (a - b).abs().max().item())
            same += int((a == b).sum())
            total += a.numel()
    return same / total


@pytest.fixture(scope="module")
def one_server(servers) -> Path:
    """The reference: the same records through server A alone."""
    root, data, _ = servers
    finish(capture(data, root / "one", [servers[2][0].url]))
    return root / "one"


def test_multinode_capture_over_two_servers_equals_one_server(servers, one_server):
    """One capture over two `--serve` capture servers: every record goes to exactly one server (by
    their own request counts), both take a share, meta.json names the split, and the shards equal
    the one-server capture: the only capture shared across nodes. Costs ~77 s of fixture setup (the
    module's two capture servers, each starting vLLM-CPU eagerly, and the one-server reference
    capture; shared with the file's other tests) + ~25 s (its call; measured on 2 xdist workers)."""
    root, data, (a, b) = servers
    before = [a.requests(), b.requests()]
    log = finish(capture(data, root / "two", [a.url, b.url]))
    served = [a.requests() - before[0], b.requests() - before[1]]
    # the servers' own counts: every row went to one of them exactly once, both took a share
    assert sum(served) == len(records()) and min(served) > 0, served
    meta = json.loads((root / "two" / "meta.json").read_text())
    assert meta["served_by"]["servers"] == {a.url: served[0], b.url: served[1]}
    assert f"captured {len(records())} records in this run" in log
    same = assert_same_capture(root / "two", one_server)
    print(f"\n[capture] two servers {served}: bit-identical bf16 elements {same:.5f}")


def test_multinode_capture_resumes_after_the_capture_is_killed(servers, one_server):
    """The two-server capture SIGKILLed mid-run, then resumed against the same servers: the resume
    keeps what was indexed, captures only the rest, and the shards equal the one-server capture with
    each record once. Costs ~18 s (its call; measured on 2 xdist workers), after the module's
    servers and reference capture (~75 s, shared)."""
    root, data, (a, b) = servers
    out = root / "killed"
    proc = capture(data, out, [a.url, b.url], *ONE_AT_A_TIME)
    once_some_shards_are_done(proc, out)
    kill_tree(proc.pid)
    proc.wait()
    kept = indexed(out)
    assert 0 < kept < len(records())
    # the same command but for how many requests are in flight (that changes nothing stored)
    log = finish(capture(data, out, [a.url, b.url], *ONE_AT_A_TIME[:4]))
    assert f"{kept} already captured" in log
    assert f"captured {len(records()) - kept} records in this run" in log
    assert_same_capture(out, one_server)


def test_multinode_capture_goes_on_when_a_server_is_killed(servers, one_server):
    """Last in the module: server B stays dead. A server SIGKILLed mid-capture (the node's process
    and its engine): the capture says so, the survivor takes its requests, and the shards still
    equal the one-server capture. Costs ~12 s (its call; measured on 2 xdist workers), after the
    module's servers and reference capture (~75 s, shared)."""
    root, data, (a, b) = servers
    out = root / "server-killed"
    proc = capture(data, out, [a.url, b.url], *ONE_AT_A_TIME)
    once_some_shards_are_done(proc, out)
    kill_tree(b.proc.pid)  # the node's server process and its engine, SIGKILL
    log = finish(proc)
    assert f"the engine at {b.url} stopped answering" in log
    assert not EngineClient(b.url).healthy()
    assert_same_capture(out, one_server)


def test_multinode_capture_with_a_url_nobody_serves_is_one_line(embedded_target_dir, tmp_path):
    """No server at a URL: one line naming it, exit 69 (the other side failed), no shard. Costs ~3 s
    (its call: a capture subprocess's imports and start); slow by the module's pytestmark, it needs
    no server."""
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()[:2]))
    url = f"http://127.0.0.1:{free_port()}"
    proc = capture(data, tmp_path / "out", [url])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 69, stderr[-2000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert url in line and "Traceback" not in stderr
    assert not list((tmp_path / "out").glob("shard-*"))
