"""Training throughput of the EAGLE-3 drafter: tokens/s, peak memory and MFU, measured in one run.

    python benchmarks/bench_train.py --config configs/train/smollm2-q4-cpu.yaml
    python benchmarks/bench_train.py --config configs/train/kimi-k2.5-offline.yaml --seq-len 2048 --batch-size 2

The step is the recipe's (train/train_drafter.py): soft labels from the target's lm_head in
chunks, the TTT unroll, the weighted loss, backward, clip, AdamW. Inputs are random tensors
of the target's shapes (no shards needed); only the target's config.json is read.

--recompute: the step with and without each TTT step recomputed in backward
(train.recompute_ttt_steps, eagle3/methods/eagle3.py), alternating in one run: the step-time ratio and
each mode's peak memory above the step's start (CPU: the process's RSS high-water mark, reset
before each step through /proc/self/clear_refs; CUDA: max_memory_allocated).

    python benchmarks/bench_train.py --config configs/train/kimi-k2.5-offline.yaml --recompute \
        --seq-len 1024 --steps 2 --target-shape hidden=1024,vocab=32000,heads=64,kv_heads=64,head_dim=192,intermediate=2048 \
        model.draft.intermediate_size=2048 model.draft_vocab_size=8000 \
        model.draft.mla.q_lora_rank=1536 model.draft.mla.kv_lora_rank=512 \
        model.draft.mla.qk_nope_head_dim=128 model.draft.mla.qk_rope_head_dim=64 model.draft.mla.v_head_dim=128

(--target-shape carries no MLA dims: an MLA recipe such as Kimi's takes them as model.draft.mla.*
overrides, here Kimi's own.)

MFU = analytic training FLOPs per token x tokens/s / measured matmul peak of this device in
this run (best of square matmuls in the training dtype). Analytic FLOPs count, per token,
the draft's useful work only: fc once, and for each of the K TTT steps q/k/v/o, the SwiGLU MLP,
the draft lm_head and attention over the keys it really attends to (t/2 + k on average: the
causal step-0 keys plus the k diagonal ones); backward = 2x forward except fc (no input grad).
The target lm_head used for the soft labels is overhead, not model FLOPs; its time is reported
separately (label_share).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle3.compute import describe_peak, matmul_peak
from eagle3.draft_shapes import target_shape
from eagle3.loss import target_probs, ttt_loss
from eagle3.methods import method_of
from eagle3.methods.eagle3 import recomputed_ttt_loss
from eagle3.model import DraftConfig, Eagle3Draft, TTTModel
from train.config import load_config
from train.metrics import peak_memory_gb


def train_flops_per_token(cfg: DraftConfig, seq_len: int, ttt_steps: int) -> float:
    H, ffn, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fc = 2 * 3 * cfg.target_hidden_size * H
    if cfg.attention == "mla":  # the latent projections (eagle3.layers.MLAAttention)
        dqk, dv, r = cfg.head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        q = cfg.q_lora_rank * (2 * H + nh * dqk) if cfg.q_lora_rank else 2 * H * nh * dqk
        kv = 2 * H * (cfg.kv_lora_rank + r) + cfg.kv_lora_rank * nh * (dqk - r + dv)
        projections = q + kv + nh * dv * H  # ... and o_proj
    else:
        dqk = dv = hd
        projections = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H  # q, k, v from 2H; o_proj
    per_step = 2 * (
        projections
        + 3 * H * ffn  # gate, up, down
        + H * Vd  # draft lm_head
    )
    # QK^T and AV over the causal half and the k diagonal keys
    attn = sum(2 * nh * (dqk + dv) * ((seq_len + 1) / 2 + k) for k in range(ttt_steps))
    return 2 * fc + 3 * (ttt_steps * per_step + attn)  # fc: forward + weight grad only


def shape_facts(spec: str) -> dict:
    """--target-shape "hidden=..,vocab=..,heads=..,kv_heads=..,head_dim=..,intermediate=.." -> facts."""
    from types import SimpleNamespace

    v = {k: int(x) for k, x in (item.split("=") for item in spec.split(","))}
    hf = SimpleNamespace(
        hidden_size=v["hidden"],
        vocab_size=v["vocab"],
        num_attention_heads=v["heads"],
        num_key_value_heads=v["kv_heads"],
        head_dim=v["head_dim"],
        intermediate_size=v["intermediate"],
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    return facts_of(hf)


def facts_of(hf) -> dict:
    """What the benchmark reads of a target's config, whichever way it was given (one builder:
    the registry path once lacked hidden_size and crashed)."""
    return {
        "hf_config": hf,
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "aux_layer_ids": None,
    }


def recipe_draft_config(cfg, facts: dict, draft_vocab: int, aux_ids: list[int]) -> DraftConfig:
    """The recipe's draft shape, by the recipe's own builder (train/draft.py: model.draft,
    attention and MLA dims included; nulls derived from the target's config)."""
    from train.draft import draft_config

    return draft_config(cfg.model, facts["hf_config"], draft_vocab, aux_ids)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_above_start(device: torch.device, step) -> float:
    """GiB a step's peak memory rises above its start: CUDA max_memory_allocated, or on CPU the
    RSS high-water mark (Linux: reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**30
    base = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step()
    return (_rss("VmHWM") - base) / 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a training recipe (configs/train/*.yaml)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the recipe's max_length")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's batch size")
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--target-shape",
        help="skip the target's config.json (e.g. no hub access): hidden=7168,vocab=163840,"
        "heads=64,kv_heads=64,head_dim=64,intermediate=18432",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="time the step with and without train.recompute_ttt_steps, alternating in one "
        "run: the step-time ratio and both peaks",
    )
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.ttt_steps=3")
    return p.parse_args(argv)


def random_draft(
    cfg, facts: dict, device: torch.device
) -> tuple[DraftConfig, TTTModel, torch.Tensor]:
    """The recipe's draft at the target's shape, seeded random weights and a random vocab map
    of model.draft_vocab_size target tokens -> (its config, the TTT model on `device`, t2d)."""
    aux_ids = cfg.target.aux_layer_ids or facts["aux_layer_ids"] or [1, 2, 3]
    vocab_size = facts["vocab_size"]
    dv = min(cfg.model.draft_vocab_size, vocab_size)
    draft_cfg = recipe_draft_config(cfg, facts, dv, aux_ids)
    method = method_of(draft_cfg)
    if not method.ttt_unroll:  # e.g. P-EAGLE's one-pass training (eagle3/methods/p_eagle/)
        raise SystemExit(
            f"bench_train: times the TTT unroll; model.draft.method={method.name} trains "
            "otherwise, which this benchmark does not build: compare tokens_per_s in its run's "
            "metrics.jsonl instead"
        )
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_cfg)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.randperm(vocab_size)[:dv]] = True
    draft.set_vocab(t2d.nonzero().squeeze(-1) - torch.arange(dv), t2d)
    model = TTTModel(draft, cfg.model.ttt_steps, recompute=cfg.train.recompute_ttt_steps)
    return draft_cfg, model.to(device), t2d


class TrainStep:
    """The recipe's step on a random batch of B x T: soft labels from a random target lm_head
    (their seconds summed in `label_time`), the TTT loss, backward, clip, AdamW."""

    def __init__(self, model: TTTModel, cfg, facts: dict, t2d, B: int, T: int, device, dtype):
        self.model, self.cfg, self.B, self.T = model, cfg, B, T
        self.device, self.dtype = device, dtype
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95))
        self.vocab_size, Ht = facts["vocab_size"], facts["hidden_size"]
        self.Ht = Ht
        self.lm_head = (torch.randn(self.vocab_size, Ht, device=device) * Ht**-0.5).to(dtype)
        self.t2d = t2d.to(device)
        self.label_time = 0.0

    def batch(self):
        B, T, Ht, device, dtype = self.B, self.T, self.Ht, self.device, self.dtype
        ids = torch.randint(0, self.vocab_size, (B, T), device=device)
        aux = torch.randn(B, T, 3 * Ht, device=device, dtype=dtype)
        last = torch.randn(B, T, Ht, device=device, dtype=dtype)
        return ids, aux, last, torch.ones(B, T, dtype=torch.long, device=device)

    def __call__(self) -> None:
        model, cfg, device = self.model, self.cfg, self.device
        ids, aux, last, mask = self.batch()
        sync(device)
        t0 = time.perf_counter()
        probs, in_vocab = target_probs(last, self.lm_head, self.t2d, cfg.data.lm_head_chunk)
        in_vocab[:] = True  # random labels: count every position
        sync(device)
        self.label_time += time.perf_counter() - t0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if model.recompute:  # each step's loss inside the step (eagle3/methods/eagle3.py)
                mb = {"input_ids": ids, "aux": aux, "segment_ids": None, "position_ids": None,
                      "sp": None, "probs": probs, "in_vocab": in_vocab, "loss_mask": mask,
                      "queries": None}  # fmt: skip
                loss, _ = recomputed_ttt_loss(model, mb, cfg.model.step_weight, None)
            else:
                logits = model(ids, aux)
                loss, _ = ttt_loss(logits, probs, in_vocab, mask, cfg.model.step_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides, check_paths=False)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    T = args.seq_len or cfg.data.max_length
    B = args.batch_size or cfg.data.batch_size
    K = cfg.model.ttt_steps

    if args.target_shape is not None:
        facts = shape_facts(args.target_shape)
    else:  # a registry target's plan_shape (Kimi: no download), else its config.json
        facts = facts_of(target_shape(cfg.target.name))
    draft_cfg, model, t2d = random_draft(cfg, facts, device)
    step = TrainStep(model, cfg, facts, t2d, B, T, device, dtype)
    if args.recompute:
        compare_recompute(model, step, device, args.steps, B, T, K)
        return
    peak = matmul_peak(device, dtype)
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step.label_time = 0.0
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * B * T / elapsed
    flops = train_flops_per_token(draft_cfg, T, K)
    achieved = flops * tokens_per_s
    mem = peak_memory_gb(device)
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{threads} threads'}), "
        f"{str(dtype).removeprefix('torch.')}; draft H={draft_cfg.hidden_size} I={draft_cfg.intermediate_size} "
        f"Vd={draft_cfg.draft_vocab_size} target V={facts['vocab_size']}; batch {B} x {T} tokens, ttt_steps {K}"
    )
    print(f"tokens/s          {tokens_per_s:,.0f}")
    print(f"peak memory       {mem:.2f} GiB")
    print(f"train FLOPs/token {flops / 1e9:.3f} GFLOP (analytic)")
    print(f"achieved          {achieved / 1e9:,.1f} GFLOP/s")
    print(f"{describe_peak(peak, dtype)} (measured, same run)")
    print(f"MFU               {100 * achieved / peak:.1f}%")
    print(
        f"label_share       {100 * step.label_time / elapsed:.1f}% of step time (target lm_head soft labels)"
    )


def compare_recompute(model, step, device, steps: int, B: int, T: int, K: int) -> None:
    """--recompute: one warm-up step of each mode, then `steps` of each, alternating (so load
    on a shared machine falls on both alike): seconds a step and each mode's peak."""
    seconds = {False: 0.0, True: 0.0}
    peaks = {False: 0.0, True: 0.0}
    for recompute in (False, True):
        model.recompute = recompute
        step()
    for _ in range(steps):
        for recompute in (False, True):
            model.recompute = recompute
            sync(device)
            t0 = time.perf_counter()
            peaks[recompute] = max(peaks[recompute], peak_above_start(device, step))
            sync(device)
            seconds[recompute] += time.perf_counter() - t0
    plain, recomputed = seconds[False] / steps, seconds[True] / steps
    print(f"device {device}; batch {B} x {T} tokens, ttt_steps {K}, {steps} steps of each mode")
    print(f"step time         {plain:.2f} s plain, {recomputed:.2f} s recomputed")
    print(f"ratio             {recomputed / plain:.2f}x the plain step's time")
    print(
        f"peak above start  {peaks[False]:.2f} GiB plain, {peaks[True]:.2f} GiB recomputed "
        f"({peaks[False] / max(peaks[True], 1e-9):.2f}x less)"
    )


if __name__ == "__main__":
    main()
