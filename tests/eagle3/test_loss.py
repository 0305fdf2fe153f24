import pytest
import torch
import torch.nn.functional as F

from eagle3.loss import simulated_acceptance, soft_cross_entropy, ttt_loss, valid_counts
from eagle3.losses import chunks


def one_hot_probs(labels, vocab):
    return F.one_hot(labels, vocab).float()


def test_alignment_step_k_predicts_token_k_plus_2():
    """A draft that outputs exactly row t+k+1 of the labels at step k is perfect."""
    torch.manual_seed(0)
    T, V = 8, 6
    labels = torch.randint(0, V, (1, T))
    probs = one_hot_probs(labels, V)
    in_vocab = torch.ones(1, T, dtype=torch.bool)
    mask = torch.ones(1, T, dtype=torch.long)
    steps = []
    for k in range(3):
        shifted = torch.roll(labels, -(k + 1), dims=1)  # position t -> label row t+k+1
        steps.append(F.one_hot(shifted, V).float() * 50)
    loss, m = ttt_loss(steps, probs, in_vocab, mask)
    assert loss.item() < 1e-6
    assert [m[f"acc_{k}"] for k in range(3)] == [1.0, 1.0, 1.0]
    assert [m[f"count_{k}"] for k in range(3)] == [T - 2, T - 3, T - 4]
    # Off by one position: the draft is wrong everywhere the labels differ.
    wrong = [F.one_hot(labels, V).float() * 50]
    _, m = ttt_loss(wrong, probs, in_vocab, mask)
    assert m["acc_0"] < 1.0


