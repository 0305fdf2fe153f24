"""The memory plan of one rank, before anything is loaded: what every part of a training step
holds on each GPU, from the recipe, the DeepSpeed config and the node, and whether it fits.

    python train/train_drafter.py --config configs/train/kimi-k2.5-offline.yaml --plan \
        --gpus 8 --gpu-memory-gib 95

`plan_memory` is a pure function of numbers (no torch device, no weights): the draft's parameter
counts (from its DraftConfig, counted on torch's meta device), the run's lengths and batch, the
ZeRO stage and buckets, and the card. `check_fits` turns a plan over the card into one line that
names what would fit. What each term assumes:

- weights: every parameter of the draft (the frozen embeddings included: the target's copy, or
  a published drafter's own in its place, the same size) in the weight dtype: bf16 under DeepSpeed's bf16 (it casts the module), fp32 otherwise (autocast).
- anchor start: with train.anchor_l2, the starting weights of the trainable parameters in the
  weight dtype (train/anchor.py); its term and gradient are made in chunks (no fp32 copy).
- master + Adam: fp32 master weights, Adam's m and v (12 B a trainable parameter), sharded over
  the ranks by ZeRO 1/2/3; without DeepSpeed, Adam's m and v (8 B) on every rank.
- gradients: ZeRO-2 keeps this rank's partition in the accumulation dtype (fp32 with
  `data_types.grad_accum_dtype: fp32`) plus the reduce buckets (two with overlap_comm) and the
  all-gather bucket, each bucket_size elements in bf16; without DeepSpeed, full fp32 gradients.
- activations: saved for backward by the TTT unroll, per token per TTT step, counted per tensor
  class (ACTIVATION_TERMS). On a GPU under bf16 autocast the matmul outputs are bf16 and the
  hidden-size and loss terms fp32; on a CPU everything is fp32 (which is what
  tests/train/test_memory_plan.py measures: the fp32 count within 15% of the CPU peak's slope).
  The `flex` path also keeps every TTT step's concatenated keys and values, and its backward
  makes their gradient (the last step's concatenation, again) while they are held.
- activations with train.recompute_ttt_steps (eagle3/methods/eagle3.py): each step keeps its input
  hidden state and its keys and values until backward; backward holds one step's recomputed
  activations at a time, plus the gradients of the earlier steps' keys and values it makes
  and accumulates (RECOMPUTE_KV_BLOCKS a step, fitted to a CPU measurement).
- soft labels: fp32 probabilities over the draft vocab and a bool per token, for the
  micro-batches held at once (`labels_held`), plus one lm_head chunk's fp32 logits in flight.
- hidden-state batches: the micro-batches' aux (3 x target hidden) and last hidden states, bf16.
- target lm_head: the (vocab, target hidden) matrix the soft labels are made with, on the device.
- CUDA context: the context, cuBLAS workspaces and NCCL's buffers (CONTEXT_GB, a measured
  H100-class figure; the GPU check script measures it on the node).
- engine: online with a served target on the same GPUs, vLLM's --gpu-memory-utilization share.
- headroom: ALLOCATOR_HEADROOM of the card for fragmentation (lengths change every micro-batch;
  expandable_segments keeps this small).
- sequence parallelism (train.sequence_parallel = sp, train/sequence_parallel.py): a rank
  holds 1/sp of each record's positions, so activations, soft labels and hidden-state batches
  count max_length / sp tokens (attention's saved tensors too: nh/sp heads of the whole record
  are the bytes of nh heads of a shard); the halo of ttt_steps + 1 tokens is left out. The
  all-to-all adds one TTT step's q, k, v in both layouts plus the send copies, in flight,
  and the group's own NCCL communicator (NCCL_COMMUNICATOR_GB) beside the data-parallel one.
- loss: train.loss's chunk temporaries beyond the soft cross-entropy's (whose own are inside
  the measured activation and headroom terms): the LK losses' bool comparison of one chunk
  of positions (eagle3/losses/chunks.py), 64 MiB on CUDA; nothing for kl.
- soft-label cache (train/label_cache.py): data.label_cache_gb on the device when an
  offline run reads its records more than once (counted whenever it may: offline, > 0).

Sizes print in GiB (2^30 bytes), the unit torch reports a card's `total_memory` in and the one
`--gpu-memory-gib` takes; the launch plans the card torch reports.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from eagle3.errors import Eagle3Error
from eagle3.methods import draft_for, method_of
from eagle3.model import DraftConfig
from eagle3.ttt_attention import CUDA_CHUNK_SIZE, CUDA_KEY_BLOCK

GB = 1e9
GIB = 2**30
CONTEXT_GB = 2.0  # CUDA context + cuBLAS workspace + NCCL buffers per rank
# One more NCCL communicator on a rank (sequence parallelism's group beside the data-parallel
# one): NCCL's per-peer, per-channel buffers (4 MiB SIMPLE + ~4.5 MiB LL128 + LL) over a few
# channels to up to 7 peers, plus its all-to-all's peer-to-peer buffers: ~0.2-0.5 GB read from
# NCCL's defaults (NCCL_BUFFSIZE, channels on PCIe); the upper end is counted
NCCL_COMMUNICATOR_GB = 0.5
# With recomputed TTT steps, key/value blocks a step holds per token beyond its recomputed
# activations: its kept keys and values, their gradient accumulated from later steps, and the
# fresh gradient its recompute makes (fitted: see recompute_bytes_per_token)
RECOMPUTE_KV_BLOCKS = 3
# The same on the flex path in DeepSpeed's bf16 (a bf16 module, no autocast): only the step's
# own keys and values, measured on an H200 (benchmarks/gpu_check.py --mode deepspeed, Kimi's MLA
# draft, 16,384 -> 32,768 tokens: 1.49 MiB a token for the whole step, the plan now 1.53)
RECOMPUTE_FLEX_KV_BLOCKS = 1
ALLOCATOR_HEADROOM = 0.05  # of the card: fragmentation across changing lengths
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization when the recipe gives none
TILE_ROWS, TILE_KEYS = CUDA_CHUNK_SIZE, CUDA_KEY_BLOCK  # the chunked TTT kernel's tile on CUDA
ATTENTION_PATHS = ("chunked", "flash", "flex")


@dataclass
class Node:
    """The GPUs one rank sees: how many ranks share the work and one card's memory."""

    gpus: int
    gpu_bytes: float


