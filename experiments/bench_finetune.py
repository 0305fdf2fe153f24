"""Start from a "public" drafter and fine-tune it on a small targeted budget, or train from
scratch on that budget: which drafter is best in the targeted domain, and which forgets least?

    python experiments/bench_finetune.py --gsm8k PATH/gsm8k/test.jsonl [--work runs/bench-finetune]
        [--generic 1200] [--start-epochs 2] [--domain 300] [--epochs 4] [--anchor 1e-2]
        [--replay 0.25] [--prompts 20] [--held-out 20]
        [--arms start,replay,replay-lk,onpolicy,onpolicy-lk] [--lk lk-alpha] [--jobs 2]
        [--budget mixed --math PATH/gsm8k/train.jsonl] [--answer-tokens 192]
        [--max-new-tokens 64]

The Kimi situation in miniature, on the embedded target (configs/train/smollm2-q4-cpu.yaml
otherwise):

- **start**, the "public-like" drafter: trained on --generic off-policy ShareGPT conversations
  (datagen.offpolicy: their own answers, the target's soft labels; first 2 turns, first 512
  tokens), --start-epochs epochs, as the public Kimi drafters were trained on much generic
  data the user did not choose;
- **the targeted budget**: the target's own answers (datagen.local, in-process, T=0, at most
  --answer-tokens new tokens) to --domain code prompts: "write this function" for public
  standard-library functions, by name, signature and docstring (none shares a 13-word run with
  HumanEval: eagle3.data.decontaminate). The benchmark of the domain is HumanEval; MT-bench and
  GSM8K measure forgetting. With --budget mixed the same number of prompts is a third each of
  chat (first user turns of ShareGPT conversations the start never saw), code (the head of the
  same sample) and math (GSM8K's train questions), as the user's dataset mix spreads its budget;
  none shares a 13-word run with any benchmark.

Arms, every one --epochs epochs over the same targeted shards (the same target tokens):
**scratch** (the recipe from random weights, its own vocabulary); **finetune** (model.init_from
= start, its vocabulary kept, lr / --lr-ratio, warm-up 0); **anchor** (finetune +
train.anchor_l2 = --anchor); **replay** (anchor + data.replay_fraction = --replay of the
training tokens drawn from the generic shards); **replay-lk** (replay with train.loss = --lk, an
LK loss: lk-alpha, the better of the two from scratch at 13x the quickstart's data, or
lk-lambda); **onpolicy** (replay, its domain tokens the start's own round: the start drafter's
greedy decode of the domain prompts against the target, chains of 4, replayed from the domain's
capture by `datagen.rollout --from-shards`, so the tokens are the same and the shards add the
start's rejection log, which train.rollout_weight weighs); **onpolicy-lk** (both). An arm,
finished or not, is refused rather than reused when it trained with other settings (another
--lk, --anchor, ...). The start trains first, then the rest --jobs at a time (each on cores /
--jobs threads).
Then each is served by vLLM-CPU (`eagle3.evaluate --engine vllm --engine-only --engine-passes
batched`, vLLM's own per-request counts, 8 requests in flight), T=0, chains of 4 (the depth
trained), --prompts prompts a benchmark, 64 new tokens a turn (--max-new-tokens), and --held-out
general conversations: the generic ones every arm's training holds out (the start's validation
split, which replay's draw keeps too; the recipe's data.val_fraction and val_seed,
eagle3.evaluate's defaults), asked up to their last user turn, the row held_out/sharegpt (0:
none); τ with 95% intervals bootstrapped over the prompts (one context bucket), and each arm's
paired difference from the start and from replay over the same prompts (the 95% interval of the
per-prompt difference, eagle3.evaluation.statistics.paired_tau_difference). Every stage is
skipped when its output exists, so a killed run is rerun with the same command. Another budget
reuses the same start from its own work directory: link generic, shards-generic and start
there from the first one's (the arms name those by their real paths).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from train_arms import ENGINE_BATCH, REPO, markdown_table, train_arm

from eagle3.evaluation.report import engine_row_name
from eagle3.evaluation.statistics import paired_tau_difference

TARGET = "smollm2-135m-q4"
CONFIG = "configs/train/smollm2-q4-cpu.yaml"
BENCHES = ["humaneval", "mt_bench", "gsm8k"]
ARMS = ["start", "scratch", "finetune", "anchor", "replay", "replay-lk", "onpolicy", "onpolicy-lk"]
# --lk's choices: eagle3.losses' LK names, spelled out because importing it loads torch (~2 s a
# launch); tests/experiments/test_bench_finetune.py keeps them equal
LK_LOSSES = ("lk-alpha", "lk-lambda")
ROLLOUT_STEPS = 4  # the rollout's chain: the depth every arm trains and is measured at
CHAT_CHARS = 1500  # a chat prompt's first turn at most: ~400 tokens, the answer's 192 fit 1024
ASK = "Write the Python function `{name}({args})` of the standard library's `{module}` module.\n\n{doc}"
# not prose-like code, or not Python: as bench_long_records skips them
SKIP = (
    "test/",
    "idlelib/",
    "site-packages/",
    "lib2to3/",
    "encodings/",
    "pydoc_data/",
    "turtledemo/",
)


def function_prompts(root: Path) -> list[dict]:
    """Every public top-level function of the standard library under `root` with a docstring
    of at least two lines, as a "write this function" prompt, in a fixed order."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(SKIP) or "/test" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or doc.count("\n") < 1:
                continue
            text = ASK.format(name=node.name, args=ast.unparse(node.args), module=module, doc=doc)
            out.append({"id": f"{module}.{node.name}", "prompt": text})
    return out


