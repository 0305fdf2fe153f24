"""scripts/install.sh against a pip that fails as a package index can: a download cut short is
tried again, anything else stops at once with pip's own output (~0.2 s: a fake pip, no network).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CUT_SHORT = """\
ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.
    setuptools>=68 from https://files.pythonhosted.org/packages/setuptools-84.2.1-py3-none-any.whl:
        Expected sha256 ca140b45
             Got        faec47e9
"""
NO_SUCH_VERSION = "ERROR: No matching distribution found for torch==2.13.0\n"


def install(tmp_path: Path, failures: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run install.sh in a copy of the checkout whose .venv python is a fake: its first
    `pip install` calls print `failures` in turn and exit 1, the rest succeed (and its
    DeepSpeed build fails where a file build_fails is in the copy)."""
    (tmp_path / "scripts").mkdir()
    for name in ("scripts/install.sh", "scripts/retry.sh", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    for i, text in enumerate(failures):
        (tmp_path / f"failure{i}").write_text(text)
    python = tmp_path / ".venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'cd "{tmp_path}"\n'
        'echo "$*" >> calls\n'
        'case "$*" in *build_shm_op*)\n'
        '    [ -f build_fails ] && { echo "c++: not found"; exit 1; } ;;\n'
        "esac\n"
        "n=$(wc -l < calls); f=failure$((n - 1))\n"
        'if [ -f "$f" ]; then cat "$f"; exit 1; fi\n'
    )
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", "scripts/install.sh"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "INSTALL_RETRY_PAUSE": "0"},
        timeout=60,
    )
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return done, calls


def test_a_download_cut_short_is_tried_again(tmp_path):
    done, calls = install(tmp_path, [CUT_SHORT, CUT_SHORT])
    assert done.returncode == 0, done.stderr
    # torch twice cut short, then torch, the project and the assets; then (the fake torch has
    # no GPU) DeepSpeed's CPU collective, built once here instead of in the first ZeRO-2 run
    pips, rest = calls[:5], calls[5:]
    assert all("-m pip install" in c for c in pips) and pips[:3] == [pips[0]] * 3, calls
    assert "torch==2.13.0" in pips[0] and "-e .[dev,assets]" in pips[3]
    assert "cuda.is_available()" in rest[0] and "build_shm_op()" in rest[1] and len(rest) == 2
    retries = [line for line in done.stderr.splitlines() if "a download failed" in line]
    assert len(retries) == 2 and "attempt 1 of 3" in retries[0] and "attempt 2 of 3" in retries[1]
    assert "DO NOT MATCH THE HASHES" in retries[0]
    assert (tmp_path / ".venv/.eagle3-installed").exists()


def test_a_failure_of_another_kind_stops_at_once_with_pips_output(tmp_path):
    done, calls = install(tmp_path, [NO_SUCH_VERSION])
    assert done.returncode == 1 and len(calls) == 1
    assert NO_SUCH_VERSION.strip() in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("install: FAILED: .venv/bin/python")
    assert "a download failed" not in done.stderr
    assert not (tmp_path / ".venv/.eagle3-installed").exists()


def test_a_network_that_keeps_failing_stops_after_three_tries(tmp_path):
    done, calls = install(tmp_path, [CUT_SHORT] * 3)
    assert done.returncode == 1 and len(calls) == 3
    assert done.stderr.count("a download failed") == 2
    assert "install: FAILED" in done.stderr and "Expected sha256" in done.stderr
    assert not (tmp_path / ".venv/.eagle3-installed").exists()


def test_a_failed_collective_build_warns_and_the_install_still_finishes(tmp_path):
    """A machine without a C++ compiler: DeepSpeed's CPU collective does not build; the install
    says so in a warning line (with the build's own output) and finishes, stamp written."""
    (tmp_path / "build_fails").touch()
    done, calls = install(tmp_path, [])
    assert done.returncode == 0, done.stderr
    assert "c++: not found" in done.stderr
    assert "install: warning: that build failed; ZeRO-2 on CPU will try it again" in done.stderr
    assert (tmp_path / ".venv/.eagle3-installed").exists()
