"""In-process generation speed (the `datagen.local --target` path) on the embedded target.

    python benchmarks/bench_generate.py                   # SmolLM2 Q4, batch 16, MT-bench prompts
    python benchmarks/bench_generate.py --threads 2 --prompts 64 --max-new-tokens 256

Prints aggregate tokens/s: generated tokens (up to and including each row's end-of-turn token)
over wall time, prefill included, as a run of `datagen.local` sees it, for the continuous-
batching generator and (unless --no-baseline) for transformers' `generate` over length-sorted
batches of the same prompts, and their ratio. Goal on 2 CPU cores: >= 150 tok/s. The load
average is printed too: other processes on the same cores slow it down a lot (CPU threads
spin-wait on each other), so compare runs on a quiet machine. The rate is also printed
against this machine's fp32 matmul peak, measured in the run (eagle3.compute: generated tokens
x 2 x the target's linear weights, prefill not counted), so a slow CPU and a slow path can be
told apart.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-q4")
    p.add_argument("--prompts", type=int, default=64, help="number of prompts (first user turns)")
    p.add_argument("--source", default="mt_bench", help="prompt source (eagle3.data.prompts)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", help="cpu, cuda (default: cuda when there is one)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--model-dtype", help="float32 (CPU default) or bfloat16")
    p.add_argument(
        "--baseline", action=argparse.BooleanOptionalAction, default=True, help="time generate too"
    )
    args = p.parse_args(argv)

    from datagen.generate import Generator
    from eagle3.compute import describe_peak, matmul_peak, peak_share, weight_flops_per_token
    from eagle3.data.chat import next_turns
    from eagle3.data.prompts import load_prompts
    from eagle3.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.model_dtype, device=args.device)

    def generator(pack_weights: bool) -> Generator:
        return Generator(
            target.model,
            target.tokenizer,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            batch_size=args.batch_size,
            pack_weights=pack_weights,
        )

    peak = matmul_peak(target.device)
    flops = weight_flops_per_token(target.model)
    prompts = load_prompts(args.source, limit=args.prompts)
    conversations = [next_turns(p, []) for p in prompts]  # up to the first user turn
    load_before = os.getloadavg()[0]
    base = None
    if args.baseline:  # first: packing changes the model in place
        plain = generator(pack_weights=False)
        plain.plain_cache = False  # transformers' generate, plain nn.Linear weights
        torch.manual_seed(0)
        plain.generate(conversations[: min(2, len(conversations))])  # warm-up
        t0 = time.perf_counter()
        base_turns = plain.generate(conversations)
        base = sum(t.completion_tokens for t in base_turns) / (time.perf_counter() - t0)
    gen = generator(pack_weights=True)
    torch.manual_seed(0)
    gen.generate(conversations[: min(2, len(conversations))])  # warm-up (allocations, kernels)
    t0 = time.perf_counter()
    turns = gen.generate(conversations)
    seconds = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    peak = max(peak, matmul_peak(target.device))  # before and after: neighbours come and go
    generated = sum(t.completion_tokens for t in turns)
    prefill = sum(t.prompt_tokens for t in turns)
    stopped = sum(t.finish_reason == "stop" for t in turns)
    print(
        f"target {target.name} on {target.device}, {torch.get_num_threads()} threads, "
        f"dtype {target.model.dtype}, temperature {args.temperature}"
    )
    print(
        f"{len(turns)} prompts in batches of {args.batch_size}: {prefill:,} prompt tokens, "
        f"{generated:,} generated ({stopped} stopped at end-of-turn, max {args.max_new_tokens})"
    )
    print(f"wall {seconds:.1f} s -> {generated / seconds:,.1f} generated tok/s aggregate")
    print(f"{describe_peak(peak)}; generation {peak_share(generated / seconds, flops, peak)}")
    if base is not None:
        print(
            f"transformers generate (length-sorted batches, unpacked weights), same prompts: "
            f"{base:,.1f} tok/s -> datagen.local's generator is {generated / seconds / base:.2f}x"
        )
    print(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}")


if __name__ == "__main__":
    main()
