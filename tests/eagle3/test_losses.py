"""eagle3/losses/: every objective's values and gradients against plain autograd, its minimum
at q = p, and why LK exists: a draft too small to match p reaches a higher acceptance with it."""

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.losses import LOSSES, chunks, objective_named, position_loss


def reference(name: str, logits: torch.Tensor, p: torch.Tensor, eta: float) -> tuple:
    """The objective written plainly (autograd does the gradient) -> (loss, alpha) per row."""
    logq = logits.log_softmax(-1)
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)
    if name == "kl":
        return -(p * logq).sum(-1), alpha
    if name == "lk-alpha":
        return -alpha.clamp_min(1e-6).log(), alpha
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (p.sum(-1) - alpha), alpha


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("chunk_elements", [3 * 11, 2**21], ids=["3-row-chunks", "one-chunk"])
def test_values_and_gradients_equal_autograd_of_the_plain_objective(
    name, chunk_elements, monkeypatch
):
    """Cheap (~0.05 s): values, alpha, argmax and the logits' gradient of each objective equal
    autograd of its plain form on random p and q, in chunks that do not divide n, with an
    unlabelled (all-zero) row that carries neither loss nor gradient."""
    monkeypatch.setitem(chunks.CE_CHUNK_ELEMENTS, "cpu", chunk_elements)
    torch.manual_seed(0)
    B, T, n, V, eta = 2, 13, 10, 11, 2.5
    leaf = (torch.randn(B, T, V) * 2).double().float().requires_grad_()
    p = torch.randn(B, n, V).mul(2).softmax(-1)
    p[1, 3] = 0
    weights = torch.randn(B, n)
    weights[1, 3] = 0  # as step_loss masks an unlabelled row
    ref = leaf.detach().clone().requires_grad_()
    want, want_alpha = reference(name, ref[:, :n], p, eta)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), ref)
    loss, alpha, top = position_loss(leaf * 1, p, objective_named(name, eta))
    assert torch.allclose(loss * (weights != 0), want * (weights != 0), atol=1e-5, rtol=1e-5)
    assert torch.allclose(alpha, want_alpha, atol=1e-6)
    assert torch.equal(top, leaf[:, :n].argmax(-1))
    (grad,) = torch.autograd.grad((loss * weights).sum(), leaf)
    assert torch.allclose(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert grad[:, n:].abs().sum() == 0 and grad[1, 3].abs().sum() == 0


@pytest.mark.parametrize("name", ["lk-alpha", "lk-lambda"])
def test_an_lk_loss_is_at_its_minimum_where_the_draft_is_the_target(name):
    """Cheap (~0.01 s): at q = p the loss is 0 (alpha = 1) and any step away from p raises it
    (alpha has a kink there, its maximum: the gradient is a subgradient, not 0)."""
    torch.manual_seed(1)
    p = torch.randn(1, 6, 9).softmax(-1)
    logits = p.log()
    loss, alpha, _ = position_loss(logits.clone(), p, objective_named(name))
    assert torch.allclose(alpha, torch.ones_like(alpha), atol=1e-6)
    assert loss.abs().max() < 1e-5
    for _ in range(5):
        moved = logits + 0.3 * torch.randn_like(logits)
        assert (position_loss(moved, p, objective_named(name))[0] > 1e-4).all()


def fit_shared_draft(name: str, p: torch.Tensor, steps: int = 1500) -> float:
    """One q for every context (a draft that cannot tell them apart), fitted by Adam under the
    objective -> the mean acceptance probability sum min(p, q) it reaches."""
    theta = torch.zeros(p.shape[-1], requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.05)
    objective = objective_named(name)
    for _ in range(steps):
        loss, _, _ = position_loss(theta.expand(1, *p.shape).contiguous(), p[None], objective)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    return float(torch.minimum(p, theta.detach().softmax(-1)).sum(-1).mean())


def test_lk_reaches_a_higher_acceptance_than_kl_with_a_draft_too_small_for_the_target():
    """~1 s: three contexts the draft cannot tell apart. KL's optimum is their mean
    distribution (mean acceptance 0.556 here); both LK losses give up the first context's rare
    token to match the other two's common one (0.611), which is what speculative sampling
    accepts."""
    p = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.0, 0.8, 0.2, 0.0], [0.0, 0.8, 0.0, 0.2]])
    kl = fit_shared_draft("kl", p)
    assert kl == pytest.approx(5 / 9, abs=1e-3)  # q = the mean of the three rows
    for name in ("lk-alpha", "lk-lambda"):
        assert fit_shared_draft(name, p) > kl + 0.04, name


def test_an_unknown_loss_is_one_line_naming_the_known_ones():
    """Cheap (~0.01 s)."""
    with pytest.raises(Eagle3Error, match="'tv' is not one of"):
        objective_named("tv")
    assert objective_named("lk-lambda", 1.5).eta == 1.5
