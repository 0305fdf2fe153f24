"""P-EAGLE (eagle3/methods/p_eagle/draft.py): the training pass computes what decoding computes.

Tiny random drafts in float32; the whole file runs in ~3 s on one core.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.checkpoint import load_draft, save_draft
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import SpeculativeDecoder, plain_generate
from eagle3.errors import Eagle3Error
from eagle3.methods import from_target_config, make_draft_config
from eagle3.methods.p_eagle.decoding import ParallelDrafter
from eagle3.methods.p_eagle.draft import PEagleDraft
from tests.eagle3.test_checkpoint import make_draft
from tests.eagle3.test_speculative import tiny_target

V, H, HT = 40, 32, 24


pytestmark = pytest.mark.usefixtures("one_thread")


def make_peagle(num_layers: int = 3, depth: int = 4, seed: int = 0, **kw) -> PEagleDraft:
    cfg = make_draft_config(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=V,
        target_hidden_size=HT,
        aux_layer_ids=[0, 1, 2],
        method="p-eagle",
        num_layers=num_layers,
        parallel_depth=depth,
        mask_token_id=V - 1,
        **kw,
    )
    torch.manual_seed(seed)
    draft = PEagleDraft(cfg).eval()
    with torch.no_grad():
        for p in draft.parameters():  # norms start at ones: perturb so every weight matters
            p.add_(0.05 * torch.randn_like(p))
    return draft


def nested_anchors(T: int, depth: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out, pool = [], torch.arange(T)
    for _ in range(1, depth):
        pool = pool[torch.randperm(pool.numel(), generator=g)[: max(1, pool.numel() * 2 // 3)]]
        pool = pool.sort().values
        out.append(pool)
    return out


def decode_logits(draft: PEagleDraft, ids, aux, t: int, d: int, start: int = 0) -> torch.Tensor:
    """Incremental decoding, vLLM's layout: the context pairs (x_{s+1}, fc(aux_s)) for s =
    start..t at positions 0..t-start, then d mask slots -> the depth-d logits at anchor t."""
    n = t - start + 1
    ctx_ids = ids[start + 1 : t + 2]
    if ctx_ids.numel() < n:  # the last position's token is past the end (padding, as training)
        ctx_ids = torch.cat([ctx_ids, torch.zeros(1, dtype=ids.dtype)])
    h = draft.project(aux[start : t + 1])[None]
    _, logits, cache = draft(ctx_ids[None], h, torch.arange(n)[None])
    if d == 0:
        return logits[0, -1]
    mask_ids = torch.full((1, d), draft.config.options.mask_token_id)
    hidden = draft.mask_state().expand(1, d, -1)
    _, logits, _ = draft(mask_ids, hidden, torch.arange(n, n + d)[None], cache)
    return logits[0, -1]


@torch.no_grad()
def test_peagle_training_pass_equals_incremental_decoding():
    """Each depth's logits from the one-pass training unroll equal those of decoding (the
    context in the cache, then d mask slots) at every sampled anchor, 3 layers, fp32."""
    draft = make_peagle()
    B, T, K = 2, 10, 4
    ids = torch.randint(0, V - 1, (B, T))
    aux = torch.randn(B, T, 3 * HT)
    anchors = nested_anchors(T, K, seed=1)
    out = draft.parallel_forward(ids, aux, anchors)
    assert [o.shape[1] for o in out] == [T] + [a.numel() for a in anchors]
    for b in range(B):
        for t in range(T):
            ref = decode_logits(draft, ids[b], aux[b], t, 0)
            torch.testing.assert_close(out[0][b, t], ref, atol=1e-5, rtol=1e-5)
        for d, at in enumerate(anchors, start=1):
            for j, t in enumerate(at.tolist()):
                ref = decode_logits(draft, ids[b], aux[b], t, d)
                torch.testing.assert_close(out[d][b, j], ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_peagle_training_pass_keeps_packed_records_apart():
    """Packed rows: a depth-d slot sees only its own record's context, at record positions."""
    draft = make_peagle(num_layers=2, depth=3)
    T = 12
    ids = torch.randint(0, V - 1, (1, T))
    aux = torch.randn(1, T, 3 * HT)
    segments = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    anchors = [torch.tensor([1, 3, 6, 9, 10]), torch.tensor([3, 6, 10])]
    out = draft.parallel_forward(ids, aux, anchors, segments, positions)
    for d, at in enumerate(anchors, start=1):
        for j, t in enumerate(at.tolist()):
            start = 0 if t < 5 else 5
            ref = decode_logits(draft, ids[0], aux[0], t, d, start=start)
            torch.testing.assert_close(out[d][0, j], ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_peagle_drafter_proposes_the_parallel_argmax_and_keeps_greedy_output():
    """In-house decoding with the ParallelDrafter: each round's K drafts are the argmax of the
    one-pass logits at the current anchor, and T=0 output equals plain greedy decoding."""
    target = tiny_target(vocab=16, layers=4)
    hf = target.model.config
    cfg = from_target_config(
        hf, 16, target.aux_layer_ids, method="p-eagle", num_layers=2, parallel_depth=4,
        mask_token_id=15,
    )  # fmt: skip
    torch.manual_seed(3)
    draft = PEagleDraft(cfg).eval()
    with torch.no_grad():
        draft.lm_head.weight.mul_(20)
    draft.set_embeddings(target.embed_weight)
    decode = DecodeConfig(mode="chain", steps=4, max_new_tokens=24)
    drafter = ParallelDrafter(draft, decode)
    prompt = [1, 5, 7, 2, 9]
    dec = SpeculativeDecoder(target, drafter, decode, eos_ids=set())
    dec.start(prompt)
    checked = 0
    while not dec.done:
        tree = drafter.propose(dec.tokens)
        # the same drafts from the training pass over the tokens so far, anchored at the last
        # cached position L-1 (its pair is the root x_L; position L's aux is never attended)
        seq = torch.tensor([dec.tokens])
        L = seq.shape[1] - 1
        aux = target_aux(target, seq)
        anchors = [torch.tensor([L - 1])] * 3
        out = draft.parallel_forward(seq, aux, anchors)
        want = [int(out[0][0, L - 1].argmax())] + [int(o[0, 0].argmax()) for o in out[1:]]
        assert tree.tokens == want
        checked += 1
        dec.step()
    assert checked > 2
    assert dec.tokens[len(prompt) :] == plain_generate(target, prompt, 24, eos_ids=set()).tokens


def target_aux(target, ids: torch.Tensor) -> torch.Tensor:
    """The aux states (1, T, 3H) of the target over ids, no cache."""
    from eagle3.targets import capture_outputs, decoder_of

    layers = decoder_of(target.model).layers
    with capture_outputs({i: layers[i] for i in target.aux_layer_ids}) as captured:
        target.model(input_ids=ids)
    return torch.cat([captured[i] for i in target.aux_layer_ids], dim=-1)


def test_peagle_config_refuses_what_vllm_would_not_serve():
    with pytest.raises(Eagle3Error, match="mask_token_id"):
        make_draft_config(
            hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=V, draft_vocab_size=V, target_hidden_size=HT,
            aux_layer_ids=[0, 1, 2], method="p-eagle", num_layers=2, parallel_depth=4,
        )  # fmt: skip
    with pytest.raises(Eagle3Error, match="num_layers 3: a setting of method p-eagle"):
        make_draft_config(
            hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=V, draft_vocab_size=V, target_hidden_size=HT,
            aux_layer_ids=[0, 1, 2], num_layers=3,
        )  # fmt: skip
    with pytest.raises(Eagle3Error, match="--mode chain"):
        ParallelDrafter(make_peagle(), DecodeConfig(mode="tree"))


# -- export: what vLLM's parallel drafting reads, and our loader's refusals -------------------------
@pytest.fixture
def peagle_ckpt(tmp_path):
    draft = make_peagle()
    return draft, save_draft(draft, tmp_path / "ckpt", dtype=None)


def test_peagle_export_round_trips_with_what_vllm_reads(peagle_ckpt):
    draft, out = peagle_ckpt
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (cfg["num_hidden_layers"], cfg["method"], cfg["mask_token_id"]) == (3, "p-eagle", V - 1)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("mask_hidden").shape == (1, 3 * HT)  # vLLM: [1, fc_input_size]
        assert f.get_tensor("layers.2.self_attn.q_proj.weight").shape == (4 * 8, H)  # H, not 2H
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"1", "2"}
    loaded = load_draft(out, embed_weight=draft.embed_tokens.weight)
    assert isinstance(loaded, PEagleDraft) and loaded.config == draft.config
    ids, aux = torch.randint(0, V - 1, (1, 7)), torch.randn(1, 7, 3 * HT)
    anchors = nested_anchors(7, 4, seed=2)
    with torch.no_grad():
        for a, b in zip(draft.parallel_forward(ids, aux, anchors), loaded.parallel_forward(ids, aux, anchors)):  # fmt: skip
            assert torch.equal(a, b)


