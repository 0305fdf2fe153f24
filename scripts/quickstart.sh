#!/usr/bin/env bash
# The main job on the embedded default (README "Quickstart"): set up .venv (idempotent), then
# regenerate ShareGPT responses with the 4-bit SmolLM2 target, capture its hidden states, train
# an EAGLE-3 drafter and measure its acceptance length against the same target.
# Extra args go to scripts/quickstart.py (the stages), e.g. --scale large, --prompts 1000 --epochs 4.
# Run it again after an interruption: finished stages are skipped, the others resume.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/python scripts/quickstart.py "$@"
