"""One rank of the sequence-parallel exactness check (tests/train/test_sequence_parallel.py).

    python tests/train/sequence_parallel_worker.py RANK WORLD PORT OUT.json

Every rank builds the same tiny drafts and batches (fixed seeds) for each case; the group of
WORLD ranks trains one step's loss and gradients on shards of the batch (train/sequence_parallel
.py), rank 0 also on the whole batch in one process, and writes the largest differences. Then
("slices") the group trains packed rows of a capture written next to OUT.json twice, each rank
reading its shard of the whole rows and then its positions alone (train/sequence_slices.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.data.shards import ShardDataset, ShardWriter
from eagle3.layers import DraftAttention
from eagle3.loss import label_rows, target_probs, ttt_loss, valid_counts
from eagle3.methods import make_draft_config
from eagle3.methods.eagle3 import recomputed_ttt_loss
from eagle3.model import Eagle3Draft, TTTModel
from train.batching import collate
from train.datasets import Windows
from train.packing import PackedDataset
from train.sequence_parallel import data_layout, make_group, sequence_parallel, shard_batch
from train.sequence_slices import ShardReader

STEPS, WEIGHT = 3, 0.8
MLA = dict(
    attention="mla", num_attention_heads=4, num_key_value_heads=4, head_dim=12, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5},
)  # fmt: skip
# (name, draft overrides, TTT kernel, packed rows)
CASES = [
    ("gqa", {}, "auto", False),
    ("gqa-packed", {}, "auto", True),
    ("gqa-chunked-1kv-packed", {"num_key_value_heads": 1}, "chunked", True),
    ("mla", MLA, "auto", False),
    ("mla-packed", MLA, "auto", True),
    ("mla-flash-packed", MLA, "flash", True),
    ("mla-eagle3.1-packed", {**MLA, "method": "eagle3.1"}, "auto", True),
    ("gqa-recompute", {}, "auto", False),
    ("mla-recompute-packed", MLA, "auto", True),
]
# each TTT step recomputed in backward (train.recompute_ttt_steps, eagle3/methods/eagle3.py): the
# all-to-alls run again inside the recomputed steps
RECOMPUTED = {"gqa-recompute", "mla-recompute-packed"}


def draft(overrides: dict) -> Eagle3Draft:
    values = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=50, draft_vocab_size=40, target_hidden_size=32,
        aux_layer_ids=[0, 1, 2],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Draft(make_draft_config(**{**values, **overrides}))
    model.embed_tokens.weight.data.normal_()
    return model


def batch(packed: bool, B: int = 2, T: int = 45) -> dict:
    """Random ids, aux states, loss mask and soft labels; packed: rows of 3 and 2 records
    (positions restarting), else row 1 right-padded after 31 tokens (no loss there)."""
    g = torch.Generator().manual_seed(1)
    out = {
        "input_ids": torch.randint(0, 50, (B, T), generator=g),
        "aux_hidden": torch.randn(B, T, 96, generator=g),
        "loss_mask": (torch.rand(B, T, generator=g) < 0.7).long(),
        "probs": torch.randn(B, T, 40, generator=g).softmax(-1),
        "in_vocab": torch.rand(B, T, generator=g) < 0.9,
    }
    if packed:
        sizes = [[20, 15, 10], [30, 15]]
        out["segment_ids"] = torch.stack(
            [torch.repeat_interleave(torch.arange(len(s)), torch.tensor(s)) for s in sizes]
        )
        out["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in s]) for s in sizes])
    else:
        out["loss_mask"][1, 31:] = 0
    return out


def one_process(model: Eagle3Draft, b: dict):
    logits = model.ttt_forward(
        b["input_ids"], b["aux_hidden"], STEPS, b.get("segment_ids"), b.get("position_ids")
    )
    loss, m = ttt_loss(
        logits, b["probs"], b["in_vocab"], b["loss_mask"], WEIGHT, None, b.get("segment_ids")
    )
    loss.backward()
    return loss.detach(), m


def sharded(model: Eagle3Draft, s: dict, group, recompute: bool = False):
    """One step's loss and gradients of a rank's shard `s` (shard_batch's), summed over the group."""
    sp = sequence_parallel(group, s, torch.device("cpu"))
    seg, queries = s.get("segment_ids"), s["queries"]
    counts = valid_counts(s["in_vocab"], s["loss_mask"], STEPS, seg, queries)
    dist.all_reduce(counts, group=group)  # every shard's positions: the record's count
    if recompute:
        mb = {
            "input_ids": s["input_ids"], "aux": s["aux_hidden"], "segment_ids": seg,
            "position_ids": s["position_ids"], "sp": sp, "probs": s["probs"],
            "in_vocab": s["in_vocab"], "loss_mask": s["loss_mask"], "queries": queries,
        }  # fmt: skip
        model_r = TTTModel(model, STEPS, recompute=True)
        loss, m = recomputed_ttt_loss(model_r, mb, WEIGHT, counts.double().tolist())
    else:
        logits = model.ttt_forward(
            s["input_ids"], s["aux_hidden"], STEPS, None, s["position_ids"], sp
        )
        loss, m = ttt_loss(
            logits, s["probs"], s["in_vocab"], s["loss_mask"], WEIGHT, counts.double().tolist(),
            seg, queries,
        )  # fmt: skip
    loss.backward()
    for p in model.parameters():  # what the data-parallel all-reduce does (sum over shards)
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    count = torch.tensor([m[f"count_{k}"] for k in range(STEPS)])
    dist.all_reduce(count, group=group)
    return loss, count


def slices(group, layout, shard_dir: Path) -> dict:
    """Two packed rows of a capture (records of 15-44 tokens, windows of 40, rows of 70), an
    MLA draft trained one step on each rank's shard of them as shard_batch cuts the whole rows
    and as ShardReader reads its positions alone, soft labels from the read last states: are
    the shards, the group's loss and every gradient equal, bit for bit?"""
    if layout.sp_rank == 0:
        g = torch.Generator().manual_seed(3)
        meta = {"target": "tiny", "vocab_size": 50, "target_hidden_size": 32,
                "aux_layer_ids": [0, 1, 2], "num_layers": 4, "max_length": 64}  # fmt: skip
        with ShardWriter(shard_dir, meta, dtype="bf16", shard_bytes=20000) as w:
            for i in range(6):
                t = int(torch.randint(15, 45, (1,), generator=g))
                w.add(f"r{i}", torch.randint(0, 50, (t,), generator=g),
                      (torch.rand(t, generator=g) < 0.7).long(),
                      torch.randn(t, 96, generator=g), torch.randn(t, 32, generator=g))  # fmt: skip
    dist.barrier(group)
    records = ShardDataset(shard_dir)
    windows = Windows(records, records.lengths, 40, "window", 20)
    data = PackedDataset(windows, windows.lengths, 70)
    torch.manual_seed(4)
    lm_head, t2d = torch.randn(50, 32), torch.arange(50) < 40
    indices = [0, 1]
    whole = shard_batch(collate([data[i] for i in indices]), layout.sp_rank, layout.sp, STEPS)
    alone = ShardReader(data, data.lengths, layout.sp_rank, layout.sp, STEPS)[indices]
    same = torch.tensor(float(all(
        torch.equal(x, alone[k]) if isinstance(x, torch.Tensor) else x == alone[k]
        for k, x in whole.items()
    )))  # fmt: skip
    dist.all_reduce(same, dist.ReduceOp.MIN, group=group)
    out = {"shards_equal": bool(same), "rows": data.lengths[:2], "queries": alone["queries"]}
    grads = []
    for name, s in (("whole", whole), ("alone", alone)):
        s["probs"], s["in_vocab"] = target_probs(
            s["last_hidden"], lm_head, t2d, 16, label_rows(s["loss_mask"])
        )
        model = draft(MLA)
        loss, _ = sharded(model, s, group)
        out[f"loss_{name}"] = float(loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    out["grad_max_abs_diff"] = max(
        float((grads[0][n] - g).abs().max()) for n, g in grads[1].items()
    )
    out["grads"] = sorted(grads[1]) == sorted(grads[0])
    return out


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = data_layout(rank, world, world)
    group = make_group(layout)
    results = {}
    for name, overrides, impl, packed in CASES:
        DraftAttention.ttt_impl = impl
        b = batch(packed)
        model = draft(overrides)
        s = shard_batch(b, layout.sp_rank, layout.sp, STEPS)
        loss, count = sharded(model, s, group, name in RECOMPUTED)
        if rank:
            continue
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ref = draft(overrides)
        ref_loss, m = one_process(ref, b)
        errors = {
            n: float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30))
            for n, p in ref.named_parameters()
            if p.grad is not None
        }
        results[name] = {
            "loss": float(loss),
            "ref_loss": float(ref_loss),
            "counts": count.tolist(),
            "ref_counts": [m[f"count_{k}"] for k in range(STEPS)],
            "grad_rel": errors,
            "grads_missing": sorted(set(errors) ^ set(grads)),
        }
    results["slices"] = slices(group, layout, Path(out).parent / "slices")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
