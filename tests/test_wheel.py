"""The library installs and runs as a wheel, away from the checkout.

Builds the wheel of a copy of the sources (pip wheel, no build isolation, no index: nothing is
downloaded), installs it with --no-deps into a fresh venv whose dependencies come from the
project's .venv through one .pth path line (a path line does not run that directory's own .pth
files, so the editable install of the checkout stays out), then, from another directory:
imports eagle3 from the fresh venv, resolves the embedded target by name from the registry
shipped as package data, finds the capture plugin and the default engine python beside the
fresh venv, and runs `python -m eagle3.evaluate --help`, `python -m datagen.capture --help` and
`python -m datagen.openrouter --plan` on its default config (shipped as package data) against
the fake OpenRouter on 127.0.0.1, with no key.

Cost: ~21 s measured on 2 busy CPU cores (build ~1 s, venv ~1 s; the rest imports torch and
transformers in four runs, and the plan reads the embedded ShareGPT); no network. Marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from datagen.openrouter.fake_server import FakeServerThread

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "eagle3", "datagen", "train"]

CHECK = """
import sys
from pathlib import Path

import eagle3
from eagle3.engine.capture import CAPTURE_MODULE, PLUGIN_DIR
from eagle3.engine.venv import default_engine_python
from eagle3.targets import TARGETS_DIR, registry_names, resolve

venv = Path(sys.prefix)
assert Path(eagle3.__file__).is_relative_to(venv), eagle3.__file__
assert TARGETS_DIR.is_relative_to(venv) and "smollm2-135m-q4" in registry_names()
assert (PLUGIN_DIR / f"{CAPTURE_MODULE}.py").is_file()
assert default_engine_python() == venv.parent / ".venv-engine" / "bin" / "python"
t = resolve("smollm2-135m-q4")
assert t.name == "smollm2-135m-q4" and t.spec["aux_layer_ids"] == [1, 14, 26]
assert (Path(t.hf_dir) / "config.json").is_file()
print("wheel ok", eagle3.__file__)
"""


def run(*cmd, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """The only test of the package as installed, away from the checkout: a module, registry entry,
    plugin or default config missing from the wheel's files or package data would pass every other
    test, which imports the checkout. Costs ~6 s (its call; measured on 2 xdist workers; the module
    docstring's ~21 s was on busier cores)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "OPENROUTER_API_KEY", "OPENROUTER_BASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= {"HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    src, dist, venv, elsewhere = (tmp_path / d for d in ("src", "dist", "venv", "elsewhere"))
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".", "-w", dist,
        cwd=src, env=env)  # fmt: skip
    (wheel,) = dist.glob("eagle3_forge-*.whl")

    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    run(*pip, "--python", python, "install", "--no-deps", "--no-index", wheel,
        cwd=tmp_path, env=env)  # fmt: skip
    site = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    )  # fmt: skip
    (site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere.mkdir()
    out = run(python, "-c", CHECK, cwd=elsewhere, env=env)
    assert f"wheel ok {site}" in out.stdout, out.stdout
    help_text = run(python, "-m", "eagle3.evaluate", "--help", cwd=elsewhere, env=env).stdout
    assert "usage:" in help_text and "--engine" in help_text
    help_text = run(python, "-m", "datagen.capture", "--help", cwd=elsewhere, env=env).stdout
    assert "usage:" in help_text and "--engine" in help_text

    fake = FakeServerThread()
    url = fake.start()
    try:  # the default --config is the package's; one embedded dataset of its mix, no hub
        plan = run(python, "-m", "datagen.openrouter", "--budget", "1", "--plan", "--base-url",
                   url, "--datasets", "sharegpt", cwd=elsewhere, env=env).stdout  # fmt: skip
    finally:
        fake.stop()
    assert "providers of moonshotai/kimi-k2.5" in plan and "budget projection" in plan, plan
