"""``--plan`` against the fake OpenRouter: the provider table and the budget projection checked
by hand (datagen.openrouter.plan), and prompt caching in the plan and then in the ledger."""

from __future__ import annotations

import json
import re

import pytest


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_plan_prints_table_and_hand_computed_projection(tmp_path, fake, h, cli, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY")  # --plan needs no key
    server = fake()
    cfg = h.write_config(tmp_path / "c.yaml", tokens_per_dataset=10_000)
    with open(tmp_path / "plan.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"id": f"p{i}", "prompt": "x" * 392}) + "\n")  # 98 + 8 = 106 tok
    args = [
        "--config",
        cfg,
        "--prompts",
        tmp_path / "plan.jsonl",
        "--out",
        tmp_path / "out",
        "--base-url",
        server.server.url,
        "--plan",
    ]
    code, stdout, stderr = cli("--budget", 100, *args)
    assert code == 0, stderr
    assert server.stats.chat == 0  # no chat request, nothing spent
    lines = stdout.splitlines()
    row = {
        line.split()[1]: line
        for line in lines
        if line.split()[:1]
        and line.split()[1:2]
        and line.split()[1] in ("chutes", "fireworks", "baseten", "deepinfra")
    }
    assert "INCLUDED" in row["chutes"] and "0.450" in row["chutes"] and "2.200" in row["chutes"]
    assert "excluded: in ignore list; nvfp4 is below native int4" in row["fireworks"]
    assert "down (status -5)" in row["baseten"]
    assert "unknown quantization taken as native int4" in row["deepinfra"]
    assert "note: DeepInfra, Together, Novita, Venice report no quantization" in stdout
    # hand computation: 10 prompts x 106 input tokens; 2000 output tokens each expected; the
    # token budget 10,000 wants 5 prompts; $ per prompt at the cheapest (Chutes 0.45/2.20):
    per_prompt = 106 * 0.45e-6 + 2000 * 2.20e-6
    assert f"the datasets want 0.01M output tokens (${5 * per_prompt:.2f}" in stdout
    in_per_out = 106 * 5 / 10_000
    cheap = 100 / (2.20e-6 + in_per_out * 0.45e-6) / 1e6  # 44.97M
    dear = 100 / (3.00e-6 + in_per_out * 0.60e-6) / 1e6  # 32.98M
    assert f"$100.00 buys {cheap:.1f}M output tokens" in stdout and f"{dear:.1f}M" in stdout
    (plan_row,) = [line for line in lines if line.strip().startswith("plan ")]
    cells = plan_row.split()
    #        name  prompts in   out    budget  wanted   $      buys    prompts  %       worst
    assert cells == [
        "plan",
        "10",
        "106",
        "2000",
        "10,000",
        "10,000",
        "0.02",
        "10,000",
        "5",
        "100.0%",
        "10,000",
    ]

    code, stdout, _ = cli("--budget", 0.01, *args)  # budget buys 0.01 / 0.0222385 of it
    f = 0.01 / (5 * per_prompt)
    (plan_row,) = [line for line in stdout.splitlines() if line.strip().startswith("plan ")]
    cells = plan_row.split()
    assert cells[7] == f"{10_000 * f:,.0f}" == "4,497"
    assert cells[8] == f"{5 * f:,.0f}" == "2"
    assert cells[9] == f"{100 * f:.1f}%"
    f_dear = 0.01 / (5 * (106 * 0.6e-6 + 2000 * 3.0e-6))
    assert cells[10] == f"{10_000 * f_dear:,.0f}"


def test_prompt_caching_in_the_plan_and_the_ledger(tmp_path, fake, cli, h):
    server = fake(latency=0.1)
    cfg = h.write_config(tmp_path / "c.yaml", concurrency=2)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(10):
            turns = [
                {"from": "human", "value": "a" * 400},  # 100 + 8 = 108 tokens
                {"from": "gpt", "value": "(source answer)"},
                {"from": "human", "value": "b" * 200 + f"{i:04d}"},  # 51 + 8 = 59 tokens
            ]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    args = h.argv(100, cfg, tmp_path / "chat.jsonl", tmp_path / "out", server)
    code, stdout, stderr = cli(*args, "--plan")
    assert code == 0, stderr
    # hand computation, 2000 output tokens per answer (expected_output_tokens): turn 1 sends
    # 108, turn 2 108 + (2000 + 8) + 59 = 2175; its prefix 108 + 2008 = 2116 is cacheable.
    # Chutes (cheapest allowed, $0.45/M in, $2.20/M out) reads cache at $0.225/M.
    inp, cached, out = 108 + 2175, 2116, 4000
    plain = inp * 0.45e-6 + out * 2.20e-6
    with_cache = plain - cached * (0.45e-6 - 0.225e-6)
    assert (
        f"that prefix at Chutes's $0.225/M cached input): the datasets want ${10 * plain:.2f} "
        f"without caching, ${10 * with_cache:.2f} with "
        f"({100 * (with_cache - plain) / plain:+.1f}%)" in stdout
    )
    assert (
        f"caching chat: {cached} of {inp} input tok/prompt cacheable (93%); wanted "
        f"${10 * plain:.4f} without caching, ${10 * with_cache:.4f} with" in stdout
    )
    code, stdout, _ = cli(*args[:1], 0.044, *args[2:], "--plan")  # buys 4.48 vs 4.71 prompts
    assert f"buys {0.044 / plain:,.0f} prompts without, {0.044 / with_cache:,.0f} with" in stdout
    assert f"{0.044 / plain:,.0f}" == "4" and f"{0.044 / with_cache:,.0f}" == "5"

    code, stdout, stderr = cli(*args)
    assert code == 0, stderr
    charges = [e for e in h.read_jsonl(tmp_path / "out" / "ledger.jsonl") if e["t"] == "charge"]
    assert sum(e["cached_tokens"] for e in charges) == server.stats.cached_tokens > 0
    discount = sum(e["cache_discount"] or 0 for e in charges)
    assert discount == pytest.approx(server.stats.cache_discount_usd) and discount > 0
    assert sum(e["usd"] for e in charges) == pytest.approx(server.stats.charged_usd)
    assert f"{server.stats.cached_tokens:,} cached prompt tokens saved ${discount:.4f}" in (
        last_line(stdout)
    )
    # the progress line: $/M output tokens paid this run (all cost / output tokens) next to the
    # plan's blended figure at the cheapest allowed endpoint: plain / 4000 output tokens
    paid = re.findall(r"\$([0-9.]+)/M out paid \(plan \$([0-9.]+)/M\)", stderr)
    assert paid and paid[-1][1] == f"{plain / out * 1e6:.2f}" == "2.46"
    assert float(paid[-1][0]) > 0


# -- --weight-by: the mix tilted toward low held-out tau ---------------------------------------
def test_tilted_budgets_is_pure_keeps_the_total_and_favours_low_tau():
    """~0 s. The rule of datagen.openrouter.plan.tilted_budgets by hand: base x (tau_max - tau
    + floor), the measured total kept, unmeasured kept, equal taus change nothing, the input
    is not touched."""
    from datagen.openrouter.plan import TILT_FLOOR, tilted_budgets

    base = {"a": 1000, "b": 1000, "c": 2000, "d": 500}
    tau = {"a": 3.0, "b": 2.5, "c": 3.0}
    new = tilted_budgets(base, tau)
    assert base == {"a": 1000, "b": 1000, "c": 2000, "d": 500}  # pure
    scores = {"a": 1000 * TILT_FLOOR, "b": 1000 * (0.5 + TILT_FLOOR), "c": 2000 * TILT_FLOOR}
    norm = sum(scores.values())
    assert new == {**{k: round(4000 * s / norm) for k, s in scores.items()}, "d": 500}
    assert new["b"] > new["c"] > new["a"] and abs(sum(new.values()) - 4500) <= 2
    assert tilted_budgets(base, {"a": 2.0, "b": 2.0}) == base
    assert tilted_budgets(base, {}) == base and tilted_budgets(base, tau) == new


def eval_json(path, rows: list[tuple[str, str, float]]) -> str:
    """An eagle3.evaluate --json file holding (drafter, dataset, tau) rows."""
    results = [
        {"drafter": d, "bench": f"held_out/{s}", "dataset": s, "tau": t,
         "tau_ci95": [t - 0.1, t + 0.1] if isinstance(t, float) else None, "prompts": 20}
        for d, s, t in rows
    ]  # fmt: skip
    results.append({"drafter": "exp/final", "bench": "mt_bench", "tau": 2.0, "prompts": 80})
    path.write_text(json.dumps({"results": results}))
    return str(path)


def mix_config(tmp_path, h) -> str:
    cfg = h.write_config(tmp_path / "c.yaml", tokens_per_dataset=10_000)
    for name in ("alpha", "beta", "gamma"):
        h.write_prompts(tmp_path / f"{name}.jsonl", 4, prefix=name)
    with open(cfg, "a") as f:
        f.write("datasets:\n")
        for name in ("alpha", "beta", "gamma"):
            tokens = "    tokens: 20000\n" if name == "gamma" else ""
            f.write(f"  - name: {name}\n    source: {tmp_path / f'{name}.jsonl'}\n{tokens}")
    return str(cfg)


def test_plan_weight_by_prints_old_and_new_weights_and_plans_the_new(
    tmp_path, fake, h, cli, monkeypatch
):
    """~0.5 s. --plan --weight-by EVAL.json: the tilt table (tau, old and new budgets) and the
    projection's token budget column carry the tilted budgets; an unmeasured dataset keeps its
    own; --weight-drafter picks one of several drafters."""
    from datagen.openrouter.plan import tilted_budgets

    monkeypatch.delenv("OPENROUTER_API_KEY")
    server = fake()
    cfg = mix_config(tmp_path, h)
    rows = [
        ("exp/final", "alpha", 2.2),
        ("exp/final", "beta", 3.0),
        ("prompt-lookup", "alpha", 1.5),
    ]
    evaluation = eval_json(tmp_path / "eval.json", rows)
    base = ["--budget", 10, "--config", cfg, "--out", tmp_path / "out", "--base-url",
            server.server.url, "--plan"]  # fmt: skip
    code, stdout, stderr = cli(*base, "--weight-by", evaluation)
    assert code == 0, stderr
    assert server.stats.chat == 0
    new = tilted_budgets(
        {"alpha": 10_000, "beta": 10_000, "gamma": 20_000}, {"alpha": 2.2, "beta": 3.0}
    )
    assert new["alpha"] + new["beta"] == 20_000 and new["alpha"] > new["beta"]
    assert f"weights by held-out tau of exp/final ({evaluation})" in stdout
    rest = stdout.partition("weights by held-out tau")[2]
    tilt_table = rest.split("providers of")[0].splitlines()[2:]  # after its line and header
    tilt = {line.split()[0]: line.split() for line in tilt_table}
    assert tilt["alpha"][1:7] == ["2.20", "[2.10,", "2.30]", "10,000", "25.0%", f"{new['alpha']:,}"]
    assert tilt["gamma"][1:3] == ["-", "-"] and tilt["gamma"][5] == "20,000"
    plan_rows = {c[0]: c for c in (line.split() for line in stdout.splitlines()) if len(c) == 11}
    assert (
        plan_rows["alpha"][4] == f"{new['alpha']:,}" and plan_rows["beta"][4] == f"{new['beta']:,}"
    )

    two = eval_json(tmp_path / "two.json", [*rows, ("exp2/final", "alpha", 2.9)])
    code, stdout, stderr = cli(*base, "--weight-by", two, "--weight-drafter", "exp2/final")
    assert code == 0, stderr
    assert "weights by held-out tau of exp2/final" in stdout


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "not JSON"),
        (None, "No such file"),
        ([("prompt-lookup", "alpha", 1.5)], "no tau per dataset in it"),
        (
            [("exp/final", "alpha", 2.0), ("exp/final", "delta", 2.5)],
            "datasets the mix lacks: delta",
        ),
        ([("exp/final", "alpha", 2.0), ("exp2/final", "alpha", 2.5)], "--weight-drafter NAME"),
        ([("exp/final", "alpha", "high")], "not a number >= 1"),
    ],
)
def test_weight_by_refuses_a_file_without_usable_tau_in_one_line(
    content, why, tmp_path, h, cli, monkeypatch
):
    """~0.1 s each. Exit 2 and one `error: --weight-by ...` line, before any request."""
    monkeypatch.delenv("OPENROUTER_API_KEY")
    cfg = mix_config(tmp_path, h)
    path = tmp_path / "eval.json"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        eval_json(path, content)
    code, _, stderr = cli("--budget", 1, "--config", cfg, "--plan", "--weight-by", path,
                          "--base-url", "http://127.0.0.1:9")  # fmt: skip
    assert code == 2 and "Traceback" not in stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(("error: --weight-by", "error: --weight-drafter")) and why in line
