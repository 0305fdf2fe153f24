"""datagen.audit: scoring, the flag rule, the CLI, and the proving test on the embedded target.

The proving test generates responses on the embedded 4-bit SmolLM2 with three "providers":
A = the target itself, B = the same weights re-quantised coarsely (symmetric round-to-nearest,
3 bits per group of 32), C = a different model (the target without 3 of its 30 layers).
The audit must flag B and C and not A. Responses are sampled at T=1 (the harder case: greedy
data separates more), 12 prompts x <= 48 tokens, i.e. ~500-570 scored tokens per provider. In a
48-prompt sweep of the same setup (40 random subsets per size), A vs B or A vs C alone was
flagged correctly from 2 records (~95 tokens) per provider, and A, B, C together from 6 records
(~280 tokens) per provider on; 8+ records per provider (MIN_RECORDS) keep A-vs-A false flags
at 0-3%.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from datagen import audit
from datagen.audit import RecordScore, compare_providers
from datagen.online_audit import OnlineAudit

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning Python.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write the opening of a short story about a lighthouse.",
    "List the planets of the solar system.",
    "How do I make a cup of tea?",
    "What are the benefits of regular exercise?",
    "Translate 'good morning' into Spanish and French.",
]
NEW_TOKENS = 48


# -- the flag rule on synthetic scores (no model) ------------------------------------------------
def fake_scores(provider: str, nll_per_token: float, n: int = 20, tokens: int = 50, spread=0.1):
    """n records whose per-token NLL is nll_per_token +- spread (deterministic; exact mean for
    even n)."""
    out = []
    for i in range(n):
        wobble = spread * (-1) ** i * ((i // 2) % 3 + 1) / 3  # zero mean over pairs
        out.append(
            RecordScore(
                f"{provider}{i}",
                "d",
                provider,
                tokens,
                (nll_per_token + wobble) * tokens,
                tokens // 2,
                0,
            )
        )
    return out


def test_one_bad_provider_among_good_ones_is_flagged():
    scores = fake_scores("a", 1.0) + fake_scores("b", 1.01) + fake_scores("c", 1.5)
    table = compare_providers(scores)
    assert set(table.flagged) == {"c"}
    c = next(p for p in table.providers if p.provider == "c")
    assert c.ref_nll == pytest.approx(1.005, abs=1e-3)
    assert "nats/token" in c.flag


def test_two_bad_providers_do_not_make_the_good_one_the_outlier():
    # Against the pooled B+C, A is the one that "differs" most in absolute terms (it is lower);
    # the rule removes the worst-fitting provider first, then compares what is left.
    scores = fake_scores("A", 1.0) + fake_scores("B", 1.4) + fake_scores("C", 2.5)
    assert set(compare_providers(scores).flagged) == {"B", "C"}


def test_close_providers_and_small_groups_are_not_flagged():
    scores = fake_scores("a", 1.0) + fake_scores("b", 1.03)  # below the 0.05 threshold
    scores += fake_scores("tiny", 3.0, n=3)  # fewer than MIN_RECORDS: reported, not compared
    table = compare_providers(scores)
    assert table.flagged == {}
    tiny = next(p for p in table.providers if p.provider == "tiny")
    assert tiny.records == 3 and tiny.ref_nll is None


def test_overlapping_intervals_are_not_flagged():
    # 0.2 nats apart but so noisy (few records, wide spread) that the intervals overlap.
    scores = fake_scores("a", 1.0, n=10, spread=1.0) + fake_scores("b", 1.2, n=10, spread=1.0)
    assert compare_providers(scores).flagged == {}


def test_a_provider_off_in_one_dataset_is_flagged_there():
    def in_dataset(scores, name):
        return [replace(s, dataset=name, id=f"{name}-{s.id}") for s in scores]

    scores = in_dataset(fake_scores("a", 1.0) + fake_scores("b", 1.0), "chat")
    scores += in_dataset(fake_scores("a", 1.0) + fake_scores("b", 1.15, n=8, spread=0.0), "code")
    tables = audit.audit_tables(scores)
    assert [t.dataset for t in tables] == ["all", "chat", "code"]
    assert tables[0].flagged == {}  # diluted below the threshold over all datasets
    flags = audit.flagged(tables)
    assert list(flags) == ["b"] and flags["b"].startswith("code: mean NLL 1.150")
    text = audit.format_tables(tables, target="t")
    assert "dataset: code" in text and "flagged b: code:" in text


def test_bootstrap_interval_is_deterministic_and_covers_the_mean():
    scores = fake_scores("a", 1.0, spread=0.3)
    lo, hi = audit.nll_interval(scores)
    assert (lo, hi) == audit.nll_interval(scores)
    assert lo < audit.mean_nll(scores) < hi


# -- token scoring against a plain forward pass (tiny random Llama, no tokenizer) ---------------
def test_score_tokens_matches_a_plain_forward(tiny_llama_target):
    torch.manual_seed(0)
    seqs = []
    for length in (9, 14, 5):
        ids = torch.randint(1, 256, (length,)).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        seqs.append((ids, mask))
    got = audit.score_tokens(tiny_llama_target, seqs, batch_tokens=20)  # forces several batches
    for (ids, mask), (tokens, nll, hits, out) in zip(seqs, got):
        with torch.no_grad():
            logits = tiny_llama_target.model(torch.tensor([ids])).logits[0].float()
        logp = logits.log_softmax(-1)
        pos = [t for t in range(1, len(ids)) if mask[t]]
        want_nll = -sum(logp[t - 1, ids[t]].item() for t in pos)
        want_hits = sum(int(logits[t - 1].argmax()) == ids[t] for t in pos)
        want_out = 0
        for t in pos:
            probs = logp[t - 1].exp()
            sorted_probs, order = probs.sort(descending=True)
            rank = (order == ids[t]).nonzero().item()
            want_out += int(sorted_probs[:rank].sum() >= audit.TOP_P)
        assert tokens == len(pos)
        assert nll == pytest.approx(want_nll, rel=1e-4)
        assert hits == want_hits and out == want_out


# -- CLI input errors: one line, exit 2 -----------------------------------------------------------
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert audit.main(["--target", "smollm2-135m-q4", "--data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err

    (tmp_path / "empty").mkdir()
    assert audit.main(["--target", "x", "--data", str(tmp_path / "empty")]) == 2
    assert "no records" in capsys.readouterr().err

    assert audit.main(["--target", "x", "--data", str(tmp_path), "--top-p", "2"]) == 2
    assert "--top-p" in capsys.readouterr().err


# -- the proving test on the embedded 4-bit target ------------------------------------------------
def requantize(model, bits: int, group: int = 32):
    """A copy with every linear weight (not embeddings) re-quantised: symmetric round-to-nearest,
    `bits` bits per group of `group` consecutive weights."""
    out = copy.deepcopy(model)
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                g = p.reshape(-1, group)
                scale = g.abs().amax(1, keepdim=True).clamp(min=1e-8) / qmax
                p.copy_((torch.round(g / scale).clamp(-qmax - 1, qmax) * scale).reshape(p.shape))
    return out


def drop_layers(model, keep: list[int]):
    """A copy that runs only decoder layers `keep` (a different, smaller model)."""
    out = copy.deepcopy(model)
    out.model.layers = torch.nn.ModuleList(out.model.layers[i] for i in keep)
    for j, layer in enumerate(out.model.layers):
        layer.self_attn.layer_idx = j  # KV-cache slots follow the new order
    out.config.num_hidden_layers = len(keep)
    return out


def generate_records(model, tokenizer, provider: str, *, seed: int) -> list[dict]:
    """12 prompts x 48 new tokens, sampled at T=1, as eagle3.data.records records."""
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=eot,
            eos_token_id=eot,
        )
    records = []
    for i, prompt in enumerate(PROMPTS):
        gen = out[i, enc["input_ids"].shape[1] :].tolist()
        stopped = eot in gen
        if stopped:
            gen = gen[: gen.index(eot)]
        records.append(
            {
                "id": f"p{i}",
                "dataset": "smoke",
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": tokenizer.decode(gen), "reasoning": ""},
                ],
                "model": "smollm2",
                "provider": provider,
                "finish_reason": "stop" if stopped else "length",
                "usage": {},
            }
        )
    return records


@pytest.fixture(scope="module")
def provider_records(smollm2_target):
    model, tok = smollm2_target.model, smollm2_target.tokenizer
    keep = [i for i in range(30) if i not in (10, 15, 20)]  # 27 of 30 layers
    return {
        "A": generate_records(model, tok, "A", seed=1),
        "B": generate_records(requantize(model, bits=3), tok, "B", seed=2),
        "C": generate_records(drop_layers(model, keep), tok, "C", seed=3),
    }


@pytest.mark.slow
def test_audit_flags_requantized_and_different_models(provider_records, tmp_path, capsys):
    """The audit CLI on real generations of the embedded 4-bit SmolLM2 (A: the target, B:
    re-quantised to 3 bits, C: 3 of its 30 layers dropped) flags B and C and not A, exit 1 under
    --fail-on-flag: the only check of the CLI's flag rule on real generations rather than synthetic
    scores. Costs ~33 s of fixture setup (the module's provider_records: 12 sampled answers from
    each of the 3 models, shared with the online audit test) + ~9 s (its call; measured on 2 xdist
    workers)."""
    from eagle3.data.records import ResultStore

    with ResultStore(tmp_path / "out") as store:
        for records in provider_records.values():
            for r in records:
                store.append("smoke", {**r, "id": f"{r['provider']}-{r['id']}"})
    report = tmp_path / "audit.json"
    code = audit.main(
        [
            "--target",
            "smollm2-135m-q4",
            "--data",
            str(tmp_path / "out"),
            "--json",
            str(report),
            "--fail-on-flag",
        ]
    )
    printed = capsys.readouterr().out
    print(printed)  # the table, for -s
    assert code == 1
    result = json.loads(report.read_text())
    assert set(result["flagged"]) == {"B", "C"}
    rows = {p["provider"]: p for p in result["tables"][0]["providers"]}
    assert rows["A"]["flag"] is None
    assert rows["A"]["nll"] < rows["B"]["nll"] and rows["A"]["nll"] < rows["C"]["nll"]
    assert all(p["records"] == len(PROMPTS) for p in rows.values())
    assert "flagged B" in printed and "flagged C" in printed and "flagged A" not in printed


@pytest.mark.slow
def test_online_audit_excludes_flagged_providers(smollm2_target, provider_records, tmp_path):
    """OnlineAudit, as training runs it, on the same real records arriving interleaved: the check
    falls due at the 36th record, excludes B and C with their nats/token reasons, logs the check,
    and no longer samples an excluded provider. Costs ~11 s (its call: scoring 36 records on the
    target; measured on 2 xdist workers), after the module's provider_records (~33 s, built once for
    both tests)."""
    online = OnlineAudit(
        smollm2_target, every=36, per_check=12, min_records=8, log_path=tmp_path / "audit.jsonl"
    )
    due = []
    for i in range(len(PROMPTS)):  # arrivals interleaved across providers
        for name in ("A", "B", "C"):
            due.append(online.add(provider_records[name][i]))
    assert due[-1] and not any(due[:-1])
    new = online.check()
    assert set(new) == {"B", "C"} and set(online.excluded) == {"B", "C"}
    assert all("nats/token" in reason for reason in new.values())
    line = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[0])
    assert line["excluded"].keys() == {"B", "C"} and line["scored"] == 36
    assert not online.add(provider_records["B"][0])  # excluded providers are not sampled again
