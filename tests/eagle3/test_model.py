import math

import pytest
import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error
from eagle3.loss import label_rows, target_probs, ttt_loss
from eagle3.methods import from_target_config
from eagle3.model import Eagle3Draft
from eagle3.rope import apply_rotary, rotary_cos_sin
from eagle3.vocab import build_draft_vocab, token_frequencies


def naive_ttt(model: Eagle3Draft, input_ids, aux, steps):
    """Reference unroll: every query's allowed keys listed explicitly, softmax by hand."""
    B, T = input_ids.shape
    attn = model.midlayer.self_attn
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    hidden = model.project(aux)
    keys, values, outs = [], [], []
    for k in range(steps):
        ids = torch.zeros_like(input_ids)
        for t in range(T):
            if t + k + 1 < T:
                ids[:, t] = input_ids[:, t + k + 1]
        x = model.midlayer.attn_input(model.embed_tokens(ids), hidden)
        q = attn.q_proj(x).view(B, T, nh, hd)
        key = attn.k_proj(x).view(B, T, nkv, hd)
        val = attn.v_proj(x).view(B, T, nkv, hd)
        pos = torch.arange(T)[None].expand(B, T) + k
        cos, sin = rotary_cos_sin(
            pos, hd, model.config.rope_theta, q.dtype, model.config.rope_scaling
        )
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # (B, T, 1, hd)
        q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
        keys.append(key)
        values.append(val)
        out = torch.zeros(B, T, nh, hd)
        for b in range(B):
            for t in range(T):
                for h in range(nh):
                    g = h // (nh // nkv)
                    allowed = [(0, s) for s in range(t + 1)] + [(j, t) for j in range(1, k + 1)]
                    scores = torch.stack(
                        [q[b, t, h] @ keys[j][b, s, g] / math.sqrt(hd) for j, s in allowed]
                    )
                    w = scores.softmax(0)
                    out[b, t, h] = sum(
                        w[i] * values[j][b, s, g] for i, (j, s) in enumerate(allowed)
                    )
        attn_out = attn.o_proj(out.reshape(B, T, nh * hd))
        hidden = model.midlayer.finish(hidden, attn_out)
        outs.append(model.compute_logits(hidden))
    return outs


# YaRN over a tiny original context, so that 9 positions already reach the scaled band
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
ROPES = [None, YARN, {"rope_type": "linear", "factor": 2.0}]


