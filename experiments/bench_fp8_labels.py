"""What fp8 hidden-state shards cost the teacher's soft labels and the drafter's input, measured
against bf16 shards, for each fp8 storage mode.

    python experiments/bench_fp8_labels.py [--target smollm2-135m-q4 --target MINI_DIR] \
        [--prompts 40] [--max-new-tokens 96]

For each target: MT-bench prompts (first turns) and the target's own greedy answers are
captured once in fp32, written through `eagle3.data.shards.ShardWriter` in every mode of
MODES (exactly what `datagen.capture --dtype` stores: fp8 has both hidden states in fp8,
fp8-aux the aux states in fp8 and the last in bf16) and read back with `ShardDataset`. The
soft labels are then computed as training computes them (`eagle3.loss.target_probs`: the
target's lm_head over the stored last hidden state, softmaxed over the draft vocab; here the
full vocab, the least forgiving restriction) on the answer tokens (loss mask 1). Printed per
target and fp8 mode: top-1 agreement of the labels' argmax with bf16's (and each with the
unstored fp32 capture's), mean and max KL(bf16 || mode), the relative error of the stored aux
and last hidden states against fp32, and what the drafter's first layer sees: the relative
error and the per-token cosine (mean, min) of fc(aux) against fc(bf16 aux), fc being a
drafter's `fc` Linear(3H -> H) at its initialisation (seeded; no drafter is trained here).
What the differences cost a trained drafter: experiments/bench_fp8_training.py.
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
from eagle3.targets import load_target

MODES = ("bf16", "fp8", "fp8-aux")  # bf16 is the reference the fp8 modes are compared with


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


def stored_states(
    aux: list[torch.Tensor], last: list[torch.Tensor], masks: list[list[int]], meta: dict, tmp: Path
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each record's (aux [T, 3H], last [T, H]) written in every mode of MODES and read back
    (float32) -> {mode: [(aux, last) per record]}."""
    out = {}
    for mode in MODES:
        with ShardWriter(tmp / mode, meta, dtype=mode) as writer:
            for i, (a, h, mask) in enumerate(zip(aux, last, masks)):
                writer.add(f"r{i}", list(range(len(mask))), mask, a, h)
        by_id = {row["id"]: row for row in ShardDataset(tmp / mode)}
        out[mode] = [(by_id[f"r{i}"]["aux_hidden"], by_id[f"r{i}"]["last_hidden"])
                     for i in range(len(aux))]  # fmt: skip
    return out