def chat_prompts(generic: Path, limit: int) -> list[dict]:
    """ShareGPT conversations' first user turns (at most CHAT_CHARS long, so the answer fits),
    none of them a conversation of the generic shards: the chat third of a mixed budget."""
    from eagle3.data.prompts import load_prompts

    seen = {json.loads(line)["id"].split("_")[0] for line in generic.open()}
    out = []
    for p in load_prompts("sharegpt", limit=limit):
        text = p.messages[0]["content"] if p.messages[0]["role"] == "user" else ""
        if text.strip() and len(text) <= CHAT_CHARS and p.id.split("_")[0] not in seen:
            out.append({"id": f"chat-{p.id}", "prompt": text})
    return out


def math_prompts(path: Path) -> list[dict]:
    """GSM8K's train questions (the test split is the benchmark): the math third."""
    rows = [json.loads(line) for line in path.open() if line.strip()]
    return [{"id": f"gsm8k-train-{i}", "prompt": r["question"]} for i, r in enumerate(rows)]


def domain_sources(args: argparse.Namespace, work: Path, root: Path | None) -> dict[str, list]:
    """The budget's prompt sources, each seeded-shuffled: code alone, or chat, code and math."""
    from eagle3.data.long_context import stdlib_dir

    sources = {"code": function_prompts(root or stdlib_dir())}
    if args.budget == "mixed":
        sources["chat"] = chat_prompts(work / "generic" / "sharegpt.jsonl", 4 * args.generic)
        sources["math"] = math_prompts(Path(args.math))
    for k, prompts in sources.items():  # code's sample is --budget code's: mixed takes its head
        random.Random(args.seed if k == "code" else f"{args.seed}:{k}").shuffle(prompts)
    return sources


def write_domain_prompts(
    path: Path, args: argparse.Namespace, work: Path, benches: str, root: Path | None = None
) -> None:
    """--domain prompts as a JSONL prompt source: a seeded sample of the budget's sources
    (all of --budget code is standard-library functions; --budget mixed takes a third each of
    chat, code and math), none sharing a 13-word run with a benchmark."""
    if path.is_file():
        return
    from eagle3.data.decontaminate import BenchmarkIndex

    index = BenchmarkIndex.from_sources(benches.split(","))
    sources = domain_sources(args, work, root)
    picked = []
    for k, (name, prompts) in enumerate(sources.items()):
        share = args.domain // len(sources) + (k < args.domain % len(sources))
        kept = [p for p in prompts if not index.hit([{"role": "user", "content": p["prompt"]}])]
        print(f"domain prompts: {name}: {share} of {len(kept)} ({len(prompts) - len(kept)} "
              "share text with a benchmark)")  # fmt: skip
        if len(kept) < share:
            sys.exit(f"bench_finetune: only {len(kept)} {name} prompts; lower --domain")
        picked += kept[:share]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in picked))
    tmp.replace(path)