@dataclass
class ZeroSetup:
    """What the DeepSpeed config says (stage 0: no DeepSpeed, plain data parallel)."""

    stage: int = 0
    reduce_bucket: float = 5e8  # elements
    allgather_bucket: float = 5e8
    overlap_comm: bool = False
    grad_accum_fp32: bool = False


@dataclass
class RunShape:
    """The recipe's numbers a step's memory depends on."""

    max_length: int
    batch_size: int
    grad_accum: int
    ttt_steps: int
    bf16: bool  # weights bf16 under DeepSpeed, activations under autocast
    attention_path: str = "chunked"
    labels_held: int = 1  # micro-batches whose soft labels exist at once
    lm_head_chunk: int = 1024
    engine_fraction: float = 0.0  # online, served on these GPUs: the engine's share of a card
    engine_weights_bytes: float = 0.0  # the served target's weights on each card (0: unknown)
    sequence_parallel: int = 1  # ranks sharing each record (train.sequence_parallel)
    anchor: bool = False  # train.anchor_l2 > 0: a copy of the starting weights (train/anchor.py)
    recompute: bool = False  # train.recompute_ttt_steps: each TTT step recomputed in backward
    label_cache_bytes: float = 0.0  # data.label_cache_gb on the device (offline, > 1 epoch)
    # train.loss's temporaries beyond the soft cross-entropy's, one chunk of positions at a time
    # (eagle3/losses/chunks.py: Objective.extra_bytes_per_element x CE_CHUNK_ELEMENTS)
    loss_extra_bytes: float = 0.0


