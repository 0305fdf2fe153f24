"""Speculative decoding: T=0 equals greedy, T=1 keeps the target distribution, caches roll back."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from eagle3.decoding.acceptance import AcceptanceStats
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import SpeculativeDecoder, plain_generate
from eagle3.decoding.eagle import EagleDrafter
from eagle3.decoding.prompt_lookup import PromptLookupDrafter
from eagle3.decoding.tree import DraftTree, accept_greedy, accept_sampling
from eagle3.errors import Eagle3Error
from eagle3.methods import from_target_config
from eagle3.model import Eagle3Draft
from eagle3.targets import Target

CHAIN = dict(mode="chain", steps=4)
TREE = dict(mode="tree", topk=3, total_tokens=12, depth=4)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(vocab: int = 16, layers: int = 4, sharpness: float = 10.0, seed: int = 0) -> Target:
    """A random Llama with a tiny vocab; lm_head scaled so the next token is fairly certain."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpness)
    return Target(model, None, aux_layer_ids=[0, 1, layers - 1])


def random_draft(target: Target, draft_vocab: int | None = None, seed: int = 1) -> Eagle3Draft:
    vd = draft_vocab or target.vocab_size
    cfg = from_target_config(target.model.config, vd, target.aux_layer_ids)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg).eval()
        with torch.no_grad():
            draft.lm_head.weight.mul_(50)  # confident drafts: q far from uniform
    if vd < target.vocab_size:  # a draft vocab of every other target id: exercises d2t
        ids = torch.arange(0, 2 * vd, 2)
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        draft.set_vocab(ids - torch.arange(vd), t2d)
    draft.set_embeddings(target.embed_weight)
    return draft


class OracleDrafter(EagleDrafter):
    """The real draft (its cache is under test), with the target's greedy continuation planted
    on a random path of random length: acceptances are partial and often not the first branch."""

    def __init__(self, draft, cfg, reference: list[int], seed: int = 0):
        super().__init__(draft, cfg)
        self.reference, self.rng = reference, random.Random(seed)

    def propose(self, tokens, generator=None):
        tree = super().propose(tokens, generator)
        children, node = tree.children(), -1
        for j in range(self.rng.randint(0, max(tree.depths(), default=0))):
            kids = children.get(node)
            if not kids or len(tokens) + j >= len(self.reference):
                break
            node = self.rng.choice(kids)
            tree.tokens[node] = self.reference[len(tokens) + j]
        return tree


# -- pure verification ----------------------------------------------------------------------------
def test_accept_greedy_follows_target_argmax_through_the_tree():
    #           root -> a(5) -> c(7)
    #                -> b(6) -> d(8) -> e(9)
    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 1, 3])
    # rows: root, a, b, c, d, e
    assert accept_greedy(tree, [6, 0, 8, 0, 9, 4]) == ([1, 3, 4], 4)
    assert accept_greedy(tree, [6, 0, 8, 0, 3, 4]) == ([1, 3], 3)
    assert accept_greedy(tree, [2, 0, 0, 0, 0, 0]) == ([], 2)


def test_ancestor_mask_and_depths():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 1, 2])
    assert tree.depths() == [1, 1, 2, 3]
    anc = tree.ancestor_mask().int().tolist()
    assert anc == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 0, 1, 1, 1],
    ]
    assert DraftTree(tokens=[1, 2], parents=[-1, 0]).is_chain() and not tree.is_chain()


@pytest.mark.parametrize("deterministic", [False, True])
def test_recursive_rejection_sampling_is_exact(deterministic):
    """Three children drawn without replacement from q (or fixed tokens): output ~ p."""
    V, n, g = 6, 6000, torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.05, 0.2], dtype=torch.float64)
    q = torch.tensor([0.5, 0.05, 0.2, 0.05, 0.15, 0.05])
    counts = torch.zeros(V)
    for _ in range(n):
        if deterministic:
            tree = DraftTree(tokens=[0, 2, 4], parents=[-1, -1, -1])
        else:
            kids = torch.multinomial(q, 3, replacement=False, generator=g).tolist()
            tree = DraftTree(
                tokens=kids, parents=[-1] * 3, probs={-1: q}, vocab_ids=torch.arange(V)
            )
        path, bonus = accept_sampling(tree, lambda row: p, g)
        counts[tree.tokens[path[0]] if path else bonus] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    # the test has power: the draft distribution itself is rejected
    assert chisquare(counts.numpy(), (q.double() * n).numpy()).pvalue < 1e-9


def test_acceptance_stats_tau_and_alpha():
    s = AcceptanceStats()
    s.record(accepted=2, offered=3)  # accepted depths 1-2, rejected at 3
    s.record(accepted=0, offered=1)
    s.record(accepted=3, offered=3)  # chain exhausted: depth 4 never offered
    assert s.tau == pytest.approx((5 + 3) / 3)
    assert s.alpha() == [pytest.approx(2 / 3), 1.0, 0.5]
    other = AcceptanceStats()
    other.record(1, 2)
    s.merge(other)
    assert s.steps == 4 and s.alpha(4) == [0.75, pytest.approx(2 / 3), 0.5, None]


