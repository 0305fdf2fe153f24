"""eagle3.engine.capture without an engine: the connector's args, the plugin's place, and the
temp-dir sweep a SIGKILLed run relies on. (The protocol itself runs against a real vLLM server:
tests/eagle3/engine/test_server.py, tests/datagen/test_capture_engine.py,
tests/train/test_online_engine.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from eagle3.checkpoint import vllm_aux_layer_ids
from eagle3.engine.capture import (
    CAPTURE_MODULE,
    PLUGIN_DIR,
    capture_engine_args,
    hidden_dir_prefix,
    make_hidden_dir,
    remove_orphaned_hidden_dirs,
)

AUX = [1, 14, 26]  # the project's ids for SmolLM2 (its registry entry, smollm2-135m-q4.yaml)


def test_capture_args_use_our_connector(tmp_path):
    assert vllm_aux_layer_ids(AUX) == [2, 15, 27]
    args = capture_engine_args([2, 15, 27], tmp_path)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
    ]
    assert kv["kv_connector_module_path"] == CAPTURE_MODULE == "eagle3_vllm_capture"


def test_the_plugin_is_alone_on_the_engines_path():
    """The engine imports the connector from PLUGIN_DIR, which holds that module and nothing
    else: no package of this project (nor of its venv) becomes importable in the engine."""
    assert sorted(p.name for p in PLUGIN_DIR.iterdir() if p.name != "__pycache__") == [
        f"{CAPTURE_MODULE}.py"
    ]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process (until the kernel reuses it)
    return proc.pid


def test_only_this_hosts_dirs_of_dead_processes_are_removed(tmp_path):
    gone = tmp_path / f"{hidden_dir_prefix(dead_pid())}abc123"
    live = tmp_path / f"{hidden_dir_prefix(os.getpid())}def456"
    other_host = tmp_path / f"eagle3-engine-hidden-not-{os.uname().nodename}-1-xyz"
    unrelated = tmp_path / "eagle3-engine-hidden-oldstyle"  # no host or pid: not ours to judge
    for d in (gone, live, other_host, unrelated):
        d.mkdir()
        (d / "request-0.safetensors").write_bytes(b"x")

    assert remove_orphaned_hidden_dirs(tmp_path) == [gone]
    assert not gone.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
    assert remove_orphaned_hidden_dirs(tmp_path) == []


def test_a_fresh_hidden_dir_is_this_processes_and_sweeps_the_dead(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    gone = tmp_path / f"{hidden_dir_prefix(dead_pid())}abc123"
    gone.mkdir()
    made = make_hidden_dir()
    assert made.parent == tmp_path and made.name.startswith(hidden_dir_prefix(os.getpid()))
    assert not gone.exists()
