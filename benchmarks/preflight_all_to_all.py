"""All-to-all pre-flight for sequence parallelism: time, on the node's own interconnect, the
exchange a sequence-parallel recipe makes every micro-batch, before a long run commits to it.

    torchrun --nproc_per_node 8 benchmarks/preflight_all_to_all.py --config configs/train/kimi-k2.5-offline-long.yaml

What is sent. Ulysses (eagle3/ttt_attention/sequence_parallel.py) turns each TTT step's q, k
and v of a rank's positions into a share of the heads over the whole record, and the attention
output back: four all_to_all_single calls a TTT step forward, (sp - 1) / sp of each buffer
leaving the rank, the same four again backward, and, when the recipe recomputes each TTT step
in backward (`train.recompute_ttt_steps`), the forward's four once more before them. The
buffers are the recipe's: its draft's heads and head dims (the target's shape from the
registry, no weights read), the row it packs (`data.pack_length`, else `data.max_length`) over
`train.sequence_parallel` ranks, bf16 on a GPU. This script allocates those four buffers,
exchanges them over groups of `train.sequence_parallel` ranks (NCCL on GPUs, gloo on CPUs),
once to warm up and then --repeats times, and prints the slowest rank's median seconds for one
TTT step, its bytes per second, and the projected exchange time of one micro-batch (forward,
the recomputed forward if any, and backward, every TTT step), which the training step cannot
hide: the exchange is not overlapped with compute.

A hang here (no line after "exchanging") is the PCIe peer-to-peer hang GPU-less tests cannot
show: `NCCL_P2P_DISABLE=1` in front of the same command confirms it. Exit 0 when it ran; the
numbers are for the operator (a slow link makes the long recipe slow, not wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.cli import HelpFormatter, run_main
from eagle3.errors import Eagle3Error


@dataclass(frozen=True)
class Exchange:
    """One TTT step's all-to-all buffers of one rank, in elements: q, k, v and the output."""

    heads: int
    qk_dim: int
    v_dim: int
    local_tokens: int
    sp: int

    @property
    def elements(self) -> list[int]:
        per_token = [self.qk_dim, self.qk_dim, self.v_dim, self.v_dim]  # q, k, v, output
        return [self.heads * d * self.local_tokens for d in per_token]

    def wire_bytes(self, element_size: int) -> float:
        """Bytes that leave the rank in one TTT step forward: all but its own 1/sp."""
        return sum(self.elements) * element_size * (self.sp - 1) / self.sp


def recipe_exchange(
    config: str, overrides: list[str], local_tokens: int | None
) -> tuple[Exchange, int, int]:
    """The exchange of a recipe's draft at its length and sequence-parallel size, its TTT
    steps, and the passes that exchange each step: forward and backward, and the recomputed
    forward with train.recompute_ttt_steps (3)."""
    from eagle3.draft_shapes import target_shape
    from train.config import load_config
    from train.draft import draft_config

    cfg = load_config(config, overrides, check_paths=False)
    sp = cfg.train.sequence_parallel
    if sp < 2:
        raise Eagle3Error(
            f"{config}: train.sequence_parallel is {sp}: there is no all-to-all to check "
            "(give the long recipe, or train.sequence_parallel=N)"
        )
    hf = target_shape(cfg.target.name)
    aux = cfg.target.aux_layer_ids or [1, 2, 3]  # their values do not change the shape
    draft = draft_config(cfg.model, hf, min(cfg.model.draft_vocab_size, hf.vocab_size), aux)
    v_dim = draft.v_head_dim if draft.attention == "mla" else draft.head_dim
    row = (cfg.data.packing and cfg.data.pack_length) or cfg.data.max_length
    # KV heads are repeated to the query heads where sp does not divide them
    # (sequence_parallel.py): every tensor moves at the query heads' count
    return (
        Exchange(
            heads=draft.num_attention_heads,
            qk_dim=draft.head_dim,
            v_dim=v_dim,
            local_tokens=local_tokens or -(-row // sp),
            sp=sp,
        ),
        cfg.model.ttt_steps,
        3 if cfg.train.recompute_ttt_steps else 2,
    )


def exchange_seconds(ex: Exchange, group, device: torch.device, dtype, repeats: int) -> list[float]:
    """Seconds of each repeat of one TTT step's four all-to-alls (after one warm-up)."""
    sends = [torch.ones(n, dtype=dtype, device=device) for n in ex.elements]
    recvs = [torch.empty_like(s) for s in sends]
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for send, recv in zip(sends, recvs):
            dist.all_to_all_single(recv, send, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first one sets up the communicator's buffers
            times.append(time.perf_counter() - t0)
    return times


def slowest(value: float, device: torch.device) -> float:
    """The largest value over all ranks (every rank waits for the slowest in training)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/preflight_all_to_all.py",
        description="Time the sequence-parallel all-to-all of a recipe on this node (under torchrun).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the training recipe (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    parser.add_argument(
        "--local-tokens", type=int, help="positions a rank holds (default: the recipe's row / sp)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed exchanges after one warm-up")
    parser.add_argument("--json", help="rank 0 writes the numbers here too")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    ex, ttt_steps, passes = recipe_exchange(args.config, args.overrides, args.local_tokens)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % ex.sp:
        raise Eagle3Error(
            f"{world} processes do not split into groups of train.sequence_parallel={ex.sp}: "
            f"launch with torchrun --nproc_per_node {ex.sp} (or a multiple of it)"
        )
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32  # gloo has no bf16 all-to-all everywhere
    groups = [dist.new_group(list(range(g, g + ex.sp))) for g in range(0, world, ex.sp)]
    group = groups[rank // ex.sp]
    size = torch.tensor([], dtype=dtype).element_size()
    if rank == 0:
        print(
            f"all-to-all pre-flight: {world} ranks in groups of {ex.sp} ({dist.get_backend()}), "
            f"{ex.heads} heads of {ex.qk_dim}/{ex.v_dim}, {ex.local_tokens:,} positions a rank, "
            f"{dtype}: exchanging",
            flush=True,
        )
    times = exchange_seconds(ex, group, device, dtype, args.repeats)
    step = slowest(statistics.median(times), device)
    wire = ex.wire_bytes(size)
    result = {
        **asdict(ex),
        "world": world,
        "backend": dist.get_backend(),
        "dtype": str(dtype).removeprefix("torch."),
        "ttt_steps": ttt_steps,
        "step_seconds": step,
        "step_wire_bytes": wire,
        "rank_bytes_per_second": wire / step if step > 0 else None,
        # forward, backward (the inverse exchange of the gradients) and a recomputed forward,
        # every TTT step
        "passes": passes,
        "micro_batch_seconds": passes * ttt_steps * step,
        "micro_batch_wire_bytes": passes * ttt_steps * wire,
    }
    if rank == 0:
        print(
            f"  one TTT step forward: 4 all-to-alls, {wire / 1e9:.2f} GB over the wire a rank, "
            f"median {step:.4f} s on the slowest rank ({wire / step / 1e9:.1f} GB/s a rank)\n"
            f"  one micro-batch ({ttt_steps} TTT steps, "
            f"{'forward, recomputed forward, backward' if passes == 3 else 'forward + backward'}): "
            f"{result['micro_batch_wire_bytes'] / 1e9:.1f} GB a rank, "
            f"{result['micro_batch_seconds']:.2f} s of exchange (not overlapped with compute)"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
