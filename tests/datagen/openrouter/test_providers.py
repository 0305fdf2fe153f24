"""Provider choice (quantization vs native, status, ignore), the request rule, projections."""

import copy

import pytest

from datagen.openrouter import providers
from datagen.openrouter.fake_endpoints import KIMI_ENDPOINTS, endpoint
from datagen.openrouter.providers import DatasetDemand, Prices


@pytest.fixture
def endpoints():
    payload = {"data": {"endpoints": copy.deepcopy(KIMI_ENDPOINTS)}}
    return providers.parse_endpoints(payload)


def by_tag(eps):
    return {e.tag: e for e in eps}


def test_parse_prices_are_per_token(endpoints):
    chutes = by_tag(endpoints)["chutes"]
    assert chutes.prompt_price == pytest.approx(0.45e-6)
    assert chutes.completion_price == pytest.approx(2.20e-6)
    assert chutes.cache_read_price == pytest.approx(0.225e-6)
    assert by_tag(endpoints)["together"].quantization == "unknown"  # null -> unknown


def test_select_kimi(endpoints):
    allowed = providers.select(endpoints, "int4", ["fireworks", "baseten"], 16384)
    tags = {e.tag for e in allowed}
    assert tags == {
        "chutes",
        "deepinfra",
        "siliconflow",
        "atlas-cloud",
        "together",
        "novita",
        "parasail",
        "moonshotai",
        "venice",
    }
    eps = by_tag(endpoints)
    assert eps["fireworks"].excluded == ["in ignore list", "nvfp4 is below native int4"]
    assert eps["baseten"].excluded == [
        "in ignore list",
        "fp4 is below native int4",
        "down (status -5)",
    ]
    assert eps["deepinfra"].assumed_native and eps["together"].assumed_native
    assert not eps["chutes"].assumed_native


@pytest.mark.parametrize(
    "quant,status,max_out,included,reason",
    [
        ("int4", 0, None, True, None),
        ("int8", 0, None, True, None),
        ("fp8", 0, None, True, None),
        ("bf16", 0, None, True, None),
        ("unknown", 0, None, True, None),
        ("fp4", 0, None, False, "fp4 is below native int4"),
        ("mxfp4", 0, None, False, "mxfp4 is below native int4"),
        ("fp6", 0, None, False, "fp6 is below native int4"),
        ("int3", 0, None, False, "int3 is below native int4"),
        ("q4_k_m", 0, None, False, "unrecognised quantization q4_k_m"),
        ("int4", -1, None, False, "down (status -1)"),
        ("int4", 0, 8192, False, "max output 8192 < max_tokens 16384"),
    ],
)
def test_select_rules(quant, status, max_out, included, reason):
    e = endpoint("P", "p", quant, 0.5, 2.5, status=status)
    e["max_completion_tokens"] = max_out
    (ep,) = providers.parse_endpoints({"data": {"endpoints": [e]}})
    providers.select([ep], "int4", [], 16384)
    assert ep.included == included
    if reason:
        assert ep.excluded == [reason]


def test_ignore_matches_endpoint_suffix():
    e = endpoint("DeepInfra", "deepinfra/turbo", "int4", 0.5, 2.5)
    (ep,) = providers.parse_endpoints({"data": {"endpoints": [e]}})
    assert providers.select([ep], "int4", ["deepinfra"], 100) == []


def test_provider_block(endpoints, h):
    providers.select(endpoints, "int4", ["fireworks", "baseten"], 16384)
    block = providers.provider_block(endpoints, "int4", ["fireworks", "baseten"])
    assert block == {
        "ignore": ["baseten", "fireworks"],
        "quantizations": ["int4", "int8", "fp8", "mxfp8", "fp16", "bf16", "fp32", "unknown"],
        "max_price": {"prompt": 0.6, "completion": 3.0},  # the dearest allowed, per million
        "sort": "price",
        "require_parameters": True,
        "allow_fallbacks": True,
    }
    # the fake router, given this rule, can reach no forbidden endpoint and every allowed one
    server = h.fake_module.FakeOpenRouter()
    reach = {e["tag"] for e in server.reachable(block, 16384)}
    assert reach.isdisjoint({"fireworks", "baseten"})
    assert {e.tag for e in endpoints if e.included} <= reach


def test_block_without_ignore_still_excludes_below_native(endpoints, h):
    providers.select(endpoints, "int4", [], 16384)
    block = providers.provider_block(endpoints, "int4", [])
    assert block["ignore"] == ["baseten", "fireworks"]  # below native: ignored by slug too
    assert {"fp4", "nvfp4", "mxfp4", "fp6"}.isdisjoint(block["quantizations"])
    # max_price only covers allowed endpoints (BaseTen is down, so it is excluded from prices)
    assert block["max_price"] == {"prompt": 0.6, "completion": 3.0}