def test_decode_config_errors_are_one_line():
    with pytest.raises(Eagle3Error, match="mode 'beam'"):
        DecodeConfig(mode="beam")
    with pytest.raises(Eagle3Error, match="total_tokens"):
        DecodeConfig(total_tokens=1)


# -- T=0: identical to greedy decoding ------------------------------------------------------------
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculative_equals_plain_decoding(shape):
    target = tiny_target()
    prompt = torch.randint(0, 16, (12,)).tolist()
    plain = plain_generate(target, prompt, 40, eos_ids=set()).tokens
    hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    assert plain == hf[0, 12:].tolist()
    cfg = DecodeConfig(max_new_tokens=40, **shape)
    for drafter in (
        EagleDrafter(random_draft(target), cfg),
        EagleDrafter(random_draft(target, draft_vocab=8), cfg),
        OracleDrafter(random_draft(target), cfg, prompt + plain),
        PromptLookupDrafter(4),
        None,
    ):
        out = SpeculativeDecoder(target, drafter, cfg, eos_ids=set()).generate(prompt)
        assert out.tokens == plain, getattr(drafter, "name", "none")
    assert out.stats.tau == 1.0  # no drafter


def test_decoding_logs_no_cache_deprecation(transformers_warnings):
    target = tiny_target()
    prompt = torch.randint(0, 16, (8,)).tolist()
    plain = plain_generate(target, prompt, 8, eos_ids=set()).tokens
    cfg = DecodeConfig(max_new_tokens=8, **TREE)
    drafter = EagleDrafter(random_draft(target), cfg)
    assert SpeculativeDecoder(target, drafter, cfg, eos_ids=set()).generate(prompt).tokens == plain
    assert not [m for m in transformers_warnings if "deprecated" in m]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_equals_plain_on_tiny_deepseek_v3(shape, tiny_deepseek_target):
    """Kimi-K2.5's architecture (MLA, MoE) takes the tree mask and cache gather too."""
    target = tiny_deepseek_target
    with torch.no_grad():
        target.model.lm_head.weight.mul_(10)
    prompt = torch.randint(0, target.vocab_size, (12,)).tolist()
    plain = plain_generate(target, prompt, 24, eos_ids=set()).tokens
    cfg = DecodeConfig(max_new_tokens=24, **shape)
    drafter = OracleDrafter(random_draft(target), cfg, prompt + plain)
    out = SpeculativeDecoder(target, drafter, cfg, eos_ids=set()).generate(prompt)
    assert out.tokens == plain and out.stats.tau > 1


def test_generation_stops_at_eos_and_max_new_tokens():
    target = tiny_target()
    prompt = torch.randint(0, 16, (12,)).tolist()
    plain = plain_generate(target, prompt, 30, eos_ids=set()).tokens
    eos = plain[9]
    cfg = DecodeConfig(max_new_tokens=30, **CHAIN)
    oracle = OracleDrafter(random_draft(target), cfg, prompt + plain)
    out = SpeculativeDecoder(target, oracle, cfg, eos_ids={eos}).generate(prompt)
    assert out.tokens == plain[: plain.index(eos) + 1]
    assert plain_generate(target, prompt, 30, eos_ids={eos}).tokens == out.tokens
    cfg = DecodeConfig(max_new_tokens=7, **CHAIN)
    out = SpeculativeDecoder(target, PromptLookupDrafter(4), cfg, eos_ids=set()).generate(prompt)
    assert out.tokens == plain[:7]


