"""The L2 anchor of a fine-tune: train.anchor_l2 = λ adds λ·Σ‖θ − θ_start‖² over the trainable
parameters to every micro-batch's loss, pulling the weights toward model.init_from's so a
fine-tune on a little new data keeps what the start knew.

Exact under the loop's scaling: accelerate divides each micro-loss by optim.grad_accum and DDP
/ ZeRO-1/2 average the ranks' gradients, so the same whole term added on every micro-batch of
every rank contributes exactly one ∇(λ·Σ‖θ − θ_start‖²) = 2λ(θ − θ_start) per optimizer step.
That needs every rank to hold the whole parameters: true under DDP and ZeRO-1/2 (ZeRO-2 shards
gradients and optimizer states, not the module's weights); ZeRO-3 and FSDP shard the weights
(a rank's parameter is an empty placeholder outside the forward) and are refused.

θ_start: copies of the trainable parameters as model.init_from loaded them (taken before a
resume restores the trained ones), on the parameters' device, in the dtype the module trains
its weights in: fp32 under accelerate's autocast, bf16 under DeepSpeed's bf16 (whose fp32
master weights are the optimizer's, sharded; a published bf16 start is exact there). The term
is summed in fp32 and its gradient made at backward, in chunks, so no fp32 copy of a weight
lives beside the activations. θ_start is never saved: a resumed run loads init_from
again, and `anchor.json` in train.out_dir (a sha256 of θ_start, written when the anchored run
starts) refuses a resume whose init_from changed or vanished.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch import nn

from eagle3.errors import ConfigError

FINGERPRINT = "anchor.json"  # in train.out_dir: what θ_start was


def anchor_active(anchor_l2: float, init_from: str | None, zero_stage: int, fsdp: bool) -> bool:
    """Whether the run adds the anchor term; ConfigError (one line) where it cannot be exact.

    zero_stage: DeepSpeed's ZeRO stage (0: no DeepSpeed); fsdp: an accelerate FSDP launch."""
    if anchor_l2 == 0:
        return False
    if init_from is None:
        raise ConfigError(
            f"train.anchor_l2={anchor_l2:g} pulls toward the starting weights of "
            "model.init_from, which is not set: set model.init_from or train.anchor_l2=0"
        )
    if zero_stage >= 3 or fsdp:
        raise ConfigError(
            f"train.anchor_l2 needs every rank to hold the whole draft, which "
            f"{'FSDP' if fsdp else 'ZeRO-3'} shards: launch with ZeRO-2 "
            "(configs/accelerate/8gpu-zero2.yaml) or set train.anchor_l2=0"
        )
    return True


def fingerprint(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the names, shapes and fp32 bytes of the tensors, in order."""
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def check_fingerprint(out_dir: Path, init_from: str, digest: str, resumed: bool) -> bool:
    """Compare θ_start's digest with the run's anchor.json -> whether it must be written (a
    fresh run, or a resume of a run that had no anchor yet). A resume whose start differs is
    refused: its anchor would not be the one the checkpoint was trained toward."""
    path = out_dir / FINGERPRINT
    if not (resumed and path.is_file()):
        return True
    recorded = json.loads(path.read_text())
    if recorded["sha256"] != digest:
        raise ConfigError(
            f"model.init_from {init_from} is not the start this run was anchored to "
            f"({recorded['init_from']}, {path}): its weights changed since the run began; "
            "restore them, or start a new run (train.out_dir) from the new ones"
        )
    return False


CHUNK = 1 << 24  # elements of fp32 temporaries at once: the term never holds a weight in fp32


def weights_dtype(deepspeed: bool, mixed_precision: str) -> torch.dtype:
    """The dtype the module holds its weights in during training: DeepSpeed casts it to its
    half type (its fp32 master copy is the optimizer's, sharded); accelerate's autocast keeps
    fp32 weights."""
    if deepspeed and mixed_precision in ("bf16", "fp16"):
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return torch.float32


def squared_distance(p: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Σ(p − start)² in fp32, CHUNK elements at a time -> a 0-d fp32 tensor."""
    flat_p, flat_s = p.detach().reshape(-1), start.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=p.device)
    for i in range(0, flat_p.numel(), CHUNK):
        total += (flat_p[i : i + CHUNK].float() - flat_s[i : i + CHUNK].float()).square().sum()
    return total


class _SquaredDistance(torch.autograd.Function):
    """Σ(p − start)² with its gradient 2(p − start) made in p's dtype at backward, so neither
    the forward nor the graph keeps an fp32 copy of a weight while the activations live."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p, start)
        return squared_distance(p, start)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, start = ctx.saved_tensors
        out, flat_p, flat_s = torch.empty_like(p), p.reshape(-1), start.reshape(-1)
        flat_out, scale = out.view(-1), 2 * grad.float()
        for i in range(0, flat_p.numel(), CHUNK):
            diff = flat_p[i : i + CHUNK].float() - flat_s[i : i + CHUNK].float()
            flat_out[i : i + CHUNK] = diff.mul_(scale)
        return out, None


class Anchor:
    """λ·Σ‖θ − θ_start‖² over the trainable parameters (off: adds nothing, logs nothing)."""

    def __init__(
        self,
        weight: float,
        params: list[tuple[str, nn.Parameter]],
        device=None,
        dtype: torch.dtype = torch.float32,
    ):
        self.weight = weight
        self.params = [p for _, p in params]
        # in the dtype the module trains its weights in (weights_dtype): the distance at the
        # first step is exactly 0 and a bf16 start (published drafters are bf16) is exact
        self.start = [p.detach().to(device, dtype, copy=True) for p in self.params]
        self.last: torch.Tensor | None = None  # the latest term, detached: logged, no sync

    @classmethod
    def for_run(cls, cfg, accelerator, model: nn.Module, out_dir: Path, resumed: bool) -> Anchor:
        """The anchor of train.anchor_l2 toward `model`'s weights now (model.init_from's, before
        any resume): fingerprinted in out_dir/anchor.json, checked against it on resume."""
        plugin = accelerator.state.deepspeed_plugin
        active = anchor_active(
            cfg.train.anchor_l2,
            cfg.model.init_from,
            plugin.zero_stage if plugin is not None else 0,
            accelerator.distributed_type == DistributedType.FSDP,
        )
        if not active:
            return cls(0.0, [])
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        digest = fingerprint(named)  # every rank: each refuses alike, none waits on another
        if check_fingerprint(out_dir, cfg.model.init_from, digest, resumed):
            if accelerator.is_main_process:
                out_dir.mkdir(parents=True, exist_ok=True)
                record = {"init_from": cfg.model.init_from, "sha256": digest}
                (out_dir / FINGERPRINT).write_text(json.dumps(record, indent=1))
        dtype = weights_dtype(plugin is not None, accelerator.mixed_precision)
        return cls(cfg.train.anchor_l2, named, accelerator.device, dtype)

    def added_to(self, loss: torch.Tensor) -> torch.Tensor:
        """loss + λ·Σ‖θ − θ_start‖² (off: `loss` itself, untouched)."""
        if not self.weight:
            return loss
        sq = [_SquaredDistance.apply(p, s) for p, s in zip(self.params, self.start)]
        term = self.weight * torch.stack(sq).sum()
        self.last = term.detach()
        return loss + term

    def metrics(self) -> dict[str, float]:
        """The last term added (`anchor`) and ‖θ − θ_start‖ (`anchor_dist`); {} when off."""
        if not self.weight or self.last is None:
            return {}
        term = float(self.last)
        return {"anchor": term, "anchor_dist": (term / self.weight) ** 0.5}