def test_prices(endpoints):
    allowed = providers.select(endpoints, "int4", ["fireworks", "baseten"], 16384)
    assert providers.cheapest(allowed) == Prices(0.45e-6, 2.20e-6, 0.0)
    assert providers.dearest(allowed) == Prices(0.60e-6, 3.00e-6, 0.0)


def test_tokens_for_budget_reproduces_the_story():
    # $100 at $0.45/M in, $2.20/M out, 200-token prompts per 2000-token answer: ~44.5M, not 60M
    got = providers.tokens_for_budget(100.0, 200 / 2000, Prices(0.45e-6, 2.20e-6))
    assert got == pytest.approx(100.0 / (2.20e-6 + 0.1 * 0.45e-6))
    assert 44.0e6 < got < 45.0e6


def test_conversation_tokens_multi_turn():
    msgs = [
        {"role": "system", "content": "s" * 40},  # 10 + 8
        {"role": "user", "content": "u" * 80},  # 20 + 8
        {"role": "user", "content": "v" * 4},  # 1 + 8
    ]
    inp, out = providers.conversation_tokens(msgs, 100)
    # turn 1 input: 18 + 28 = 46; then + answer 100 + 8; turn 2 input: 46 + 108 + 9 = 163
    assert inp == pytest.approx(46 + 163)
    assert out == 200


def test_project_hand_computed():
    prices = Prices(0.5e-6, 2.0e-6)
    demands = [
        # wants min(100, 10_000 // 500 = 20) = 20 prompts, 10,000 tokens
        DatasetDemand("a", 100, 200.0, 500.0, 10_000),
        # wants all 10 prompts (token budget not binding): 5,000 tokens
        DatasetDemand("b", 10, 100.0, 500.0, 1_000_000),
    ]
    rows = providers.project(demands, 1.0, prices)
    a, b = rows
    assert (a.wanted_prompts, a.wanted_tokens) == (20, 10_000)
    assert (b.wanted_prompts, b.wanted_tokens) == (10, 5_000)
    cost_a = 20 * (200 * 0.5e-6 + 500 * 2.0e-6)  # 0.022
    cost_b = 10 * (100 * 0.5e-6 + 500 * 2.0e-6)  # 0.0105
    assert a.wanted_usd == pytest.approx(cost_a) and b.wanted_usd == pytest.approx(cost_b)
    assert a.bought_tokens == 10_000 and b.bought_prompts == 10  # $1 covers everything
    # a budget of $0.01 buys the same fraction of each
    rows = providers.project(demands, 0.01, prices)
    f = 0.01 / (cost_a + cost_b)
    assert rows[0].bought_tokens == pytest.approx(10_000 * f)
    assert rows[1].bought_prompts == pytest.approx(10 * f)


def test_cacheable_tokens_and_cached_projection():
    msgs = [
        {"role": "system", "content": "s" * 40},  # 10 + 8
        {"role": "user", "content": "u" * 80},  # 20 + 8
        {"role": "user", "content": "v" * 4},  # 1 + 8
    ]
    # turn 2 resends system, user 1 and the answer: 18 + 28 + 108 = 154; turn 1 nothing
    assert providers.cacheable_tokens(msgs, 100) == pytest.approx(154)
    assert providers.cacheable_tokens(msgs[:2], 100) == 0
    d = DatasetDemand("a", 10, 209.0, 200.0, 1_000_000, cached_per_prompt=154.0)
    plain = Prices(0.5e-6, 2.0e-6)
    cached = Prices(0.5e-6, 2.0e-6, cache_read=0.1e-6)
    (p,) = providers.project([d], 1.0, plain)
    (c,) = providers.project([d], 1.0, cached)
    assert p.wanted_usd == pytest.approx(10 * (209 * 0.5e-6 + 200 * 2.0e-6))
    assert c.wanted_usd == pytest.approx(p.wanted_usd - 10 * 154 * 0.4e-6)


def test_with_cache_takes_the_cheapest_allowed_that_lists_one(endpoints):
    allowed = providers.select(endpoints, "int4", ["fireworks", "baseten"], 16384)
    prices, source = providers.with_cache(providers.cheapest(allowed), allowed)
    assert source.tag == "chutes" and prices.cache_read == pytest.approx(0.225e-6)
    none = [copy.copy(e) for e in allowed]
    for e in none:
        e.cache_read_price = None
    assert providers.with_cache(providers.cheapest(none), none)[1] is None
    assert providers.cache_savings(allowed)["chutes"] == pytest.approx(0.225e-6)
