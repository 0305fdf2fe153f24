"""Process trees for the tests that kill part of a run, and commands run side by side (tests
import it, as tests/tiny_chat.py)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it. torchrun starts its workers and the engine its server
    in their own sessions, so killing a process group would leave them running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found = [pid]
    for p in found:  # grows while it is walked: breadth first
        found += children.get(p, [])
    return found


def run_at_once(commands: list[list[str]], *, cwd: Path, env: dict[str, str]) -> None:
    """Every command at once, each its own process (independent single-threaded jobs finish
    in the time of the slowest on 2 cores); fails with the stderr tail of the first that
    failed. stderr goes to files: a full pipe would block a process nobody reads yet."""
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        for cmd, log in zip(commands, logs)
    ]
    for cmd, proc, log in zip(commands, procs, logs):
        proc.wait()
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}"
