"""In-process generation: continuous batching is exact, sampling follows the distribution."""

from __future__ import annotations

import pytest
import torch

from datagen import generate as G


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()


class Tok:
    """Just what Generator needs from a tokenizer (ids are decoded as their numbers)."""

    pad_token_id = 0
    eos_token_id = 1

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def convert_tokens_to_ids(self, token):
        return None


def generator(model, batch_size, stop_ids, max_new_tokens=12, **kw):
    gen = G.Generator(model, Tok(), max_new_tokens=max_new_tokens, batch_size=batch_size, **kw)
    # Stop on a few frequent ids of the random model, so rows finish at different steps.
    gen.eot = sorted(stop_ids)
    gen.config.eos_token_id = gen.eot
    return gen


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lengths]


def test_greedy_continuous_batching_equals_one_prompt_at_a_time(tiny_model):
    ps = prompts(9)
    probe = generator(tiny_model, 1, [1], max_new_tokens=12, temperature=0)
    probe.plain_cache = False  # model.generate, one prompt per batch: the reference
    first = probe.generate_ids(ps)
    # the most frequent generated ids become stop tokens: rows stop early, at different steps
    counts = torch.bincount(
        torch.tensor([int(t) for turn in first for t in turn.content.split()]), minlength=256
    )
    stop = counts.topk(3).indices.tolist()
    reference = generator(tiny_model, 1, stop, temperature=0)
    reference.plain_cache = False
    want = reference.generate_ids(ps)
    assert {t.finish_reason for t in want} == {"stop", "length"}
    assert len({t.completion_tokens for t in want}) > 2
    for batch_size in (1, 2, 4, 16):
        gen = generator(tiny_model, batch_size, stop, temperature=0)
        got = gen.generate_ids(ps)
        assert gen.plain_cache is True  # the continuous path really ran
        assert [
            (t.content, t.finish_reason, t.completion_tokens, t.prompt_tokens) for t in got
        ] == [(t.content, t.finish_reason, t.completion_tokens, t.prompt_tokens) for t in want], (
            f"batch {batch_size}"
        )


def test_sampled_generation_runs_and_respects_limits(tiny_model):
    ps = prompts(5, seed=1)
    gen = generator(tiny_model, 2, [1], max_new_tokens=7, temperature=1.0, top_p=0.9)
    torch.manual_seed(0)
    turns = gen.generate_ids(ps)
    assert [t.prompt_tokens for t in turns] == [len(p) for p in ps]
    assert all(1 <= t.completion_tokens <= 7 for t in turns)


def test_sample_matches_the_weights():
    torch.manual_seed(0)
    w = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 1.0, 0.0, 3.0]])
    n = 20000
    draws = torch.stack([G._sample(w) for _ in range(n)])  # (n, 2)
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=4).double() / n
        want = w[row].double() / w[row].sum()
        assert torch.all(freq[want == 0] == 0)
        assert torch.allclose(freq, want, atol=0.015)


def test_top_p_keeps_exactly_the_nucleus():
    gen = G.Generator.__new__(G.Generator)
    gen.config = type("C", (), {"do_sample": True, "temperature": 1.0, "top_p": 0.7})()
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    # 300 candidates beyond the top 256 would be cut by a top-k shortcut: a flat row too
    flat = torch.full((400,), 1 / 400)
    torch.manual_seed(0)
    n = 20000
    rows = torch.stack([probs.log(), torch.full((5,), 0.0)])
    draws = torch.stack([gen._next_tokens(rows) for _ in range(n)])
    freq = torch.bincount(draws[:, 0], minlength=5).double() / n
    # nucleus at 0.7: tokens whose preceding mass is < 0.7 -> {0.4, 0.25, 0.2}
    want = torch.tensor([0.4, 0.25, 0.2, 0.0, 0.0], dtype=torch.float64) / 0.85
    assert torch.allclose(freq, want, atol=0.015)
    flat_draws = torch.stack([gen._next_tokens(flat.log()[None]) for _ in range(4000)])
    kept = flat_draws.unique()
    assert kept.max() >= 256 and len(kept) <= 280  # 0.7 * 400 = 280 tokens in the nucleus


def test_buckets_bound_padding():
    lengths = [300, 290, 200, 120, 118, 117, 40, 10]
    parts = G._buckets(lengths, waste=0.1)
    assert sorted(j for p in parts for j in p) == list(range(len(lengths)))
    for part in parts:
        width = lengths[part[0]]
        assert width * len(part) <= 1.1 * sum(lengths[j] for j in part)


def test_packed_linear_computes_the_same_product(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    x = torch.randn(3, 5, 24)
    monkeypatch.setattr(G, "packing_wins", lambda linear, rows: True)
    with torch.no_grad():
        want = model(x)
        packed = G.pack_linear_weights(model, rows_hint=4)
        got = model(x)
    if packed == 0:
        pytest.skip("this torch build has no oneDNN linear")
    assert packed == 2 and isinstance(model[0], G.PackedLinear)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_only_where_it_wins(monkeypatch):
    """Each distinct shape is timed once (packing_wins) and packed only where that won; the
    real timing runs too (its answer is the CPU's, so only its type is checked)."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN linear")
    assert isinstance(G.packing_wins(torch.nn.Linear(24, 40), rows=4), bool)
    asked = []

    def wins(linear, rows):
        asked.append((linear.in_features, linear.out_features, rows))
        return linear.out_features == 40

    monkeypatch.setattr(G, "packing_wins", wins)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.Linear(40, 8), torch.nn.Linear(24, 40)
    )
    assert G.pack_linear_weights(model, rows_hint=4) == 2
    assert asked == [(24, 40, 4), (40, 8, 4)]  # the repeated shape is not timed again
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "PackedLinear"]


def test_decoding_logs_no_cache_deprecation(tiny_model, transformers_warnings):
    """The caches are read under transformers' current name (`cache`), not `past_key_values`."""
    gen = generator(tiny_model, 2, [1], max_new_tokens=4, temperature=0)
    gen.generate_ids(prompts(3))  # continuous batching
    assert gen.plain_cache is True
    gen.plain_cache = False
    gen.generate_ids(prompts(3))  # model.generate
    assert not [m for m in transformers_warnings if "deprecated" in m]
    out = tiny_model(input_ids=torch.tensor([[5]]), use_cache=True)
    if "cache" in out.__dataclass_fields__:  # transformers 5: the old name is what warns
        assert out.past_key_values is out.cache
        assert any("past_key_values" in m and "deprecated" in m for m in transformers_warnings)