@dataclass
class Plan:
    """Bytes per rank by part (insertion order is the printed order)."""

    parts: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    card_bytes: float = 0.0
    per_token_bytes: float = 0.0  # everything that grows with max_length x batch_size
    run: RunShape | None = None
    ranks: int = 1  # the node's GPUs: the sequence-parallel sizes there are
    heads: int = 1  # the draft's attention heads (a sequence-parallel size must divide them)
    sp_exchange_bytes: float = 0.0  # the all-to-all copies per local token under sequence parallel
    # False for P-EAGLE, whose one-pass training (dense per-depth attention over its
    # subsampled slots) this plan does not model: printed as an estimate, never a refusal
    modelled: bool = True

    def add(self, name: str, nbytes: float, note: str) -> None:
        self.parts[name] = nbytes
        self.notes[name] = note

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.card_bytes

    def table(self) -> str:
        """The plan as a table: one part a line, GiB and how it was counted."""
        lines = [f"memory plan per rank ({self.card_bytes / GIB:.1f} GiB card):"]
        for name, value in self.parts.items():
            lines.append(f"  {name:<22} {value / GIB:7.2f} GiB  {self.notes.get(name, '')}")
        verdict = "fits" if self.fits else "does NOT fit"
        if not self.modelled:
            verdict += " (P-EAGLE: activations estimated as TTT steps, not enforced)"
        lines.append(
            f"  {'total':<22} {self.total / GIB:7.2f} GiB  {verdict}; "
            f"{(self.card_bytes - self.total) / GIB:+.2f} GiB left"
        )
        return "\n".join(lines)


# -- the parts --------------------------------------------------------------------------------
def parameter_counts(draft_cfg: DraftConfig) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft, counted on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        draft = draft_for(draft_cfg)  # P-EAGLE's plain layers and mask_hidden too
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    return trainable, frozen


