"""One capture, top to bottom: records -> token ids -> the target's forwards -> shards, resumed
where an earlier run stopped; process 0 merges the index and meta.json at the end. Here too:
which records a run captures and which process captures each, and the processes themselves
(one alone, or accelerate's under ``accelerate launch`` or torchrun)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from datagen.capture.forward import capture_items
from datagen.capture.meta import (
    capture_command,
    capture_meta,
    check_resumable,
    merge_provenance,
    response_origins,
)
from datagen.capture.report import (
    already_tokens,
    capture_progress,
    produced_line,
    report_lengths,
    summary_text,
)
from datagen.capture.settings import CaptureSettings
from datagen.capture.target import load_capture_target, start_capture_engine
from datagen.estimate import free_bytes, human_bytes
from datagen.render import Item, render_all
from eagle3.data.records import read_records
from eagle3.data.shards import ShardWriter, bytes_per_token, read_index, read_meta, repair
from eagle3.errors import Eagle3Error
from eagle3.targets import resolve

log = logging.getLogger("datagen.capture")


def process_state():
    """accelerate's process state: rank/world/barrier under `accelerate launch` or torchrun."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def gather_all(state, obj: Any) -> list[Any]:
    """`obj` of every process, in rank order (a plain list of one without a process group)."""
    if state.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * state.num_processes
    dist.all_gather_object(out, obj)
    return out


def select(records: list[dict], done: set[str], stats: Counter) -> list[dict]:
    """Records still to capture: unique ids, not already in complete shards."""
    seen: set[str] = set()
    out = []
    for record in records:
        rid = record.get("id") if isinstance(record, dict) else None
        if not isinstance(rid, str | int) or str(rid) == "":
            stats["skipped: bad record"] += 1
            continue
        rid = str(rid)
        if rid in seen:
            stats["skipped: duplicate id"] += 1
            continue
        seen.add(rid)
        if rid in done:
            stats["already captured"] += 1
            continue
        out.append(record)
    return out


def my_slice(records: list[dict], rank: int, world: int) -> list[dict]:
    """This process's records: longest first, dealt round-robin so every process gets about
    the same number of tokens. Every record goes to exactly one process."""
    order = sorted(records, key=lambda r: (-len(json.dumps(r.get("messages"))), str(r["id"])))
    return order[rank::world]


def check_disk(state, items: list[Item], hidden_size: int, s: CaptureSettings, out: Path) -> None:
    """Refuse to start (on every process alike) when all processes' tokens will not fit."""
    tokens = sum(gather_all(state, sum(len(it.input_ids) for it in items)))
    size = tokens * bytes_per_token(hidden_size, s.dtype)
    free = free_bytes(out)
    if state.process_index == 0:
        log.info(
            "capturing %s tokens (%s in %s) with %d process(es)",
            f"{tokens:,}",
            human_bytes(size),
            s.dtype,
            state.num_processes,
        )
    if free is not None and size > free and not s.no_disk_check:
        raise Eagle3Error(
            f"the capture needs about {human_bytes(size)} but {out} has {human_bytes(free)} "
            "free; free space, use --dtype fp8-aux (37.5% less than bf16, every label kept), or "
            "train online (see --estimate)"
        )


def capture(s: CaptureSettings) -> int:
    """Capture this process's share of the records; process 0 merges and prints the summary."""
    state = process_state()
    rank, world = state.process_index, state.num_processes
    out = Path(s.out)
    records = read_records(s.data)
    if s.limit is not None:
        records = records[: s.limit]
    # settings that need no model are checked before a large target loads
    check_resumable(out, {"dtype": s.dtype, "max_length": s.rendering.max_length})
    if s.engine.kind and world > 1:
        raise Eagle3Error(
            "--engine runs as one process (the engine batches and spreads the model itself); "
            "drop accelerate launch and use --tensor-parallel-size, or start a capture server "
            "per node (--serve) and pass their URLs to one capture with --engine-url"
        )
    model = resolve(s.target)
    target = load_capture_target(s, state, model)
    meta = capture_meta(target, s.dtype, s.rendering, model)
    check_resumable(out, meta)

    stats: Counter = Counter()
    with state.main_process_first():  # process 0 repairs, creates (or re-opens) the directory
        if rank == 0:  # damaged or missing shards are dropped: their records are pending again
            for problem in repair(out):
                log.warning("%s is %s: dropped, its %d record(s) are captured again",
                            out / problem.shard, problem.problem, problem.records)  # fmt: skip
                stats.update({"dropped: damaged shards": 1, "dropped: records": problem.records})
        writer = ShardWriter(
            out,
            meta,
            s.dtype,
            int(s.shard_mb * 2**20),
            part=f"{rank:03d}",
            finalize_on_close=False,
        )
    index = read_index(out)
    done = {e["id"] for e in index}
    pending = select(records, done, stats)
    state.wait_for_everyone()  # all read what is done before anyone writes: the same split
    mine = my_slice(pending, rank, world)
    lengths: list[tuple[int, int, int]] = []
    items = render_all(mine, target.tokenizer, s.rendering, stats, lengths, done)
    every = [row for part in gather_all(state, lengths) for row in part]  # all processes'
    if rank == 0:
        report_lengths(every, s.rendering)
    check_disk(state, items, target.hidden_size, s, out)
    models, providers = response_origins(mine, items)

    if target.served and items:
        start_capture_engine(s, target)
    t0 = time.monotonic()
    progress, on_batch = capture_progress(state, items, already_tokens(index, records, world))
    try:
        with writer:  # on an error or Ctrl-C, what was captured is written: re-run to resume
            captured = capture_items(target, items, writer, s.batch_tokens, on_batch)
    finally:
        target.stop()  # the engine, when one was started
        progress.close()  # how far it got, also when interrupted
    seconds = time.monotonic() - t0  # every process's own (process 0's is in its progress too)
    log.info("process %d: %d tokens in %.1f s (%.0f tok/s)",
             rank, captured, seconds, captured / max(seconds, 1e-9))  # fmt: skip

    gathered = gather_all(state, (stats, models, providers))
    state.wait_for_everyone()
    if rank == 0:
        sources = [str(Path(p).expanduser().resolve()) for p in s.data]
        served_by = None
        if target.served and target.serving:  # the managed server's dtype and backend
            served_by = {"engine": s.engine.kind, **target.serving}
        elif target.served and target.sent:  # running servers: who answered how many rows
            served_by = {"engine": "vllm", "servers": dict(sorted(target.sent.items()))}
        command = capture_command(s.flags, sources, (read_meta(out) or {}).get("sources") or [])
        stats, final = merge_provenance(out, gathered, sources, world, served_by, command)
        print(summary_text(stats, final))
        print(produced_line(out, final), flush=True)
    # a process that exits with its gloo group alive can abort in the group's destructor
    # ("terminate called without an active exception"): exit code -6 after a complete capture
    state.destroy_process_group()
    return 0
