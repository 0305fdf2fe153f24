"""What fp8 hidden-state shards cost the teacher's soft labels, measured against bf16 shards.

    python experiments/bench_fp8_labels.py [--target smollm2-135m-q4 --target MINI_DIR] \
        [--prompts 40] [--max-new-tokens 96]

For each target: MT-bench prompts (first turns) and the target's own greedy answers are
captured once in fp32, written through `eagle3.data.shards.ShardWriter` as bf16 and as fp8
(exactly what `datagen.capture --dtype` stores) and read back with `ShardDataset`. The soft
labels are then computed as training computes them (`eagle3.loss.target_probs`: the target's
lm_head over the stored last hidden state, softmaxed over the draft vocab; here the full vocab,
the least forgiving restriction) on the answer tokens (loss mask 1). Printed per target:
top-1 agreement of the labels' argmax, fp8 vs bf16 (and each vs the unstored fp32 capture),
mean and max KL(bf16 || fp8), and the relative error of the stored aux and last hidden states.
What the label differences cost a drafter trained on fp8 shards: experiments/bench_fp8_training.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eagle3.data.prompts import load_prompts
from eagle3.data.shards import ShardDataset, ShardWriter, target_meta
from eagle3.loss import target_probs
from eagle3.target import load_target


def own_answers(target, prompts, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per prompt: chat prompt + the target's greedy answer."""
    tok, out = target.tokenizer, []
    for p in prompts:
        text = tok.apply_chat_template(p.messages[:1], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            full = target.model.generate(
                torch.tensor([ids], device=target.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )[0].tolist()
        out.append((full, [0] * len(ids) + [1] * (len(full) - len(ids))))
    return out


def measure(name: str, n_prompts: int, max_new_tokens: int) -> dict:
    target = load_target(name, device="cpu")
    if name != "smollm2-135m-q4" and len(set(target.aux_layer_ids)) < 3:  # tiny miniatures
        target.aux_layer_ids = [0, 1, 2]
    prompts = load_prompts("mt_bench", limit=n_prompts)
    t0 = time.perf_counter()
    seqs = own_answers(target, prompts, max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {dtype: Path(tmp) / dtype for dtype in ("bf16", "fp8")}
        writers = {
            dtype: ShardWriter(d, {**target_meta(target), "max_length": 4096}, dtype=dtype)
            for dtype, d in dirs.items()
        }
        ref_aux, ref_last = [], []
        for i, (ids, mask) in enumerate(seqs):
            aux, last = target.capture(torch.tensor([ids]))
            ref_aux.append(aux[0].float())
            ref_last.append(last[0].float())
            for w in writers.values():
                w.add(f"r{i}", ids, mask, aux[0], last[0])
        for w in writers.values():
            w.close()
        stored = {dtype: ShardDataset(d) for dtype, d in dirs.items()}
        rows = {dtype: [ds[i] for i in range(len(ds))] for dtype, ds in stored.items()}
    by_id = {dtype: {r["id"]: r for r in rs} for dtype, rs in rows.items()}
    V = target.vocab_size
    t2d = torch.ones(V, dtype=torch.bool)
    lm_head = target.lm_head_weight.float()
    labels, argmax = {}, {}
    for dtype in ("fp32", "bf16", "fp8"):
        probs = []
        for i, (_, mask) in enumerate(seqs):
            last = ref_last[i] if dtype == "fp32" else by_id[dtype][f"r{i}"]["last_hidden"]
            p, _ = target_probs(last[None].float(), lm_head, t2d, 512)
            probs.append(p[0][torch.tensor(mask, dtype=torch.bool)])
        labels[dtype] = torch.cat(probs)  # (N answer tokens, V)
        argmax[dtype] = labels[dtype].argmax(-1)
    p, q = labels["bf16"], labels["fp8"]
    kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)

    def rel(dtype: str, key: str, ref: list[torch.Tensor]) -> float:
        num = sum((by_id[dtype][f"r{i}"][key] - r).norm() ** 2 for i, r in enumerate(ref))
        return float((num / sum(r.norm() ** 2 for r in ref)) ** 0.5)

    return {
        "target": name,
        "answer_tokens": int(p.shape[0]),
        "total_tokens": sum(len(ids) for ids, _ in seqs),
        "top1_fp8_vs_bf16": float((argmax["fp8"] == argmax["bf16"]).float().mean()),
        "top1_bf16_vs_fp32": float((argmax["bf16"] == argmax["fp32"]).float().mean()),
        "top1_fp8_vs_fp32": float((argmax["fp8"] == argmax["fp32"]).float().mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "rel_err_aux": {d: rel(d, "aux_hidden", ref_aux) for d in ("bf16", "fp8")},
        "rel_err_last": {d: rel(d, "last_hidden", ref_last) for d in ("bf16", "fp8")},
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="repeatable (default: the embedded)")
    parser.add_argument("--prompts", type=int, default=40, help="MT-bench first turns")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.target or ["smollm2-135m-q4"]:
        r = measure(name, args.prompts, args.max_new_tokens)
        print(
            f"{r['target']}: {r['answer_tokens']} answer tokens ({r['total_tokens']} in all), "
            f"{r['seconds']:.0f} s\n"
            f"  top-1 agreement fp8 vs bf16 {r['top1_fp8_vs_bf16']:.4%} "
            f"(bf16 vs fp32 {r['top1_bf16_vs_fp32']:.4%}, fp8 vs fp32 {r['top1_fp8_vs_fp32']:.4%})\n"
            f"  KL(bf16 || fp8) of the soft labels: mean {r['kl_mean']:.2e}, max {r['kl_max']:.2e}\n"
            f"  relative error of stored states: aux bf16 {r['rel_err_aux']['bf16']:.2e} "
            f"fp8 {r['rel_err_aux']['fp8']:.2e}; last bf16 {r['rel_err_last']['bf16']:.2e} "
            f"fp8 {r['rel_err_last']['fp8']:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