def test_masks_drop_prompt_tokens_and_out_of_vocab_targets():
    T, V = 6, 4
    probs = torch.full((1, T, V), 1 / V)
    logits = [torch.zeros(1, T, V)]
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]])
    in_vocab = torch.tensor([[1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    _, m = ttt_loss(logits, probs, in_vocab, mask)
    # t in 0..3: needs mask[t+2] and in_vocab[t+1] -> t=1 (mask3,iv2), t=2 (mask4,iv3); t=3 iv4 off
    assert m["count_0"] == 2


def test_valid_counts_match_the_loss_counts_including_too_short_steps():
    torch.manual_seed(0)
    T, V, K = 6, 4, 6  # steps 4 and 5 have no position left
    probs = torch.full((2, T, V), 1 / V)
    mask = torch.randint(0, 2, (2, T))
    in_vocab = torch.rand(2, T) > 0.3
    _, m = ttt_loss([torch.zeros(2, T, V)] * K, probs, in_vocab, mask)
    assert valid_counts(in_vocab, mask, K).tolist() == [m[f"count_{k}"] for k in range(K)]


def test_step_weights_and_denominators():
    T, V = 5, 3
    probs = torch.full((1, T, V), 1 / V)
    logits = [torch.randn(1, T, V), torch.randn(1, T, V)]
    ones = torch.ones(1, T, dtype=torch.long)
    iv = torch.ones(1, T, dtype=torch.bool)
    loss, m = ttt_loss(logits, probs, iv, ones, step_weight=0.5)
    assert loss.item() == pytest.approx(m["loss_0"] + 0.5 * m["loss_1"], rel=1e-5)
    half, _ = ttt_loss(
        logits, probs, iv, ones, step_weight=0.5, denominators=[2 * m["count_0"], 2 * m["count_1"]]
    )
    assert half.item() == pytest.approx(loss.item() / 2, rel=1e-5)


def test_rollout_weight_weighs_the_pairs_a_rollouts_verification_judged():
    """A root x_{t+1} marked 1 + d (datagen.rollout) adds rollout_weight to entry t's steps
    k < d, nothing else: the plain loss where no root is marked or the weight is 0, and the
    reference sum per (entry, step) otherwise; metrics and counts are the plain ones."""
    torch.manual_seed(0)
    B, T, V, K = 2, 10, 5, 3
    probs = torch.softmax(torch.randn(B, T, V), -1)
    logits = [torch.randn(B, T, V, requires_grad=True) for _ in range(K)]
    iv = torch.rand(B, T) > 0.1
    plain = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    marked = plain.clone()
    marked[0, 2], marked[0, 5], marked[1, 4] = 1 + 2, 1 + 3, 1 + 1  # entries 1, 4 and 3
    base, m0 = ttt_loss(logits, probs, iv, plain, step_weight=0.8)
    unweighted, m1 = ttt_loss(logits, probs, iv, marked, step_weight=0.8)
    assert unweighted.item() == pytest.approx(base.item(), rel=1e-6) and m0 == m1
    weighted, m2 = ttt_loss(logits, probs, iv, marked, step_weight=0.8, rollout_weight=2.0)
    assert m2 == m0
    judged = {(0, 1): 2, (0, 4): 3, (1, 3): 1}  # (row, entry) -> depths judged
    want = 0.0
    for k, lg in enumerate(logits):
        n = T - k - 2
        valid = plain[:, k + 2 : k + 2 + n].bool() & iv[:, k + 1 : k + 1 + n]
        ce = -(probs[:, k + 1 : k + 1 + n] * torch.log_softmax(lg[:, :n].float(), -1)).sum(-1)
        w = torch.ones(B, n)
        for (b, t), d in judged.items():
            if t < n and k < d:
                w[b, t] += 2.0
        want = want + 0.8**k * (ce * w * valid).sum() / valid.sum()
    assert weighted.item() == pytest.approx(want.item(), rel=1e-5)
    weighted.backward()
    grads = [lg.grad.clone() for lg in logits]
    for lg in logits:
        lg.grad = None
    want.backward()  # the reference's autograd: the same gradients
    for got, lg in zip(grads, logits, strict=True):
        torch.testing.assert_close(got, lg.grad, rtol=1e-4, atol=1e-7)


def test_simulated_acceptance():
    assert simulated_acceptance([1.0, 1.0]) == 3.0
    assert simulated_acceptance([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_elements", [4 * 11, 2**21], ids=["4-row-chunks", "one-chunk"])
def test_soft_cross_entropy_is_the_fused_cross_entropy_in_chunks(
    dtype, chunk_elements, monkeypatch
):
    """Values, argmax and the logits' gradient equal F.cross_entropy over logits[:, :n] (soft
    labels, one row of them all zero as unlabelled rows are), in chunks that do not divide n;
    backward leaves the gradient in the logits' own memory."""
    monkeypatch.setitem(chunks.CE_CHUNK_ELEMENTS, "cpu", chunk_elements)
    torch.manual_seed(0)
    B, T, n, V = 2, 13, 10, 11
    leaf = (torch.randn(B, T, V) * 4).to(dtype).requires_grad_()
    probs = torch.randn(B, n, V).softmax(-1)
    probs[1, 3] = 0
    dce = torch.randn(B, n)
    ref = leaf.detach().float().clone().requires_grad_()
    want = F.cross_entropy(ref[:, :n].reshape(B * n, V), probs.reshape(B * n, V), reduction="none")
    (want_grad,) = torch.autograd.grad((want.view(B, n) * dce).sum(), ref)
    logits = leaf * 1  # a model's logits: an intermediate, not a leaf
    ce, top = soft_cross_entropy(logits, probs)
    assert ce.dtype == torch.float32
    assert torch.allclose(ce, want.view(B, n), atol=1e-5, rtol=1e-5)
    assert torch.equal(top, leaf[:, :n].argmax(-1))
    (grad,) = torch.autograd.grad((ce * dce).sum(), leaf)
    assert grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is stored in bf16
    assert torch.allclose(grad.float(), want_grad, atol=tol, rtol=tol)
    assert grad[:, n:].abs().sum() == 0 and grad[1, 3].abs().sum() == 0
    assert torch.equal(logits.detach(), grad)  # written over the dead logits, no new (T, V)


def test_soft_cross_entropy_refuses_what_its_overwritten_logits_would_break():
    """Its backward reuses the logits' memory: a second backward, or a second loss over the
    same logits, is an error, never a gradient from overwritten values."""
    probs = torch.randn(1, 4, 7).softmax(-1)
    logits = torch.randn(1, 5, 7, requires_grad=True) * 1
    ce, _ = soft_cross_entropy(logits, probs)
    ce.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        ce.sum().backward()
    logits = torch.randn(1, 5, 7, requires_grad=True) * 1
    (a, _), (b, _) = soft_cross_entropy(logits, probs), soft_cross_entropy(logits, probs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (a.sum() + b.sum()).backward()
