"""The files in scripts/ run as scripts (`python scripts/quickstart.py`): a script's
own directory is on its sys.path, so they import each other by bare name. The tests import
them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
