"""train/anchor.py: the L2 pull toward model.init_from's weights (train.anchor_l2)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin
from torch import nn

from eagle3.errors import ConfigError
from train.anchor import FINGERPRINT, Anchor, anchor_active, weights_dtype
from train.config import load_config


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    model.add_module("frozen", nn.Embedding(5, 4))
    model.frozen.weight.requires_grad_(False)  # like the target's embeddings: not anchored
    return model


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def moved(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move every weight (trained, as it were) -> the start's copies."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return start


def fake_accelerator(zero_stage: int | None = None, fsdp: bool = False):
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    kind = DistributedType.FSDP if fsdp else DistributedType.NO
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin),
        distributed_type=kind,
        is_main_process=True,
        device=torch.device("cpu"),
        mixed_precision="no",
    )


def run_cfg(anchor_l2: float, init_from: str | None = "start/"):
    return SimpleNamespace(
        train=SimpleNamespace(anchor_l2=anchor_l2), model=SimpleNamespace(init_from=init_from)
    )


@pytest.mark.parametrize("chunk", [1 << 24, 5])
def test_term_and_gradient_are_the_formula(chunk, monkeypatch):
    """~0.1 s: loss + λΣ‖θ−θ0‖² over the trainable weights only, gradient 2λ(θ−θ0), the
    logged term and distance, in one piece and in chunks of 5 elements; the frozen embedding
    takes no part."""
    monkeypatch.setattr("train.anchor.CHUNK", chunk)
    model = tiny()
    anchor = Anchor(0.25, trainable(model))
    start = moved(model)
    loss = anchor.added_to(torch.tensor(1.0))
    names = [n for n, _ in trainable(model)]
    params = dict(model.named_parameters())
    sq = sum(float((params[n] - start[n]).detach().square().sum()) for n in names)
    assert float(loss.detach()) == pytest.approx(1.0 + 0.25 * sq, rel=1e-6)
    loss.backward()
    for n in names:
        torch.testing.assert_close(params[n].grad, 2 * 0.25 * (params[n] - start[n]).detach())
    assert model.frozen.weight.grad is None
    logged = anchor.metrics()
    assert logged["anchor"] == pytest.approx(0.25 * sq, rel=1e-6)
    assert logged["anchor_dist"] == pytest.approx(sq**0.5, rel=1e-6)


def test_bf16_weights_anchor_to_their_bf16_start():
    """~0.05 s: under DeepSpeed's bf16 the start is kept in bf16 (the module's weights), the
    term is summed in fp32 and the gradient comes back in the weight's dtype."""
    assert weights_dtype(True, "bf16") == torch.bfloat16
    assert weights_dtype(False, "bf16") == torch.float32  # autocast: fp32 weights
    model = tiny().to(torch.bfloat16)
    anchor = Anchor(2.0, trainable(model), dtype=weights_dtype(True, "bf16"))
    assert all(s.dtype == torch.bfloat16 for s in anchor.start)
    start = moved(model)
    anchor.added_to(torch.zeros(())).backward()
    for name, p in trainable(model):
        diff = p.detach().float() - start[name].float()
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad, (4.0 * diff).to(torch.bfloat16))
    sq = sum(
        float((p.detach().float() - start[n].float()).square().sum()) for n, p in trainable(model)
    )
    assert anchor.metrics()["anchor"] == pytest.approx(2.0 * sq, rel=1e-5)


def test_accumulated_micro_batches_add_one_anchor_gradient():
    """~0.2 s: accelerate divides each of G micro-losses by G, so the term added to every
    micro-batch sums to exactly one 2λ(θ−θ0) per optimizer step (DDP's mean over ranks of the
    same whole term is the same argument)."""
    model = tiny()
    anchor = Anchor(0.5, trainable(model))
    start = moved(model)
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3)
    )
    for _ in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(anchor.added_to(torch.zeros(())))
    for name, p in trainable(model):
        torch.testing.assert_close(p.grad, (2 * 0.5 * (p - start[name])).detach())


def test_off_changes_nothing(tmp_path):
    """~0.05 s: train.anchor_l2=0 returns the very loss tensor (bit-equal), logs nothing and
    writes no fingerprint."""
    anchor = Anchor.for_run(run_cfg(0.0), fake_accelerator(), tiny(), tmp_path, resumed=False)
    loss = torch.tensor(0.123456789)
    assert anchor.added_to(loss) is loss
    assert anchor.metrics() == {}
    assert not (tmp_path / FINGERPRINT).exists()


def test_resume_restores_the_anchor_and_refuses_a_changed_start(tmp_path):
    """~0.1 s: a resumed run rebuilt from the same init_from anchors to the same weights (the
    checkpoint's trained ones are loaded after); a start whose weights changed is refused."""
    first = Anchor.for_run(run_cfg(1e-4), fake_accelerator(2), tiny(0), tmp_path, resumed=False)
    assert json.loads((tmp_path / FINGERPRINT).read_text())["init_from"] == "start/"
    again = Anchor.for_run(run_cfg(1e-4), fake_accelerator(2), tiny(0), tmp_path, resumed=True)
    for a, b in zip(first.start, again.start):
        assert a.equal(b)
    with pytest.raises(ConfigError, match="not the start this run was anchored to"):
        Anchor.for_run(run_cfg(1e-4), fake_accelerator(2), tiny(1), tmp_path, resumed=True)


@pytest.mark.parametrize(
    "anchor_l2, init_from, zero_stage, fsdp, expected",
    [
        (0.0, None, 3, True, False),  # off: nothing to refuse
        (1e-4, "start/", 0, False, True),  # DDP / one process
        (1e-4, "start/", 2, False, True),  # ZeRO-2: whole weights on every rank
        (1e-4, None, 0, False, "model.init_from, which is not set"),
        (1e-4, "start/", 3, False, "ZeRO-3 shards"),
        (1e-4, "start/", 0, True, "FSDP shards"),
    ],
)
def test_policy(anchor_l2, init_from, zero_stage, fsdp, expected):
    """~0 s: when the anchor applies, and the one-line refusals."""
    if isinstance(expected, bool):
        assert anchor_active(anchor_l2, init_from, zero_stage, fsdp) is expected
    else:
        with pytest.raises(ConfigError, match=expected):
            anchor_active(anchor_l2, init_from, zero_stage, fsdp)


def test_config_refuses_an_anchor_without_a_start():
    """~0.1 s: the config check names train.anchor_l2 before anything loads."""
    with pytest.raises(ConfigError, match="train.anchor_l2=0.0001 pulls toward"):
        load_config(None, ["train.anchor_l2=1e-4"], check_paths=False)
    with pytest.raises(ConfigError, match="train.anchor_l2 must be >= 0"):
        load_config(None, ["train.anchor_l2=-1", "model.init_from=x"], check_paths=False)
