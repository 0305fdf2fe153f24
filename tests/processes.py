"""Process trees for the tests that kill part of a run (tests import it, as tests/tiny_chat.py)."""

from __future__ import annotations

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
