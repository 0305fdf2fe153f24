"""eagle3.served_target without an engine: the temp-dir sweep a SIGKILLed run relies on.
(The served target itself is tested against a real vLLM server: tests/datagen/test_capture_engine.py,
tests/train/test_online_engine.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from eagle3.served_target import hidden_dir_prefix, remove_orphaned_hidden_dirs


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