def held_out_args(work: Path, args: argparse.Namespace) -> list[str]:
    """eagle3.evaluate's general held-out set: the generic conversations that the start's
    validation split, and so replay's draw, keep out of every arm's training (the recipe's
    data.val_fraction and val_seed are evaluate's defaults); none with --held-out 0."""
    if not args.held_out:
        return []
    return ["--held-out", str(work / "generic"), "--held-out-prompts", str(args.held_out)]


def run(cmd: list[str], log: Path, done: Path | None = None) -> None:
    """Run a stage's command (its own resume makes a rerun finish it), unless `done` exists."""
    if done is not None and done.exists():
        return
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "a") as f:
        if subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"bench_finetune: failed, see {log}")


def arm_overrides(arm: str, work: Path, args: argparse.Namespace) -> list[str]:
    """What each arm changes in the recipe (the same targeted shards and epochs for all but
    the start). An arm's directory keeps its name whatever --lk is: train_arm refuses a
    finished -lk arm that trained with another loss. The generic shards and the start are named
    by their real paths: another work directory (another --budget) that links to them reuses
    the same start instead of being refused for a different path."""
    generic = (work / "shards-generic").resolve()
    if arm == "start":
        return [f"data.shard_dirs=[{generic}]", f"train.epochs={args.start_epochs}"]
    common = [f"data.shard_dirs=[{work / 'shards-domain'}]", f"train.epochs={args.epochs}"]
    if arm == "scratch":
        return common
    lr = 2.0e-3 / args.lr_ratio  # the recipe's lr (configs/train/smollm2-q4-cpu.yaml)
    tune = [*common, f"model.init_from={(work / 'start').resolve() / 'final'}", f"optim.lr={lr:g}",
            "optim.warmup_steps=0"]  # fmt: skip
    if arm == "finetune":
        return tune
    anchored = [*tune, f"train.anchor_l2={args.anchor:g}"]
    if arm == "anchor":
        return anchored
    replay = [*anchored, f"data.replay_shard_dirs=[{generic}]",
              f"data.replay_fraction={args.replay:g}"]  # fmt: skip
    if arm.startswith("onpolicy"):  # the same prompts' tokens, with the start's rejection log
        replay = [o for o in replay if not o.startswith("data.shard_dirs=")]
        replay.append(f"data.shard_dirs=[{work / 'rollout-start'}]")
    return [*replay, f"train.loss={args.lk}"] if arm.endswith("-lk") else replay


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench-finetune")
    ap.add_argument("--generic", type=int, default=1200, help="off-policy ShareGPT conversations")
    ap.add_argument("--start-epochs", type=int, default=2)
    ap.add_argument("--domain", type=int, default=300, help="prompts the target answers")
    ap.add_argument(
        "--budget", choices=("code", "mixed"), default="code",
        help="the domain: code prompts, or a third each of chat, code and math (needs --math)",
    )  # fmt: skip
    ap.add_argument("--math", help="GSM8K's train.jsonl: the math third of --budget mixed")
    ap.add_argument("--seed", type=int, default=0, help="the domain prompts' sample")
    ap.add_argument("--epochs", type=int, default=4, help="epochs of every arm on the domain")
    ap.add_argument(
        "--lr-ratio", type=float, default=4.0, help="the fine-tunes' lr = recipe's / this"
    )
    ap.add_argument(
        "--anchor", type=float, default=1e-2, help="train.anchor_l2 of anchor and replay"
    )
    ap.add_argument("--replay", type=float, default=0.25, help="data.replay_fraction of replay")
    ap.add_argument(
        "--lk", choices=LK_LOSSES, default="lk-alpha",
        help="train.loss of the -lk arms",
    )  # fmt: skip
    ap.add_argument(
        "--jobs", type=int, default=1,
        help="fine-tune arms trained at once, each on cores / jobs threads (the start alone)",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=20, help="prompts a benchmark")
    ap.add_argument(
        "--held-out", type=int, default=20, metavar="N",
        help="generic conversations every arm holds out, measured as held_out/sharegpt (0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--answer-tokens", type=int, default=192, help="new tokens of each domain answer"
    )
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a turn, measured")
    ap.add_argument(
        "--arms", default=",".join(ARMS), help=f"which arms, start first ({','.join(ARMS)})"
    )
    ap.add_argument(
        "--gsm8k", help="GSM8K's test.jsonl (no embedded copy): without it, no GSM8K row"
    )
    args = ap.parse_args()
    if args.budget == "mixed" and not args.math:
        ap.error("--budget mixed: give --math PATH (GSM8K's train.jsonl, the math third)")
    if args.jobs < 1:
        ap.error(f"--jobs: at least 1 (not {args.jobs})")
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or args.arms[0] != "start":
        ap.error(f"--arms: start first, then any of {', '.join(ARMS)} (not {unknown})")
    return args


