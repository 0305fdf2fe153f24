"""Hidden-state capture (``python -m datagen.capture``): the target run over finished
conversations, its hidden states stored as shards. Its modules, each found by name:

- ``cli``: the command line (flags, the modes, what a run does: its docstring) and
  ``--verify``; ``settings``: one run's flags, parsed once (CaptureSettings), which every
  module reads;
- ``pipeline``: one capture, top to bottom (resume, repair, merge), with which records it
  captures and which process captures each;
- ``target``: the target, in-process or served by vLLM (``--engine``, ``--engine-url``), and
  ``--serve``; ``forward``: its forwards in batches, written to shards (capture_items);
- ``meta``: what meta.json records (settings a resume must match, the command, provenance);
  ``report``: the lengths, progress, summary and closing lines.

``--estimate`` is ``datagen.estimate``; the shard format is ``eagle3.data.shards``; records to
token ids is ``datagen.render``. Exported here: the command (main, parse_args, run), one
capture (capture), and the forwards loop that benchmarks and experiments drive directly.
"""

from datagen.capture.cli import EXIT_DAMAGED, main, parse_args, run
from datagen.capture.forward import batches, capture_items, pad
from datagen.capture.meta import capture_meta
from datagen.capture.pipeline import capture
from datagen.capture.settings import CaptureSettings

__all__ = [
    "EXIT_DAMAGED",
    "CaptureSettings",
    "batches",
    "capture",
    "capture_items",
    "capture_meta",
    "main",
    "parse_args",
    "pad",
    "run",
]