# -- caches ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_rejected_tokens_never_stay_in_either_cache(shape):
    """After every step both caches equal a fresh prefill of exactly the accepted tokens."""
    target = tiny_target()
    prompt = torch.randint(0, 16, (10,)).tolist()
    plain = plain_generate(target, prompt, 40, eos_ids=set()).tokens
    cfg = DecodeConfig(max_new_tokens=40, **shape)
    drafter = OracleDrafter(random_draft(target, draft_vocab=8), cfg, prompt + plain, seed=3)
    dec = SpeculativeDecoder(target, drafter, cfg, eos_ids=set())
    dec.start(prompt)
    partial = gathered = 0
    with torch.no_grad():
        while not dec.done:
            dec.step()
            path = dec.last_path
            partial += 0 < len(path) < cfg.max_depth
            gathered += path != list(range(len(path)))  # not a prefix of the node list
            committed = dec.tokens[:-1]  # the root (last token) is not in the target cache yet
            if dec.done:  # output cut at max_new_tokens; the caches are not used again
                break
            fresh = target.model(torch.tensor([committed]), use_cache=True)
            fresh_cache = fresh.cache if hasattr(fresh, "cache") else fresh.past_key_values
            assert dec.cache.get_seq_length() == len(committed)
            for mine, ref in zip(dec.cache.layers, fresh_cache.layers):
                assert torch.allclose(mine.keys, ref.keys, atol=1e-5)
                assert torch.allclose(mine.values, ref.values, atol=1e-5)
            aux, _ = target.capture(torch.tensor([committed]))
            n = len(committed)
            _, _, (k, v) = drafter.draft(
                torch.tensor([dec.tokens[1:]]),
                drafter.draft.project(aux),
                torch.arange(n)[None],
            )
            assert drafter.cache[0].shape[2] == n and drafter.length == n
            assert torch.allclose(drafter.cache[0], k, atol=1e-4)
            assert torch.allclose(drafter.cache[1], v, atol=1e-4)
    assert dec.tokens[len(prompt) :] == plain
    assert partial >= 3
    if shape["mode"] == "tree":
        assert gathered >= 3  # the tree path had to be gathered, not just cropped
    assert 1 < dec.stats.tau < cfg.max_depth + 1


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_chained_draft_steps_feed_target_ids_not_draft_vocab_ids(shape):
    """Drafted tokens are draft-vocab indices; the next draft step must embed their target
    ids (draft_to_target), exactly as TTT training does. Greedy reference chain by hand."""
    target = tiny_target()
    draft = random_draft(target, draft_vocab=8)  # draft id i = target id 2i
    drafter = EagleDrafter(draft, DecodeConfig(**shape))
    fed: list[list[int]] = []
    real = draft.forward

    def spy(input_ids, *args, **kwargs):
        fed.append(input_ids[0].tolist())
        return real(input_ids, *args, **kwargs)

    prompt = torch.randint(0, 16, (12,)).tolist()
    with torch.no_grad():
        out = target.model(torch.tensor([prompt]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1][0] for i in target.aux_layer_ids], dim=-1)
    drafter.update(prompt + [3], aux)  # aux h_s pairs with token x_{s+1}
    draft.forward = spy
    tree = drafter.propose(prompt + [3])
    draft.forward = real
    for ids in fed:  # every fed token is a drafted one: an even (in-vocab) target id
        assert all(i % 2 == 0 for i in ids), fed
    if shape is CHAIN:
        want, hidden, logits, cache = [], drafter.last_hidden, drafter.last_logits, drafter.cache
        with torch.no_grad():
            for i in range(CHAIN["steps"]):
                tok = draft.draft_to_target(logits.argmax(-1, keepdim=True))[None]  # (1, 1)
                want.append(int(tok))
                pos = torch.tensor([[drafter.length + i]])
                hidden, lg, cache = draft(tok, hidden, pos, cache)
                logits = lg[0, -1]
        assert tree.tokens == want


def test_draft_steps_never_rerun_the_prefix():
    target = tiny_target()
    prompt = torch.randint(0, 16, (30,)).tolist()
    for shape in (CHAIN, TREE):
        cfg = DecodeConfig(max_new_tokens=20, **shape)
        drafter = EagleDrafter(random_draft(target), cfg)
        calls: list[int] = []
        real = drafter.draft.forward

        def counting(input_ids, *args, _real=real, _calls=calls, **kwargs):
            _calls.append(input_ids.shape[1])
            return _real(input_ids, *args, **kwargs)

        drafter.draft.forward = counting
        SpeculativeDecoder(target, drafter, cfg, eos_ids=set()).generate(prompt)
        assert calls[0] == len(prompt)  # the one prefill
        assert max(calls[1:]) <= max(cfg.topk, cfg.max_depth + 1)


# -- T=1: the output distribution is the target's -------------------------------------------------
def _snapshot(dec: SpeculativeDecoder):
    d = dec.drafter
    layers = [(layer.keys, layer.values) for layer in dec.cache.layers]
    return layers, list(dec.tokens), (d.cache, d.length, d.last_hidden, d.last_logits)


