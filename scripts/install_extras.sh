#!/usr/bin/env bash
# Idempotent install of the project's optional extras into .venv (after scripts/install.sh):
#   bash scripts/install_extras.sh kimi,gpu     # the GPU node: Kimi's loaders and DeepSpeed
# Installs only when a requirement of the named extras is missing or at a version they exclude,
# read from the installed project's own metadata: a second run, or a .venv whose [dev] extra
# already holds them (CI), asks no package index (~0.5 s).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/install_extras.sh EXTRA[,EXTRA...] (e.g. kimi,gpu)" >&2
    exit 2
fi
extras="$1"
if [ ! -x .venv/bin/python ]; then
    echo "install-extras: no .venv here: run bash scripts/install.sh first" >&2
    exit 2
fi

missing="$(.venv/bin/python - "$extras" <<'EOF'
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

extras = sys.argv[1].split(",")
requirements = [Requirement(r) for r in metadata.requires("eagle3-forge") or []]
known = {e for r in requirements if r.marker for e in extras if r.marker.evaluate({"extra": e})}
if set(extras) - known:
    print(f"install-extras: no extra {sorted(set(extras) - known)} in pyproject.toml", file=sys.stderr)
    sys.exit(2)
for r in requirements:
    if r.marker and any(r.marker.evaluate({"extra": e}) for e in extras):
        try:
            installed = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not r.specifier.contains(installed, prereleases=True):
            print(f"{r.name}{r.specifier} (have {installed or 'none'})")
EOF
)"
if [ -z "$missing" ]; then
    exit 0
fi
echo "install-extras: [$extras] into .venv: $(echo "$missing" | paste -sd, -)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
source scripts/retry.sh  # quiet, loud on error, a cut-short download tried again
quiet_retry install-extras "$log" .venv/bin/python -m pip install --disable-pip-version-check \
    -e ".[$extras]"
echo "install-extras: done"
