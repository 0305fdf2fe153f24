"""Acceptance length by context position: a drafter with the old RoPE vs one with the target's.

    python experiments/bench_rope_positions.py [--work runs/bench-fp8-rope] [--docs 3] [--doc-tokens 8192]

Two drafters are trained identically (experiments/bench_fp8_training.py's bf16 shards of ShareGPT
conversations of at most 1024 tokens, configs/train/smollm2-q4-cpu.yaml, same seed and steps)
except for the draft layer's RoPE: "old" = theta 10000 and no scaling (what drafters used before
the target's RoPE was copied), "new" = the default now, the target's (SmolLM2: theta 100000).
The "new" run is bench_fp8_training.py's bf16 run (the same command), reused when present.

Evaluation is teacher-forced (not real speculative decoding: an 8k-token prefill costs about
a minute per drafter on one CPU core): LONG held-out texts are made by concatenating ShareGPT
conversations (their own assistant turns, none of the training ones) into one multi-turn chat
of --doc-tokens tokens; the target runs once over each (aux + final hidden states, fp32, as at
inference), each drafter runs its TTT unroll over the whole text (chunked over queries, checked
against Eagle3Draft.ttt_forward), and at every chain start t (a loss-masked position) step k
is a hit when the drafter's argmax equals the target's argmax; out-of-vocab target argmaxes
are misses. Per position bucket (the chain start t: 0-1k, 1k-4k, 4k-8k) acc_k gives the
simulated chain acceptance tau = eagle3.loss.simulated_acceptance(acc_0..acc_K-1).
Printed per bucket: tau old, tau new, positions and texts, the spread of the per-text tau
(min..max) and the per-text paired difference new - old (mean, min..max).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_fp8_training import (
    TARGET,
    final_dir,
    load_final,
    prepare,
    train_all,
    train_command,
)

from eagle3.data.chat import render_record
from eagle3.data.prompts import PromptError, open_source, source_conversation
from eagle3.loss import simulated_acceptance
from eagle3.model import Eagle3Draft
from eagle3.targets import load_target

OLD_ROPE = ["model.draft.rope.theta=10000", "model.draft.rope.scaling={rope_type: default}"]
BUCKETS = [(0, 1024), (1024, 4096), (4096, 8192)]


def base_id(rid: str) -> str:
    """ShareGPT splits long conversations into id_0, id_1, ...: one base id for all parts."""
    head, _, tail = rid.rpartition("_")
    return head if head and tail.isdigit() else rid


def long_texts(tokenizer, n: int, tokens: int, exclude: set[str], skip: int) -> list[dict]:
    """`n` records, each several ShareGPT conversations (none whose base id is in `exclude`,
    none of the first `skip`) concatenated into one chat of at least `tokens` tokens."""
    raws, _ = open_source("sharegpt")
    docs, messages, length, seen = [], [], 0, 0
    for raw in raws:
        seen += 1
        rid = str(raw.get("id"))
        if seen <= skip or base_id(rid) in exclude:
            continue
        try:
            conv = [m for m in source_conversation(raw) if m["role"] != "system"]
        except PromptError:
            continue
        messages += conv
        length += len(render_record(tokenizer, {"messages": conv}).input_ids)
        if length >= tokens + 64:
            docs.append({"id": f"long{len(docs)}", "dataset": "sharegpt", "messages": messages})
            messages, length = [], 0
            if len(docs) >= n:
                break
    close = getattr(raws, "close", None)
    if close is not None:
        close()
    return docs


@torch.inference_mode()
def ttt_argmax(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor, K: int, chunk: int):
    """Eagle3Draft.ttt_forward's per-step argmax (target ids) for one long sequence, with the
    attention done `chunk` queries at a time so a (heads, T, T) score matrix never exists.
    ids (1, T), aux (1, T, 3H) -> list of K (1, T) long tensors."""
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    T = ids.shape[1]
    hidden = draft.project(aux)  # (1, T, H)
    positions = torch.arange(T)[None]
    keys, values, preds = [], [], []
    for k in range(K):
        step_ids = F.pad(ids[:, k + 1 :], (0, min(k + 1, T)))  # x_{t+k+1}, as ttt_forward
        x = layer.attn_input(draft.embed_tokens(step_ids).to(hidden.dtype), hidden)
        q, key, value = attn.qkv(x, positions + k)  # (1, nh|nkv, T, hd)
        keys.append(key)
        values.append(value)
        outs = []
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            S = b - a
            kk = torch.cat([keys[0][:, :, :b]] + [kj[:, :, a:b] for kj in keys[1:]], dim=2)
            vv = torch.cat([values[0][:, :, :b]] + [vj[:, :, a:b] for vj in values[1:]], dim=2)
            causal = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]  # (S, b)
            diag = torch.eye(S, dtype=torch.bool)
            mask = torch.cat([causal] + [diag] * k, dim=1)[None]  # (1, S, b + k*S)
            outs.append(attn.attend(q[:, :, a:b], kk, vv, mask))  # (1, S, H)
        hidden = layer.finish(hidden, torch.cat(outs, dim=1))
        preds.append(draft.draft_to_target(draft.compute_logits(hidden).argmax(-1)))
    return preds


def check_chunked(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor, K: int) -> float:
    """Agreement of ttt_argmax (small chunks) with ttt_forward's argmax on a short prefix."""
    T = min(ids.shape[1], 384)
    ids, aux = ids[:, :T], aux[:, :T]
    with torch.inference_mode():
        ref = [draft.draft_to_target(lg.argmax(-1)) for lg in draft.ttt_forward(ids, aux, K)]
    got = ttt_argmax(draft, ids, aux, K, chunk=100)
    return float(torch.stack([(r == g).float().mean() for r, g in zip(ref, got)]).mean())


