"""Capture overhead: `datagen.capture` tokens/s vs the bare target forward, in one run.

    python benchmarks/bench_capture.py                    # SmolLM2 Q4, ShareGPT-shaped records
    python benchmarks/bench_capture.py --dtype fp8 --records 64 --max-length 1024

The same padded batches go through three paths, interleaved over `--repeats` rounds (median
time of each, so a noisy neighbour hurts all three alike):

  model(...)     plain `target.model(input_ids, attention_mask)`: the full forward with logits
  decoder(...)   the base model only (no lm_head): what capture has to run at the least
  capture        `datagen.capture.capture_items`: aux hooks + final norm output, storage-dtype
                 conversion, copy to CPU and shard writing (safetensors, fsync) included

Goal: capture within 15% of the bare forward (ratio capture / model(...) time <= 1.15).
Capture's rate is also printed against this machine's fp32 matmul peak, measured in the run
(eagle3.compute: tokens x 2 x the decoder's linear weights), so a slow CPU and a slow path can
be told apart.

`--engine vllm` then captures the same records through a managed vLLM server
(`datagen.capture --engine vllm`'s path: token-id prompts, our connector, final norm here,
shard writing; `--engine-concurrency` requests in flight; server start-up not timed) and
prints engine / in-process capture tok/s. E.g. on CPU:
    python benchmarks/bench_capture.py --records 16 --max-length 256 --engine vllm --engine-arg=--enforce-eager
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-q4")
    p.add_argument("--records", type=int, default=32)
    p.add_argument("--source", default="sharegpt", help="prompt source (eagle3.data.prompts)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp8"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", help="cpu, cuda (default: cuda when there is one)")
    p.add_argument("--threads", type=int)
    from eagle3.engine.server import add_engine_args

    add_engine_args(p)
    p.add_argument("--engine-concurrency", type=int, default=16)
    return p.parse_args(argv)


def stand_in_records(tok, source: str, count: int, max_length: int) -> list:
    """Real prompts with a stand-in answer (the prompt's text, repeated): records of about
    `max_length` tokens, like long chat conversations."""
    from datagen.render import Item
    from eagle3.data.chat import render_conversation
    from eagle3.data.prompts import load_prompts

    items = []
    for prompt in load_prompts(source, limit=count):
        text = prompt.messages[-1]["content"] + "\n"
        answer = text * (1 + 6 * max_length // len(text))
        messages = [*prompt.messages, {"role": "assistant", "content": answer}]
        r = render_conversation(tok, messages, max_length=max_length)
        items.append(Item(prompt.id, "sharegpt", r.input_ids, r.loss_mask))
    return items


def median_times(target, items, padded, meta: dict, args) -> dict[str, float]:
    """Median seconds of the three paths over `args.repeats` interleaved rounds."""
    from datagen.capture import capture_items
    from eagle3.data.shards import ShardWriter

    @torch.no_grad()
    def full_forward():
        for ids, attn in padded:
            target.model(
                input_ids=ids.to(target.device),
                attention_mask=attn.to(target.device),
                use_cache=False,
            )

    @torch.no_grad()
    def decoder_forward():
        decoder = target.model.get_decoder()
        for ids, attn in padded:
            decoder(
                input_ids=ids.to(target.device),
                attention_mask=attn.to(target.device),
                use_cache=False,
            )

    def capture():
        with tempfile.TemporaryDirectory() as out:
            writer = ShardWriter(out, meta, args.dtype)
            capture_items(target, items, writer, args.batch_tokens)
            writer.close()

    paths = {"model(...)": full_forward, "decoder(...)": decoder_forward, "capture": capture}
    full_forward()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from datagen.capture import batches, pad
    from eagle3.compute import describe_peak, matmul_peak, peak_share, weight_flops_per_token
    from eagle3.data.shards import bytes_per_token, target_meta
    from eagle3.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, device=args.device)
    tok = target.tokenizer
    items = stand_in_records(tok, args.source, args.records, args.max_length)
    tokens = sum(len(it.input_ids) for it in items)
    padded = [pad(b, tok.pad_token_id or 0) for b in batches(items, args.batch_tokens)]
    meta = {**target_meta(target), "max_length": args.max_length}
    peak = matmul_peak(target.device)
    med = median_times(target, items, padded, meta, args)
    peak = max(peak, matmul_peak(target.device))  # before and after: neighbours come and go
    print(
        f"target {target.name} on {target.device}, {torch.get_num_threads()} threads: "
        f"{len(items)} records, {tokens:,} tokens in {len(padded)} batches, "
        f"storage {args.dtype} ({bytes_per_token(target.hidden_size, args.dtype):,} bytes/token)"
    )
    for name, seconds in med.items():
        print(f"  {name:13s} {seconds:7.2f} s  {tokens / seconds:8,.0f} tok/s")
    flops = weight_flops_per_token(target.model.get_decoder())
    print(f"{describe_peak(peak)}; capture {peak_share(tokens / med['capture'], flops, peak)}")
    print(
        f"capture / model(...) time = {med['capture'] / med['model(...)']:.3f}   "
        f"capture / decoder(...) time = {med['capture'] / med['decoder(...)']:.3f}   (goal <= 1.15)"
    )
    if args.engine:
        engine_capture(args, items, meta, tokens, med["capture"])


def engine_capture(args, items, meta, tokens: int, hf_seconds: float) -> None:
    """The same items through a managed vLLM server, timed after one warm-up request."""
    from datagen.capture import capture_items
    from eagle3.data.shards import ShardWriter
    from eagle3.engine.served_target import describe_served_target

    target = describe_served_target(args.target, concurrency=args.engine_concurrency)
    target.check_length(args.max_length, "--max-length")
    with tempfile.TemporaryDirectory() as out:
        target.start(args.max_length, tensor_parallel_size=args.tensor_parallel_size,
                     extra_args=args.engine_arg, log_path=args.engine_log)  # fmt: skip
        try:
            with ShardWriter(Path(out) / "warm", meta, args.dtype) as writer:  # one request
                capture_items(target, items[:1], writer, args.batch_tokens)
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                with ShardWriter(Path(out) / f"run{r}", meta, args.dtype) as writer:
                    capture_items(target, items, writer, args.batch_tokens)
                times.append(time.perf_counter() - t0)
        finally:
            target.stop()
    seconds = statistics.median(times)
    print(f"  {'vllm capture':13s} {seconds:7.2f} s  {tokens / seconds:8,.0f} tok/s  "
          f"({args.engine_concurrency} in flight)")  # fmt: skip
    print(f"vllm capture / in-process capture tok/s = {hf_seconds / seconds:.2f}")


if __name__ == "__main__":
    main()
