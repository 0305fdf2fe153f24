"""Hidden-state capture (``python -m datagen.capture``): the target run over finished
conversations, its hidden states stored as shards. Its modules, each found by name:

- ``cli``: the command line (flags, the modes, what a run does: its docstring);
  ``settings``: one run's flags, parsed once (CaptureSettings);
- ``pipeline``: one capture, top to bottom (resume, repair, merge); ``records``: which records
  it captures and which process captures each; ``processes``: accelerate's process state;
- ``target``: the target, in-process or served by vLLM (``--engine``, ``--engine-url``);
  ``forward``: its forwards in batches, written to shards (capture_items);
- ``meta``: what meta.json records (settings a resume must match, the command, provenance);
  ``report``: the lengths, progress, summary and closing lines;
- ``verify``: ``--verify``; ``serve``: ``--serve``; ``--estimate`` is ``datagen.estimate``.

The shard format is ``eagle3.data.shards``; records to token ids is ``datagen.render``.
"""

from datagen.capture.cli import NOT_IN_COMMAND, build_parser, command_flags, main, parse_args, run
from datagen.capture.forward import batches, capture_items, pad
from datagen.capture.meta import (
    capture_command,
    capture_meta,
    check_resumable,
    merge_provenance,
    response_origins,
)
from datagen.capture.pipeline import capture, check_disk
from datagen.capture.processes import gather_all, process_state
from datagen.capture.records import my_slice, select
from datagen.capture.report import (
    already_tokens,
    capture_progress,
    produced_line,
    report_lengths,
    summary_text,
)
from datagen.capture.serve import run_serve
from datagen.capture.settings import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_LENGTH, CaptureSettings
from datagen.capture.target import load_capture_target, start_capture_engine
from datagen.capture.verify import EXIT_DAMAGED, run_verify

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "DEFAULT_MAX_LENGTH",
    "EXIT_DAMAGED",
    "NOT_IN_COMMAND",
    "CaptureSettings",
    "already_tokens",
    "batches",
    "build_parser",
    "capture",
    "capture_command",
    "capture_items",
    "capture_meta",
    "capture_progress",
    "check_disk",
    "check_resumable",
    "command_flags",
    "gather_all",
    "load_capture_target",
    "main",
    "merge_provenance",
    "my_slice",
    "pad",
    "parse_args",
    "process_state",
    "produced_line",
    "report_lengths",
    "response_origins",
    "run",
    "run_serve",
    "run_verify",
    "select",
    "start_capture_engine",
    "summary_text",
]