def _restore(dec: SpeculativeDecoder, snap) -> None:
    layers, tokens, (cache, length, hidden, logits) = snap
    for layer, (k, v) in zip(dec.cache.layers, layers):
        layer.keys, layer.values = k, v  # every update builds new tensors: references suffice
    dec.tokens, dec.done = list(tokens), False
    d = dec.drafter
    d.cache, d.length, d.last_hidden, d.last_logits = cache, length, hidden, logits


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [dict(mode="chain", steps=3), dict(mode="tree", topk=3, total_tokens=8, depth=3)],
    ids=["chain", "tree"],
)
def test_speculative_sampling_keeps_the_target_distribution(shape):
    """Chi-square on the joint law of the next two tokens over many one-step samples. The whole
    decoder at T=1, its caches rolled back between steps, keeps the target's joint law
    (test_recursive_rejection_sampling_is_exact checks the accept step alone). Costs ~11 s a shape,
    ~22 s for both (its calls: 1,500 samples each; measured on 2 xdist workers)."""
    V, n = 6, 1500
    target = tiny_target(vocab=V, layers=2, sharpness=3.0, seed=4)
    cfg = DecodeConfig(temperature=1.0, max_new_tokens=50, **shape)
    draft = random_draft(target, seed=5)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.04)  # back to a moderate q: some accepts, some rejects
    dec = SpeculativeDecoder(target, EagleDrafter(draft, cfg), cfg, eos_ids=set())
    prompt = [1, 4, 2, 5, 3]
    g = torch.Generator().manual_seed(0)
    dec.start(prompt, g)
    snap = _snapshot(dec)
    counts = torch.zeros(V, V)
    accepted = 0
    for _ in range(n):
        _restore(dec, snap)
        dec.step(g)
        x1, x2 = dec.tokens[len(snap[1])], dec.tokens[len(snap[1]) + 1 : len(snap[1]) + 2]
        accepted += len(dec.tokens) - len(snap[1]) - 1
        if not x2:  # only the bonus was produced: draw x2 from the target's next step
            dec.step(g)
            x2 = [dec.tokens[len(snap[1]) + 1]]
        counts[x1, x2[0]] += 1
    with torch.no_grad():
        ctx = snap[1]
        p1 = torch.softmax(target.model(torch.tensor([ctx])).logits[0, -1].double(), -1)
        batch = torch.tensor([ctx + [x] for x in range(V)])
        p2 = torch.softmax(target.model(batch).logits[:, -1].double(), -1)
    expected = (p1[:, None] * p2 * n).flatten()
    observed = counts.flatten().double()
    small = expected < 5  # pool the rare cells so the chi-square approximation holds
    obs, exp = observed[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, observed[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    pvalue = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert pvalue > 1e-3, (pvalue, obs.tolist(), exp.tolist())
    assert 0.2 * n < accepted  # drafts were accepted often enough to matter


# -- the embedded 4-bit target ----------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_equals_plain_on_embedded_smollm2(smollm2_target):
    """The real 4-bit target: chain and tree, random drafts with the greedy continuation
    planted (partial acceptances, gathered tree paths) and prompt lookup. The only greedy check on a
    real model's logits and tokenizer (the others use tiny random targets). Costs ~27 s (its call;
    measured on 2 xdist workers) + 0.6 s of fixture setup (the session's SmolLM2 from its cache)."""
    from eagle3.data.chat import prompt_ids
    from eagle3.data.prompts import load_prompts

    target = smollm2_target
    draft = random_draft(target, draft_vocab=2048)
    for prompt in load_prompts("mt_bench", limit=1) + load_prompts("humaneval", limit=1):
        ids = prompt_ids(target.tokenizer, prompt.messages[:1])
        plain = plain_generate(target, ids, 20).tokens
        for shape in (CHAIN, dict(mode="tree", topk=4, total_tokens=16, depth=4)):
            cfg = DecodeConfig(max_new_tokens=20, **shape)
            oracle = OracleDrafter(draft, cfg, ids + plain)
            for drafter in (oracle, PromptLookupDrafter(5)):
                out = SpeculativeDecoder(target, drafter, cfg).generate(ids)
                assert out.tokens == plain, (prompt.id, shape["mode"], drafter.name)
                assert drafter is not oracle or out.stats.tau > 1  # acceptances happened


def test_last_feature_drafter_is_fed_the_final_hidden_state():
    """An EAGLE-2-style drafter (feature "last") gets the target's final post-norm state, the
    same tensor training reads from the shards; T=0 output stays plain greedy."""
    target = tiny_target()
    cfg = from_target_config(
        target.model.config, target.vocab_size, target.aux_layer_ids, feature="last"
    )
    draft = Eagle3Draft(cfg).eval()
    draft.set_embeddings(target.embed_weight)
    seen = []

    class Spy(EagleDrafter):
        def update(self, tokens, aux):
            seen.append(aux.clone())
            super().update(tokens, aux)

    prompt = torch.randint(0, 16, (10,)).tolist()
    plain = plain_generate(target, prompt, 20, eos_ids=set()).tokens
    dcfg = DecodeConfig(max_new_tokens=20, **CHAIN)
    out = SpeculativeDecoder(target, Spy(draft, dcfg), dcfg, eos_ids=set()).generate(prompt)
    assert out.tokens == plain
    ids = torch.tensor([prompt])
    _, last = target.capture(ids, torch.ones_like(ids))
    assert seen[0].shape == (10, cfg.target_hidden_size)
    torch.testing.assert_close(seen[0], last[0], rtol=1e-5, atol=1e-5)