def hits(preds, label: torch.Tensor, mask: torch.Tensor, K: int):
    """-> (hit (K, T) bool, valid (K, T) bool): step k at chain start t predicts x_{t+k+2},
    whose target argmax is label[t+k+1]; it counts when loss_mask[t+k+2] is 1."""
    T = label.shape[1]
    hit = torch.zeros(K, T, dtype=torch.bool)
    valid = torch.zeros(K, T, dtype=torch.bool)
    for k in range(K):
        n = max(T - k - 2, 0)
        valid[k, :n] = mask[0, k + 2 : k + 2 + n].bool()
        hit[k, :n] = (preds[k][0, :n] == label[0, k + 1 : k + 1 + n]) & valid[k, :n]
    return hit, valid


def bucket_tau(hit: torch.Tensor, valid: torch.Tensor, lo: int, hi: int) -> tuple[float, int]:
    """Simulated tau from acc_k over chain starts in [lo, hi) -> (tau, step-0 positions)."""
    h, v = hit[:, lo:hi].sum(1), valid[:, lo:hi].sum(1)
    if int(v[0]) == 0:
        return float("nan"), 0
    return simulated_acceptance((h / v.clamp_min(1)).tolist()), int(v[0])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--work", type=Path, default=Path("runs/bench-fp8-rope"), help="records, shards, runs"
    )
    p.add_argument("--conversations", type=int, default=150, help="training conversations")
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=1024, help="longest training sequence")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of each drafter")
    p.add_argument("--warmup", type=int, default=4, help="warmup steps (optim.warmup_steps)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serial", action="store_true", help="train one drafter after the other")
    p.add_argument("--docs", type=int, default=3, help="long held-out texts")
    p.add_argument("--doc-tokens", type=int, default=8192, help="tokens per long text")
    p.add_argument("--skip", type=int, default=2000, help="ShareGPT conversations not used")
    p.add_argument("--chunk", type=int, default=1024, help="queries per attention chunk")
    return p.parse_args(argv)


