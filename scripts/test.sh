#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU. Extra args go to pytest, e.g.
#   bash scripts/test.sh tests/eagle3 -x -m "not slow"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
# No hub and no wandb account are needed: fail fast instead of waiting on the network.
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