def compare(
    ref_aux: list[torch.Tensor],
    ref_last: list[torch.Tensor],
    masks: list[list[int]],
    stored: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
    lm_head: torch.Tensor,
    fc: torch.nn.Linear,
) -> dict[str, dict]:
    """Per fp8 mode: the soft labels on the loss-masked rows against bf16's and the unstored
    fp32's, and the stored states' errors (see the module docstring)."""
    t2d = torch.ones(lm_head.shape[0], dtype=torch.bool)
    rows = [torch.tensor(m, dtype=torch.bool) for m in masks]

    def labels(lasts: list[torch.Tensor]) -> torch.Tensor:  # (answer tokens, V)
        return torch.cat([target_probs(h[None].float(), lm_head, t2d, 512)[0][0][r]
                          for h, r in zip(lasts, rows)])  # fmt: skip

    def rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
        num = sum((g.float() - r.float()).norm() ** 2 for g, r in zip(got, ref))
        return float((num / sum(r.float().norm() ** 2 for r in ref)) ** 0.5)

    p_fp32 = labels(ref_last)
    p_bf16 = labels([h for _, h in stored["bf16"]])
    fc_bf16 = [fc(a).detach() for a, _ in stored["bf16"]]
    out = {"bf16": {"top1_vs_fp32": float((p_bf16.argmax(-1) == p_fp32.argmax(-1)).float().mean()),
                    "rel_err_aux": rel([a for a, _ in stored["bf16"]], ref_aux),
                    "rel_err_last": rel([h for _, h in stored["bf16"]], ref_last)}}  # fmt: skip
    for mode in MODES[1:]:
        q = labels([h for _, h in stored[mode]])
        kl = (p_bf16 * (p_bf16.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
        fc_mode = [fc(a).detach() for a, _ in stored[mode]]
        cos = torch.cat([torch.cosine_similarity(f, b, dim=-1) for f, b in zip(fc_mode, fc_bf16)])
        out[mode] = {
            "top1_vs_bf16": float((q.argmax(-1) == p_bf16.argmax(-1)).float().mean()),
            "top1_vs_fp32": float((q.argmax(-1) == p_fp32.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "rel_err_aux": rel([a for a, _ in stored[mode]], ref_aux),
            "rel_err_last": rel([h for _, h in stored[mode]], ref_last),
            "fc_rel_err": rel(fc_mode, fc_bf16),
            "fc_cos_mean": float(cos.mean()),
            "fc_cos_min": float(cos.min()),
        }
    return out


def measure(name: str, n_prompts: int, max_new_tokens: int) -> dict:
    target = load_target(name, device="cpu")
    if name != "smollm2-135m-q4" and len(set(target.aux_layer_ids)) < 3:  # tiny miniatures
        target.aux_layer_ids = [0, 1, 2]
    prompts = load_prompts("mt_bench", limit=n_prompts)
    t0 = time.perf_counter()
    seqs = own_answers(target, prompts, max_new_tokens)
    ref_aux, ref_last = [], []
    for ids, _ in seqs:
        with torch.no_grad():
            aux, last = target.capture(torch.tensor([ids]))
        ref_aux.append(aux[0].float())
        ref_last.append(last[0].float())
    masks = [mask for _, mask in seqs]
    meta = {**target_meta(target), "max_length": 4096}
    with tempfile.TemporaryDirectory() as tmp:
        stored = stored_states(ref_aux, ref_last, masks, meta, Path(tmp))
    torch.manual_seed(0)  # the same fc for every mode (and every run)
    fc = torch.nn.Linear(3 * target.hidden_size, target.hidden_size, bias=False)
    result = compare(ref_aux, ref_last, masks, stored, target.lm_head_weight.float(), fc)
    return {
        "target": name,
        "answer_tokens": sum(sum(m) for m in masks),
        "total_tokens": sum(len(m) for m in masks),
        "modes": result,
        "seconds": time.perf_counter() - t0,
    }


def report(r: dict) -> str:
    """The printed lines of one target's measure()."""
    m = r["modes"]
    lines = [
        f"{r['target']}: {r['answer_tokens']} answer tokens ({r['total_tokens']} in all), "
        f"{r['seconds']:.0f} s; bf16 vs fp32: top-1 {m['bf16']['top1_vs_fp32']:.4%}, relative "
        f"error aux {m['bf16']['rel_err_aux']:.2e}, last {m['bf16']['rel_err_last']:.2e}"
    ]
    for mode in MODES[1:]:
        x = m[mode]
        lines.append(
            f"  {mode:8s} top-1 vs bf16 {x['top1_vs_bf16']:.4%} (vs fp32 {x['top1_vs_fp32']:.4%}), "
            f"KL(bf16 || {mode}) mean {x['kl_mean']:.2e} max {x['kl_max']:.2e}; relative error "
            f"aux {x['rel_err_aux']:.2e} last {x['rel_err_last']:.2e}; fc(aux) vs bf16: relative "
            f"error {x['fc_rel_err']:.2e}, cosine mean {x['fc_cos_mean']:.6f} min "
            f"{x['fc_cos_min']:.6f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="repeatable (default: the embedded)")
    parser.add_argument("--prompts", type=int, default=40, help="MT-bench first turns")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for name in args.target or ["smollm2-135m-q4"]:
        print(report(measure(name, args.prompts, args.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