def score_texts(drafts: dict, target, docs: list, args, K: int, t0: float) -> tuple[dict, dict]:
    """Each drafter's hits over each long text, teacher-forced against the target's argmax
    -> (per text: [(tau, positions) per bucket] by drafter, pooled hit/valid by drafter)."""
    lm_head = target.lm_head_weight.float()
    per_doc = {name: [] for name in drafts}  # per text: [(tau, n) per bucket]
    pooled = {name: {"hit": [], "valid": []} for name in drafts}
    for i, doc in enumerate(docs):
        r = render_record(target.tokenizer, doc, max_length=args.doc_tokens)
        ids = torch.tensor([r.input_ids])
        mask = torch.tensor([r.loss_mask])
        with torch.inference_mode():
            aux, last = target.capture(ids)
            rows = last[0].float().split(1024)  # full-vocab logits for 1024 rows at a time
            label = torch.cat([(h @ lm_head.T).argmax(-1) for h in rows])[None]  # (1, T)
        if i == 0:
            agree = check_chunked(drafts["new"], ids, aux.float(), K)
            print(f"chunked TTT vs ttt_forward argmax agreement: {agree:.4%}", flush=True)
        for name, draft in drafts.items():
            hit, valid = hits(ttt_argmax(draft, ids, aux.float(), K, args.chunk), label, mask, K)
            per_doc[name].append([bucket_tau(hit, valid, lo, hi) for lo, hi in BUCKETS])
            pooled[name]["hit"].append(hit)
            pooled[name]["valid"].append(valid)
        taus = "; ".join(
            f"{lo}-{hi} old {o[0]:.3f} new {n[0]:.3f} ({n[1]})"
            for (lo, hi), o, n in zip(BUCKETS, per_doc["old"][-1], per_doc["new"][-1])
        )
        print(
            f"text {i}: {ids.shape[1]} tokens ({int(mask.sum())} under the loss mask), "
            f"{time.perf_counter() - t0:.0f} s; tau by bucket: {taus}",
            flush=True,
        )
    return per_doc, pooled


def print_buckets(per_doc: dict, pooled: dict) -> None:
    """Per bucket: pooled tau old and new, positions, texts, and the per-text spread and
    paired difference."""
    header = f"{'bucket':>10} {'tau old':>8} {'tau new':>8} {'positions':>10} {'texts':>6}"
    print(header + f" {'old per text':>14} {'new per text':>14} {'new-old per text':>26}")
    for b, (lo, hi) in enumerate(BUCKETS):
        taus = {}
        for name in pooled:
            hit = torch.cat([h[:, lo:hi] for h in pooled[name]["hit"]], dim=1)
            valid = torch.cat([v[:, lo:hi] for v in pooled[name]["valid"]], dim=1)
            taus[name] = bucket_tau(hit, valid, 0, hit.shape[1])
        pairs = [
            (o[b][0], n[b][0])
            for o, n in zip(per_doc["old"], per_doc["new"])
            if o[b][1] > 0 and n[b][1] > 0
        ]
        if not pairs:
            print(f"{lo:>4}-{hi:<5} no positions")
            continue
        old_t, new_t = [o for o, _ in pairs], [n for _, n in pairs]
        diffs = [n - o for o, n in pairs]
        print(
            f"{lo:>4}-{hi:<5} {taus['old'][0]:8.3f} {taus['new'][0]:8.3f} {taus['new'][1]:10d} "
            f"{len(pairs):6d} {min(old_t):6.2f}..{max(old_t):<6.2f} {min(new_t):6.2f}..{max(new_t):<6.2f}"
            f" {sum(diffs) / len(diffs):+7.3f} ({min(diffs):+.2f}..{max(diffs):+.2f})"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    work = args.work
    dirs = prepare(work, args, ("bf16",))  # bench_fp8_training's bf16 capture, when present
    runs = {
        "new": train_command(dirs["bf16/train"], work / "runs" / "bf16", args),
        "old": train_command(dirs["bf16/train"], work / "runs" / "bf16-rope10k", args, OLD_ROPE),
    }
    print(f"training: {train_all(runs, not args.serial, work / 'logs'):.0f} s wall", flush=True)
    drafts = {name: load_final(final_dir(cmd).parent) for name, cmd in runs.items()}
    for name, d in drafts.items():
        print(f"{name}: rope_theta {d.config.rope_theta}, rope_scaling {d.config.rope_scaling}")
    K = 4  # configs/train/smollm2-q4-cpu.yaml's model.ttt_steps

    t0 = time.perf_counter()
    target = load_target(TARGET, device="cpu")
    exclude = set()
    for part in ("train", "val"):
        for line in (work / f"records/{part}.jsonl").read_text().splitlines():
            exclude.add(base_id(json.loads(line)["id"]))
    docs = long_texts(target.tokenizer, args.docs, args.doc_tokens, exclude, args.skip)
    per_doc, pooled = score_texts(drafts, target, docs, args, K, t0)
    print(
        f"\n{TARGET} (rope_theta 100000, max_position_embeddings 8192): teacher-forced "
        f"simulated tau (chain of {K}), {len(docs)} held-out texts of <= {args.doc_tokens} tokens, "
        f"drafters trained on <= {args.max_length}-token sequences, {args.steps} steps"
    )
    print_buckets(per_doc, pooled)
    print(f"evaluation: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