@pytest.mark.parametrize("rope", ROPES, ids=["plain", "yarn", "linear"])
@pytest.mark.parametrize("impl", ["chunked", "flash", "sdpa", "split"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_ttt_attention_matches_naive_reference(steps, impl, rope, tiny_config):
    model = Eagle3Draft(tiny_config(rope_scaling=rope)).eval()
    model.midlayer.self_attn.ttt_impl = impl
    input_ids = torch.randint(0, 50, (2, 7))
    aux = torch.randn(2, 7, 96)
    with torch.no_grad():
        got = model.ttt_forward(input_ids, aux, steps)
        want = naive_ttt(model, input_ids, aux, steps)
    assert len(got) == steps
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-5


def test_ttt_kernels_gradients_agree(tiny_config):
    torch.manual_seed(0)
    model = Eagle3Draft(tiny_config())
    input_ids, aux = torch.randint(0, 50, (2, 6)), torch.randn(2, 6, 96)
    grads = {}
    for impl in ("chunked", "flash", "sdpa", "split"):
        model.zero_grad()
        model.midlayer.self_attn.ttt_impl = impl
        sum(x.square().mean() for x in model.ttt_forward(input_ids, aux, 3)).backward()
        grads[impl] = model.midlayer.self_attn.k_proj.weight.grad.clone()
    for impl in ("chunked", "flash", "split"):
        assert torch.allclose(grads["sdpa"], grads[impl], atol=1e-5)


@pytest.mark.parametrize("rope", ROPES, ids=["plain", "yarn", "linear"])
@pytest.mark.parametrize("impl", ["chunked", "flash", "sdpa", "split"])
def test_ttt_step_equals_incremental_decoding_with_cache(impl, rope, tiny_config):
    """What TTT step k sees at position t is what the drafter sees after k chained steps."""
    model = Eagle3Draft(tiny_config(rope_scaling=rope)).eval()
    model.midlayer.self_attn.ttt_impl = impl
    check_ttt_equals_decoding(model)


def check_ttt_equals_decoding(model: Eagle3Draft) -> None:
    """TTT steps 0..2 at position t == prefill to t, then chained steps with the KV cache."""
    T, t = 9, 4
    input_ids = torch.randint(0, 50, (1, T))
    aux = torch.randn(1, T, 96)
    with torch.no_grad():
        ttt = model.ttt_forward(input_ids, aux, 3)
        # Inference: prefill pairs (x_{s+1}, h_s) for s <= t, then chain with own hidden.
        h = model.project(aux[:, : t + 1])
        out, logits, cache = model.forward(input_ids[:, 1 : t + 2], h, torch.arange(t + 1)[None])
        assert torch.allclose(logits[:, t], ttt[0][:, t], atol=1e-5)
        hidden = out[:, t : t + 1]
        for k in (1, 2):
            out, logits, cache = model.forward(
                input_ids[:, t + k + 1 : t + k + 2], hidden, torch.tensor([[t + k]]), cache
            )
            assert torch.allclose(logits[:, 0], ttt[k][:, t], atol=1e-5)
            hidden = out


def test_forward_explicit_mask_matches_default_causal(tiny_config):
    model = Eagle3Draft(tiny_config()).eval()
    ids, h = torch.randint(0, 50, (2, 5)), torch.randn(2, 5, 32)
    pos = torch.arange(5)[None].expand(2, 5)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None]
    with torch.no_grad():
        a = model.forward(ids, h, pos)[1]
        b = model.forward(ids, h, pos, attention_mask=mask)[1]
    assert torch.allclose(a, b, atol=1e-6)


def test_config_errors_are_one_line(tiny_config):
    with pytest.raises(Eagle3Error, match="larger than the target vocab"):
        tiny_config(draft_vocab_size=51)
    with pytest.raises(Eagle3Error, match="exactly 3 aux layers"):
        tiny_config(aux_layer_ids=[1, 2])


def test_wrong_embeddings_refused(tiny_config):
    model = Eagle3Draft(tiny_config())
    with pytest.raises(Eagle3Error, match="another target"):
        model.set_embeddings(torch.randn(49, 32))


def test_overfit_two_sequences_on_tiny_llama_target():
    """Train the drafter on a tiny random Llama target: step 0 right wherever the draft vocab
    can be, loss -90%."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tcfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=128,
    )
    target = LlamaForCausalLM(tcfg).eval()
    with torch.no_grad():  # a confident target, like a trained one: near one-hot labels
        target.lm_head.weight.mul_(60)
    input_ids = torch.randint(0, 96, (2, 16))
    loss_mask = torch.zeros(2, 16, dtype=torch.long)
    loss_mask[:, 4:] = 1
    aux_ids = [0, 1, 2]
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1] for i in aux_ids], dim=-1)
        last = out.hidden_states[-1]
    vocab = build_draft_vocab(token_frequencies(input_ids, loss_mask, 96), 64)
    draft = Eagle3Draft(from_target_config(tcfg, vocab.size, aux_ids))
    draft.set_embeddings(target.model.embed_tokens.weight)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    probs, in_vocab = target_probs(last, target.lm_head.weight, vocab.t2d, chunk_size=7)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(150):
        loss, metrics = ttt_loss(draft.ttt_forward(input_ids, aux, 3), probs, in_vocab, loss_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert metrics["count_0"] > 0
    # every position the draft vocab can match is matched; acc_0 counts the others as misses
    assert metrics["correct_0"] == metrics["count_0"]
    assert metrics["acc_0"] == metrics["correct_0"] / metrics["masked_0"] < 1.0
    assert losses[-1] < 0.1 * losses[0]


def test_target_probs_chunking_and_vocab_restriction():
    torch.manual_seed(0)
    h, w = torch.randn(2, 5, 8), torch.randn(20, 8)
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[[1, 3, 4, 10, 19]] = True
    probs, in_vocab = target_probs(h, w, t2d, chunk_size=3)
    logits = h @ w.T
    assert torch.allclose(probs, F.softmax(logits[..., t2d], -1), atol=1e-6)
    assert torch.equal(in_vocab, t2d[logits.argmax(-1)])


def test_target_probs_of_label_rows_only_are_the_same_bits_in_any_batch():
    torch.manual_seed(0)
    B, T, H, V = 3, 40, 64, 300
    h, w = torch.randn(B, T, H), torch.randn(V, H)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:120]] = True
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask[0, 10:], loss_mask[1, 30:35], loss_mask[2, 39] = 1, 1, 1
    rows = label_rows(loss_mask)
    assert rows.sum() == loss_mask[:, 1:].sum()  # row j is read iff x_{j+1} is generated
    assert rows[0, 9] and not rows[0, 8] and not rows[:, -1].any()

    full_p, full_v = target_probs(h, w, t2d, chunk_size=16)
    p, v = target_probs(h, w, t2d, chunk_size=16, rows=rows)
    assert torch.allclose(p[rows], full_p[rows], atol=1e-6) and torch.equal(v[rows], full_v[rows])
    assert not p[~rows].any() and not v[~rows].any()
    # the losses and every metric read only those rows
    logits = [torch.randn(B, T, 120) for _ in range(3)]
    (loss, m), (full_loss, full_m) = (
        ttt_loss(logits, *labels, loss_mask) for labels in ((p, v), (full_p, full_v))
    )
    assert torch.equal(loss, full_loss) and m == full_m
    # a sequence's labels are the same bits alone or in a batch (chunks have one shape)
    alone_p, alone_v = target_probs(h[1:2], w, t2d, chunk_size=16, rows=rows[1:2])
    assert torch.equal(alone_p[0], p[1]) and torch.equal(alone_v[0], v[1])