def make_data(work: Path, args: argparse.Namespace, benches: str) -> None:
    """The generic (off-policy) and the domain (the target's own answers) shards."""
    py = sys.executable
    run([py, "-m", "datagen.offpolicy", "--prompts", "sharegpt", "--limit", str(args.generic),
         "--split", "train", "--max-turns", "2", "--exclude-benchmarks", benches,
         "--out", str(work / "generic")], work / "generic.log")  # fmt: skip
    run([py, "-m", "datagen.capture", "--target", TARGET, "--data", str(work / "generic"),
         "--out", str(work / "shards-generic"), "--max-length", "512", "--long-records", "cut"],
        work / "capture-generic.log")  # fmt: skip
    write_domain_prompts(work / "domain-prompts.jsonl", args, work, benches)
    run([py, "-m", "datagen.local", "--target", TARGET, "--prompts",
         str(work / "domain-prompts.jsonl"), "--exclude-benchmarks", benches,
         "--max-new-tokens", str(args.answer_tokens), "--temperature", "0",
         "--out", str(work / "domain")],
        work / "domain.log")  # fmt: skip
    run([py, "-m", "datagen.capture", "--target", TARGET, "--data", str(work / "domain"),
         "--out", str(work / "shards-domain"), "--max-length", "1024"],
        work / "capture-domain.log")  # fmt: skip


def rollout_start(work: Path) -> None:
    """The on-policy arms' round: the start drafter's greedy decode of the domain prompts
    against the target, replayed from the domain's capture (datagen.rollout --from-shards: its
    records are the target's own greedy answers, so a decode would write the same tokens)."""
    run([sys.executable, "-m", "datagen.rollout", "--target", TARGET, "--draft",
         str(work / "start" / "final"), "--from-shards", str(work / "shards-domain"),
         "--steps", str(ROLLOUT_STEPS), "--out", str(work / "rollout-start")],
        work / "rollout-start.log", done=work / "rollout-start" / "index.jsonl")  # fmt: skip


def train_side_by_side(work: Path, args: argparse.Namespace, arms: list[str]) -> dict[str, float]:
    """Train the fine-tune arms, --jobs at a time, each on its share of the cores (torch's
    threads): the recipe's small matmuls leave part of a second thread idle, so arms side by
    side finish sooner than in turn. Their seconds then count the sharing: compare arms of one
    --jobs. A failed arm exits once the others have finished (their work is kept)."""
    env = None
    if args.jobs > 1:
        threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with ThreadPoolExecutor(args.jobs) as pool:
        running = {
            arm: pool.submit(
                train_arm, work / arm, CONFIG, arm_overrides(arm, work, args), "bench_finetune", env
            )
            for arm in arms
        }
    return {arm: future.result() for arm, future in running.items()}