def _edit_config(out, **changes):
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_peagle_loader_refuses_a_config_read_as_plain_eagle3(peagle_ckpt):
    """The field's trap: P-EAGLE flags lost from config.json would serve other maths."""
    _, out = peagle_ckpt
    _edit_config(out, method=None, num_layers=None, parallel_depth=None, mask_token_id=None)
    # our own record of the method (eagle_config.method) still says p-eagle
    with pytest.raises(Eagle3Error, match="method None but eagle_config.method 'p-eagle'"):
        load_draft(out)
    raw = json.loads((out / "config.json").read_text())
    del raw["eagle_config"]["method"]  # a peer's config: nothing says p-eagle any more
    _edit_config(out, eagle_config=raw["eagle_config"])
    with pytest.raises(Eagle3Error, match="num_hidden_layers 3 but a eagle3 draft of 1"):
        load_draft(out)
    _edit_config(out, num_hidden_layers=1)
    with pytest.raises(Eagle3Error, match="method 'eagle3' but the weights carry 'mask_hidden'"):
        load_draft(out)


def test_peagle_loader_refuses_weights_without_mask_hidden_or_with_other_layers(peagle_ckpt):
    draft, out = peagle_ckpt
    state = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    save_file(
        {k: v for k, v in state.items() if k != "mask_hidden"}, str(out / "model.safetensors")
    )
    with pytest.raises(Eagle3Error, match="weights lack 'mask_hidden'"):
        load_draft(out)
    save_file(state, str(out / "model.safetensors"))
    _edit_config(out, num_hidden_layers=2, num_layers=2)
    with pytest.raises(Eagle3Error, match=r"num_hidden_layers 2 but the weights hold decoder layers \[0, 1, 2\]"):  # fmt: skip
        load_draft(out)


def test_peagle_is_served_with_parallel_drafting(peagle_ckpt, tmp_path):
    """The server's speculative config turns parallel drafting on for a P-EAGLE drafter only."""
    from eagle3.engine.server import VLLMServer

    _, out = peagle_ckpt
    spec = VLLMServer(tmp_path, drafter=out, num_speculative_tokens=4).speculative_config
    assert spec["parallel_drafting"] is True and spec["method"] == "eagle3"
    plain = save_draft(make_draft(), tmp_path / "plain", dtype=None)
    assert "parallel_drafting" not in VLLMServer(tmp_path, drafter=plain).speculative_config