def activation_terms(cfg: DraftConfig) -> dict[str, int]:
    """Elements saved for backward per token per TTT step, by class: "matmul" (linear outputs
    and attention tensors: bf16 under autocast) and "fp32" (the residual stream, norms and the
    loss's logits: fp32 either way).

    The attention tensors are q, k, v, MLA's latents and kv_b's output, and the attention
    output; the MLP's gate, up, activation and product (+2 in flight); the residual/norm
    tensors of width H and the draft-vocab logits. The coefficients (1.7 x the attention
    tensors, 6 x intermediate, 14 x H, 2 x draft vocab) are fitted to CPU measurements of the
    peak's slope at Kimi's MLA head layout: tests/train/test_memory_plan.py's draft (hidden 256,
    3 TTT steps; 1024 -> 2048 tokens: 1.17-1.20 MiB/token over four runs) +5% to +7%, and
    benchmarks/bench_long_context.py's kimi-mla draft (hidden 1024, 7 steps; 512 -> 1024 tokens,
    whose slope runs 5-10% low) +10%. At 2 TTT steps the count is 16-22% high (conservative).
    The GQA count (q, rotated q and the output per query head, k and v expanded to them) is
    not yet validated: -7% to +3% at hidden 256 and 3 steps, but -22% to -30% at hidden 512
    and 2 steps; the Kimi recipes train MLA."""
    H, inter, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    if cfg.attention == "mla":
        dv = cfg.v_head_dim
        latents = cfg.q_lora_rank + cfg.kv_lora_rank
        attention = 2 * nh * hd + 2 * nh * dv + latents + nh * (cfg.qk_nope_head_dim + dv)
    else:  # q, rotated q and the output per query head; k and v expanded to the query heads
        attention = 5 * nh * hd + 2 * cfg.num_key_value_heads * hd
    return {"matmul": 17 * attention // 10 + 6 * inter, "fp32": 14 * H + 2 * Vd}


def activation_bytes_per_token(
    cfg: DraftConfig, ttt_steps: int, bf16: bool, module_bf16: bool = False
) -> float:
    """Activation bytes per token of one micro-batch row (all TTT steps, saved for backward).
    module_bf16: DeepSpeed's bf16, a bf16 module without autocast, where the "fp32" class is
    bf16 too (measured on an H200, benchmarks/gpu_check.py --mode deepspeed: Kimi's MLA draft,
    2,048 -> 12,288 tokens, 5.9 MB a token with flex's K/V, the plan 6.7 with them)."""
    terms = activation_terms(cfg)
    fp32_b = 2 if module_bf16 else 4
    return ttt_steps * (terms["matmul"] * (2 if bf16 else 4) + terms["fp32"] * fp32_b)


def kv_block_bytes(cfg: DraftConfig, bf16: bool) -> float:
    """One TTT step's keys and values a token (MLA: expanded per head, as training uses them)."""
    v = cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    kv_heads = cfg.num_attention_heads if cfg.attention == "mla" else cfg.num_key_value_heads
    return kv_heads * (cfg.head_dim + v) * (2 if bf16 else 4)


def recompute_bytes_per_token(
    cfg: DraftConfig,
    ttt_steps: int,
    bf16: bool,
    module_bf16: bool = False,
    kv_blocks: int = RECOMPUTE_KV_BLOCKS,
) -> float:
    """Activation bytes per token with train.recompute_ttt_steps: every step's input hidden
    state (fp32 class) and RECOMPUTE_KV_BLOCKS key/value blocks, plus one step's activations
    (the one being recomputed). Fitted at Kimi's MLA head layout on CPU (fp32, chunked):
    tests/train/test_memory_plan.py's draft (hidden 256, 3 TTT steps) and bench_long_context's
    (hidden 1024, 7 steps); the numbers are in test_recompute_term_within_15_percent_of_cpu_slope.
    One step's activations count as activation_bytes_per_token's (module_bf16 likewise), and
    `kv_blocks` key/value blocks a step are kept (RECOMPUTE_FLEX_KV_BLOCKS for flex in DeepSpeed's
    bf16, measured on an H200)."""
    fp32_b = 2 if module_bf16 else 4
    one_step = activation_bytes_per_token(cfg, 1, bf16, module_bf16)
    kept = fp32_b * cfg.hidden_size + kv_blocks * kv_block_bytes(cfg, bf16)
    return ttt_steps * kept + one_step


def flex_kv_bytes_per_token(
    cfg: DraftConfig, ttt_steps: int, bf16: bool, recompute: bool = False
) -> float:
    """flex attends over every earlier TTT step's keys and values concatenated: step k keeps
    (k + 1) blocks of them for backward, and backward makes their gradient (ttt_steps blocks
    at the last step) while they are held. Recomputed steps: only the step being recomputed
    keeps its concatenation (ttt_steps blocks at most); its gradient is the fresh gradient
    recompute_bytes_per_token already counts."""
    if recompute:
        return ttt_steps * kv_block_bytes(cfg, bf16)
    return (ttt_steps * (ttt_steps + 1) // 2 + ttt_steps) * kv_block_bytes(cfg, bf16)


def sp_exchange_bytes_per_token(cfg: DraftConfig, bf16: bool) -> float:
    """Ulysses' in-flight copies per local token: q, k and v (KV heads repeated to the query
    heads where the group does not divide them: counted at the query heads) three times (the
    shard's, the send buffer, the received record's share)."""
    v = cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    per_head = 2 * cfg.head_dim + v
    return 3 * cfg.num_attention_heads * per_head * (2 if bf16 else 4)


def plan_memory(
    draft_cfg: DraftConfig, run: RunShape, zero: ZeroSetup, node: Node, lm_head_rows: int
) -> Plan:
    """Bytes of every part on one rank (see the module docstring for what each assumes)."""
    if run.attention_path not in ATTENTION_PATHS:
        raise Eagle3Error(f"attention path {run.attention_path!r} is not one of {ATTENTION_PATHS}")
    sp = run.sequence_parallel
    tokens = run.max_length * run.batch_size // sp  # one micro-batch row set (this rank's shard)
    p = Plan(
        card_bytes=node.gpu_bytes,
        run=run,
        ranks=node.gpus,
        heads=draft_cfg.num_attention_heads,
        sp_exchange_bytes=sp_exchange_bytes_per_token(draft_cfg, run.bf16),
    )
    add_model_state(p, draft_cfg, run, zero, node.gpus)
    module_bf16 = zero.stage > 0 and run.bf16  # DeepSpeed casts the module: no autocast, all bf16
    act_tok = add_activations(p, draft_cfg, run, tokens, module_bf16)
    label_tok, hidden_tok = add_batches(p, draft_cfg, run, tokens, lm_head_rows)
    if run.loss_extra_bytes:
        p.add("loss (LK)", run.loss_extra_bytes, "one chunk's q < p mask (train.loss)")
    p.add("CUDA context", CONTEXT_GB * GB, "context, cuBLAS, NCCL")
    p.add(
        "allocator headroom",
        ALLOCATOR_HEADROOM * node.gpu_bytes,
        f"{ALLOCATOR_HEADROOM:.0%} of the card (changing lengths)",
    )
    if run.engine_fraction:
        p.add(
            "engine (vLLM)",
            run.engine_fraction * node.gpu_bytes,
            f"--gpu-memory-utilization {run.engine_fraction:g}"
            + (
                f" (the target's weights: ~{run.engine_weights_bytes / GIB:.0f} GiB a card)"
                if run.engine_weights_bytes
                else ""
            ),
        )
    p.per_token_bytes = (act_tok + label_tok * run.labels_held + hidden_tok * run.grad_accum) / sp
    return p


def add_model_state(p: Plan, draft_cfg: DraftConfig, run: RunShape, zero: ZeroSetup, gpus: int):
    """The weights, the anchor's start, the optimizer state, the gradients and ZeRO's buckets."""
    trainable, frozen = parameter_counts(draft_cfg)
    deepspeed = zero.stage > 0
    weight_b = 2 if (deepspeed and run.bf16) else 4
    weight_dtype = "bf16" if weight_b == 2 else "fp32"
    shards = gpus if deepspeed else 1
    p.add(
        "draft weights",
        (trainable + frozen) * weight_b,
        f"{trainable / 1e6:.0f}M trainable + {frozen / 1e6:.0f}M frozen embeddings, {weight_dtype}",
    )
    if run.anchor:  # θ_start in the weights' dtype, whole on every rank (ZeRO-2 / DDP)
        p.add(
            "anchor start",
            trainable * weight_b,
            f"train.anchor_l2: the {trainable / 1e6:.0f}M trainable starting weights, "
            f"{weight_dtype}",
        )
    opt_b = 12 if (deepspeed and run.bf16) else 8
    p.add(
        "master + Adam",
        trainable * opt_b / shards,
        f"{opt_b} B/param{' (fp32 master, m, v)' if opt_b == 12 else ' (m, v)'}"
        + (f" / {shards} ranks (ZeRO-{zero.stage})" if deepspeed else ""),
    )
    if not deepspeed:
        p.add("gradients", trainable * 4, "fp32, every rank")
        return
    grad_b = 4 if zero.grad_accum_fp32 or not run.bf16 else 2
    p.add(
        "gradients",
        trainable * grad_b / (shards if zero.stage >= 2 else 1),
        f"{'fp32' if grad_b == 4 else 'bf16'} accumulation"
        + (f", / {shards} ranks" if zero.stage >= 2 else ""),
    )
    buckets = zero.reduce_bucket * 2 * (2 if zero.overlap_comm else 1)
    p.add(
        "ZeRO buckets",
        buckets + zero.allgather_bucket * 2,
        f"reduce {zero.reduce_bucket:.0e}{' x 2 (overlap_comm)' if zero.overlap_comm else ''}"
        f" + allgather {zero.allgather_bucket:.0e} elements, bf16",
    )


def add_activations(
    p: Plan, draft_cfg: DraftConfig, run: RunShape, tokens: int, module_bf16: bool
) -> float:
    """The TTT unroll's activations (with flex's K/V or one tile's scores) and, under sequence
    parallelism, the all-to-all copies and the group's communicator -> bytes per local token."""
    if run.recompute:
        flex_bf16 = module_bf16 and run.attention_path == "flex"
        blocks = RECOMPUTE_FLEX_KV_BLOCKS if flex_bf16 else RECOMPUTE_KV_BLOCKS
        act_tok = recompute_bytes_per_token(draft_cfg, run.ttt_steps, run.bf16, module_bf16, blocks)
    else:
        act_tok = activation_bytes_per_token(draft_cfg, run.ttt_steps, run.bf16, module_bf16)
    acts = act_tok * tokens
    note = f"{act_tok / 2**20:.2f} MiB/token x {tokens} tokens" + (
        " (each TTT step recomputed)" if run.recompute else ""
    )
    if run.attention_path == "flex":
        flex_tok = flex_kv_bytes_per_token(draft_cfg, run.ttt_steps, run.bf16, run.recompute)
        acts += flex_tok * tokens
        act_tok += flex_tok
        note += f" + flex's concatenated K/V{'' if run.recompute else ' and its gradient'} " + (
            f"{flex_tok / 2**20:.2f} MiB/token"
        )
    else:  # one tile's fp32 scores, probabilities and gradient
        acts += 3 * 4 * draft_cfg.num_attention_heads * TILE_ROWS * TILE_KEYS
    method = method_of(draft_cfg)
    if method.unmodelled_memory:  # an estimate only (Plan.modelled)
        p.modelled = False
        note += f"; {method.name}: {method.unmodelled_memory}"
    sp = run.sequence_parallel
    p.add(
        "activations",
        acts,
        f"{note} ({run.attention_path})"
        + (f", 1/{sp} of each record (sequence parallel)" if sp > 1 else ""),
    )
    if sp > 1:  # q, k, v of one step: the shard's, the whole record's share, the send copies
        exchange = sp_exchange_bytes_per_token(draft_cfg, run.bf16)
        p.add(
            "SP all-to-all",
            exchange * tokens,
            f"{exchange / 1024:.0f} KiB/token x {tokens} tokens: one TTT step's q/k/v all-to-all",
        )
        act_tok += exchange
        p.add(
            "SP communicator",
            NCCL_COMMUNICATOR_GB * GB,
            "the group's NCCL communicator beside the data-parallel one",
        )
    return act_tok


def add_batches(
    p: Plan, draft_cfg: DraftConfig, run: RunShape, tokens: int, lm_head_rows: int
) -> tuple[float, float]:
    """The soft labels (and their cache), the hidden-state batches and the target's lm_head
    -> (label bytes, hidden-state bytes) per local token."""
    label_tok = 4 * draft_cfg.draft_vocab_size + 1
    p.add(
        "soft labels",
        label_tok * tokens * run.labels_held
        + 4 * run.lm_head_chunk * lm_head_rows * 2,  # a chunk's logits and its softmax
        f"{label_tok / 1024:.0f} KiB/token x {tokens} tokens x {run.labels_held} micro-batch(es)"
        f" + lm_head chunk {run.lm_head_chunk} rows",
    )
    if run.label_cache_bytes:
        p.add(
            "soft-label cache",
            run.label_cache_bytes,
            "data.label_cache_gb (data.label_cache_gb=0: none)",
        )
    Ht = draft_cfg.target_hidden_size
    hidden_tok = 4 * Ht * 2
    p.add(
        "hidden-state batches",
        hidden_tok * tokens * run.grad_accum,
        f"{hidden_tok / 1024:.0f} KiB/token x {tokens} tokens x {run.grad_accum} micro-batches,"
        " bf16",
    )
    p.add("target lm_head", lm_head_rows * Ht * 2, f"{lm_head_rows} x {Ht}, bf16 (soft labels)")
    return label_tok, hidden_tok


# -- what would fit ---------------------------------------------------------------------------
def fitting_length(plan: Plan) -> int:
    """The longest max_length (a multiple of 256) that fits this plan's card, 0 if none."""
    run = plan.run
    fixed = plan.total - plan.per_token_bytes * run.max_length * run.batch_size
    room = plan.card_bytes - fixed
    if room <= 0:
        return 0
    return int(room / (plan.per_token_bytes * run.batch_size)) // 256 * 256


def fitting_sequence_parallel(plan: Plan) -> int:
    """The smallest train.sequence_parallel above the plan's (dividing the ranks and the
    heads) under which it fits the card, 0 if none."""
    run, sp = plan.run, plan.run.sequence_parallel
    tokens = run.max_length * run.batch_size
    fixed = plan.total - plan.per_token_bytes * tokens
    per_rank_token = plan.per_token_bytes * sp - (plan.sp_exchange_bytes if sp > 1 else 0.0)
    for more in range(sp + 1, plan.ranks + 1):
        if plan.ranks % more or plan.heads % more:
            continue
        if fixed + (per_rank_token + plan.sp_exchange_bytes) * tokens / more <= plan.card_bytes:
            return more
    return 0


def engine_loads(plan: Plan) -> bool:
    """Whether the engine's share of a card holds the target's weights, with 10% for its KV
    cache and activations (unknown weights: assumed to)."""
    run = plan.run
    return run.engine_fraction * plan.card_bytes >= 1.1 * run.engine_weights_bytes


def check_fits(plan: Plan, online: bool) -> None:
    """Raise one line naming what would fit when the plan is over the card, or when the
    engine's share of it cannot hold the target's weights."""
    run = plan.run
    elsewhere = (
        "serve the target from another node (there: python -m datagen.capture --serve --target "
        "T --host 0.0.0.0 --port 8100; here: target.engine.url=http://THAT_NODE:8100, TMPDIR on "
        "a filesystem both see) or train offline (data.mode=offline; capture first: "
        "python -m datagen.capture)"
    )
    if run.engine_fraction and not engine_loads(plan):
        need = 1.1 * run.engine_weights_bytes / plan.card_bytes
        raise Eagle3Error(
            f"the engine's share of a card ({run.engine_fraction * plan.card_bytes / GIB:.0f} GiB "
            f"at --gpu-memory-utilization {run.engine_fraction:g}) cannot hold the target's "
            f"~{run.engine_weights_bytes / GIB:.0f} GiB of weights a card plus its cache (it "
            f"needs >= {need:.2f}, leaving {(1 - need) * plan.card_bytes / GIB:.0f} GiB for the "
            f"drafter, which needs {(plan.total - plan.parts['engine (vLLM)']) / GIB:.0f} GiB): "
            + elsewhere
        )
    if plan.fits:
        return
    if not plan.modelled:
        print(
            f"memory plan: {plan.total / GIB:.1f} GiB a rank estimated for a P-EAGLE run the plan "
            "does not model; not refused (watch the first steps' peak_mem_gb)",
            file=sys.stderr,
            flush=True,
        )
        return
    over = (plan.total - plan.card_bytes) / GIB
    options = []
    length = fitting_length(plan)
    if length >= 512:
        options.append(f"data.max_length={length}")
    sp = fitting_sequence_parallel(plan)
    if sp:
        options.append(f"train.sequence_parallel={sp} (each record split over {sp} ranks)")
    if run.batch_size > 1:
        options.append("data.batch_size=1")
    if online and run.engine_fraction:
        options.append(elsewhere)
    raise Eagle3Error(
        f"the memory plan needs {plan.total / GIB:.1f} GiB a rank, {over:.1f} GiB over the "
        f"{plan.card_bytes / GIB:.1f} GiB card (run --plan for the table): "
        + ("; or ".join(options) if options else "use cards with more memory")
    )