def main() -> None:
    args = parse_args()
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    benches = "mt_bench,humaneval" + (f",gsm8k={args.gsm8k}" if args.gsm8k else "")
    make_data(work, args, benches)
    seconds = {"start": train_arm(work / "start", CONFIG, arm_overrides("start", work, args),
                                  "bench_finetune")}  # fmt: skip
    if any(arm.startswith("onpolicy") for arm in args.arms):
        rollout_start(work)
    seconds |= train_side_by_side(work, args, args.arms[1:])

    out = work / ("eval.json" if args.arms == ARMS else f"eval-{'-'.join(args.arms)}.json")
    drafts = [arg for arm in args.arms for arg in ("--draft", str(work / arm / "final"))]
    run([py, "-m", "eagle3.evaluate", "--target", TARGET, "--device", "cpu", *drafts,
         "--bench", benches, "--limit", str(args.prompts), *held_out_args(work, args),
         "--max-new-tokens", str(args.max_new_tokens),
         "--steps", str(ROLLOUT_STEPS), "--temperature", "0", "--context-buckets", "0",
         "--engine", "vllm", "--engine-only", "--engine-arg=--enforce-eager",
         "--engine-passes", "batched", "--engine-batch", str(ENGINE_BATCH),
         "--json", str(out)], work / "eval.log", done=out)  # fmt: skip
    report = json.loads(out.read_text())
    print(markdown_table(*tau_table(report, args.arms)))
    for base in ("start", "replay"):
        if base in args.arms:
            print(f"\nτ(arm) − τ({base}) over the same prompts, 95% interval of the difference")
            print(markdown_table(*paired_table(report, args.arms, base)))
    print("training seconds: " + ", ".join(f"{a} {s:.0f}" for a, s in seconds.items()))


def arm_rows(report: dict) -> dict[tuple[str, str], dict]:
    """(arm, benchmark) -> the batched vLLM pass's result row."""
    suffix = engine_row_name("", ENGINE_BATCH)  # the batched pass's rows
    return {
        (Path(row["drafter"].removesuffix(suffix)).parent.name, row["bench"]): row
        for row in report["results"]
        if row["drafter"].endswith(suffix)
    }


def columns(report: dict) -> list[str]:
    """The tables' benchmarks: BENCHES, then the held-out sets the report measured."""
    return [*BENCHES, *sorted({row["bench"] for row in report["results"]} - set(BENCHES))]


def tau_table(report: dict, arms: list[str]) -> tuple[list[str], list[list[str]]]:
    """Arms x benchmarks: τ [95% interval] from each arm's vLLM row."""
    rows, benches = arm_rows(report), columns(report)
    table = []
    for arm in arms:
        cells = [arm]
        for bench in benches:
            row = rows.get((arm, bench))
            if row is None:
                cells.append("-")
                continue
            bucket = next(b for b in row["by_context"] if b["steps"])
            lo, hi = bucket["tau_ci95"] or (bucket["tau"], bucket["tau"])
            cells.append(f"{bucket['tau']:.2f} [{lo:.2f}, {hi:.2f}]")
        table.append(cells)
    return ["arm", *[f"τ {b}" for b in benches]], table


def paired_table(report: dict, arms: list[str], base: str) -> tuple[list[str], list[list[str]]]:
    """Arms x benchmarks: τ(arm) − τ(base) [95% interval], paired over the same prompts."""
    rows, benches = arm_rows(report), columns(report)
    table = []
    for arm in arms:
        if arm == base:
            continue
        cells = [arm]
        for bench in benches:
            if (arm, bench) not in rows or (base, bench) not in rows:
                cells.append("-")
                continue
            diff, ci = paired_tau_difference(
                rows[(base, bench)]["per_prompt"], rows[(arm, bench)]["per_prompt"]
            )
            cells.append(f"{diff:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""))
        table.append(cells)
    return ["arm", *[f"Δτ {b}" for b in benches]], table


if __name__ == "__main__":
    main()
