"""Wall-clock speedup of speculative over plain decoding of the same target, in one run.

    python benchmarks/bench_speculative.py [--target smollm2-135m-q4] \\
        [--draft oracle --draft prompt-lookup --draft CKPT_DIR] [--bench humaneval] \\
        [--limit 4] [--max-new-tokens 128] [--mode chain|tree] [--steps 5] [--device cpu]

Per prompt the target decodes plainly, then speculatively with each drafter (T=0), and the
script prints tau and the ratio spec tok/s / plain tok/s. `oracle` drafts the target's own
plain continuation (every draft is accepted, tau = steps + 1): the ceiling a perfect drafter
reaches with this verification loop, i.e. what speculative decoding costs when it works.
Plain decoding's rate is also printed against this machine's fp32 matmul peak (measured in the
run: eagle3.compute), so a slow CPU and a slow path can be told apart.
"""

from __future__ import annotations

import argparse
import sys

import torch

from eagle3.compute import (
    describe_peak,
    matmul_peak,
    peak_share,
    weight_flops_per_token,
)
from eagle3.decoding.decoder import SpeculativeDecoder, plain_generate
from eagle3.decoding.tree import DraftTree
from eagle3.targets import eos_token_ids


class OracleDrafter:
    """Proposes the next tokens of a known continuation (the target's own greedy output)."""

    name = "oracle"

    def __init__(self, num_tokens: int):
        self.num_tokens, self.sequence = num_tokens, []

    def reset(self) -> None:
        pass

    def update(self, tokens, aux) -> None:
        pass

    def propose(self, tokens, generator=None) -> DraftTree:
        found = self.sequence[len(tokens) : len(tokens) + self.num_tokens]
        return DraftTree(tokens=found, parents=list(range(-1, len(found) - 1)))


def main(argv: list[str] | None = None) -> int:
    from eagle3.data.chat import next_turns, prompt_ids
    from eagle3.data.prompts import load_prompts
    from eagle3.errors import Eagle3Error
    from eagle3.evaluation.measure import add_decode_args, decode_config, load_drafter
    from eagle3.targets import load_target

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-q4")
    p.add_argument(
        "--draft", action="append", default=None, help="oracle | prompt-lookup | none | CKPT_DIR"
    )
    p.add_argument("--bench", default="humaneval")
    p.add_argument("--limit", type=int, default=4)
    add_decode_args(p, steps=5, max_new_tokens=128)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = decode_config(args)
    try:
        target = load_target(args.target, device=args.device, dtype=args.dtype)
        drafters = {}
        for spec in args.draft or ["oracle", "prompt-lookup"]:
            drafters[spec] = (
                OracleDrafter(cfg.max_depth)
                if spec == "oracle"
                else load_drafter(spec, target, cfg)
            )
        prompts = load_prompts(args.bench, limit=args.limit)
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    eos = eos_token_ids(target)
    peak = matmul_peak(target.device)
    plain_tokens, plain_s = 0, 0.0
    spec = {name: [0, 0.0, 0, 0, 0] for name in drafters}  # tokens, seconds, steps, accepted, same
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = prompt_ids(target.tokenizer, next_turns(prompt, []))  # first turn only
            if i == 0:  # untimed warm-up
                plain_generate(target, ids, 8, eos_ids=eos)
            out = plain_generate(target, ids, cfg.max_new_tokens, eos_ids=eos)
            plain_tokens, plain_s = plain_tokens + len(out.tokens), plain_s + out.seconds
            for name, drafter in drafters.items():
                if isinstance(drafter, OracleDrafter):
                    drafter.sequence = ids + out.tokens
                res = SpeculativeDecoder(target, drafter, cfg, eos_ids=eos).generate(ids)
                s = spec[name]
                s[4] += res.tokens == out.tokens  # bf16 near-ties can flip an argmax; fp32 never
                s[0], s[1] = s[0] + len(res.tokens), s[1] + res.seconds
                s[2], s[3] = s[2] + res.stats.steps, s[3] + res.stats.accepted_total
    plain_tps = plain_tokens / plain_s
    peak = max(peak, matmul_peak(target.device))  # before and after: neighbours come and go
    print(
        f"target {target.name} on {target.device}, {len(prompts)} {args.bench} prompts, "
        f"{cfg.mode} (steps {cfg.steps}), plain {plain_tps:.1f} tok/s"
    )
    flops = weight_flops_per_token(target.model)
    print(f"{describe_peak(peak)}; plain decoding {peak_share(plain_tps, flops, peak)}")
    print("| drafter | τ | spec tok/s | plain tok/s | speedup | output == greedy |")
    print("|---|---|---|---|---|---|")
    for name, (tokens, seconds, steps, accepted, same) in spec.items():
        tps = tokens / seconds
        print(
            f"| {name} | {(accepted + steps) / steps:.2f} | {tps:.1f} | {plain_tps:.1f} "
            f"| {tps / plain_tps:.2f}x | {same}/{len(prompts)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
