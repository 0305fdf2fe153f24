#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU. Extra args go to pytest, e.g.
#   bash scripts/test.sh tests/eagle3 -x -m "not slow"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
# The serving engine (vLLM, its own venv; idempotent, ~1 s when installed, ~15 min cold). Its
# tests start real servers. Without it they skip, except under CI=true, where they fail.
if ! bash scripts/install_engine.sh; then
    case "${CI:-}" in
        1|true|yes) echo "test: the engine install failed and CI=true: engine tests must run" >&2; exit 1 ;;
        *) echo "test: the engine install failed; its tests will skip (CI=true makes that an error)" >&2 ;;
    esac
fi
# zsh: the runbook's rehearsal (tests/test_kimi_runbook.py) pastes its blocks into zsh with its
# default options, as a user's login shell would. Root without it (CI's fresh machine) installs
# it; otherwise those tests skip, except under CI=true, where they fail.
if ! command -v zsh >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing zsh (apt-get) for the runbook's rehearsal"
    log="$(mktemp)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zsh; } \
        >"$log" 2>&1; then
        cat "$log" >&2
        echo "test: installing zsh failed; the runbook's rehearsal will skip (fail under CI=true)" >&2
    fi
    rm -f "$log"
fi
# .venv/bin first on PATH, as the runbook's activated shell has it: every DeepSpeed process on
# CPU then builds and loads its collective with the ninja install.sh built it with (another
# ninja finds that build out of date, and two would rebuild it in turn, ~70 s each time).
export PATH="$PWD/.venv/bin:$PATH"
# No hub and no wandb account are needed: fail fast instead of waiting on the network.
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# vLLM-CPU at one rank runs its model in the engine process (the "uni" executor, what vLLM does
# on one GPU) instead of spawning a worker process that imports torch and vLLM again: each of
# the suite's engine starts is ~8 s shorter (24 s against 31 s measured at load 3). It forces
# the worker process only while V1 multiprocessing is on (vllm/platforms/cpu.py); the API
# server and its engine process stay apart either way (AsyncLLM), and several ranks keep "mp".
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
# Two workers (TEST_WORKERS=0: one process): most tests keep one core busy (a subprocess, a
# server starting, a single-threaded training), so two at once fill a 2-core machine. Each
# worker's torch gets one thread (two threads each would compete for the same two cores).
# Files go out whole (--dist loadfile), in collection order: a module's fixtures (a vLLM
# server, a trained drafter, the runbook's run) are built once, on the file's worker. xdist's
# default order (most tests first) leaves the few-test, minutes-long files for last: 25 min
# against 23 here (results/README.md, "Setup and the test suite").
# --durations: the slowest tests in every log, to keep the suite (and CI) near 30 minutes.
workers="${TEST_WORKERS:-2}"
if [ "$workers" != 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec .venv/bin/python -m pytest -q --durations=15 -n "$workers" --dist loadfile \
    --no-loadscope-reorder "$@"
