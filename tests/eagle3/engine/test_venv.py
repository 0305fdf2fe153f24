"""eagle3.engine.venv: which python runs the engine ($EAGLE3_ENGINE_PYTHON, else .venv-engine
beside the running venv, else in the working directory); no engine is started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3.engine import venv
from eagle3.engine.server import VLLMServer
from eagle3.errors import Eagle3Error


def test_missing_engine_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_ENGINE_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(Eagle3Error, match="install_engine.sh") as err:
        venv.engine_python()
    assert "\n" not in str(err.value) and "EAGLE3_ENGINE_PYTHON" in str(err.value)
    assert not venv.engine_available()
    with pytest.raises(Eagle3Error, match="install_engine.sh"):
        VLLMServer(tmp_path).start()


def make_python(root: Path) -> Path:
    python = root / ".venv-engine" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return python


def test_the_default_is_beside_the_running_venv_then_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLE3_ENGINE_PYTHON", raising=False)
    checkout = tmp_path / "checkout"
    monkeypatch.setattr(sys, "prefix", str(checkout / ".venv"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Eagle3Error, match=str(checkout / ".venv-engine")):
        venv.engine_python()  # neither exists: the error names the first place looked
    here = make_python(tmp_path)
    assert venv.engine_python() == here
    beside = make_python(checkout)
    assert venv.engine_python() == beside  # beside the venv wins over the working directory
    monkeypatch.setenv("EAGLE3_ENGINE_PYTHON", str(here))
    assert venv.engine_python() == here  # the setting wins over both
