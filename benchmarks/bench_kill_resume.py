"""What a kill -9 costs a resumed OpenRouter run: reported spend against what was billed.

Starts the fake OpenRouter (``python -m datagen.openrouter.fake_server``) as a process with a set
latency, runs ``python -m datagen.openrouter`` on N prompts, kills it with SIGKILL after
--kill-after seconds (requests in flight), resumes the same command at once and lets it run to its
end, then prints one line: the orphans the kill left and their worst case, the resume's exit code,
prompts done, wall time, the spend the run reports (its summary and its ledger) and what the fake
billed (its ``GET /key`` usage), and their ratio (1.000 = the report is what was billed)::

    python benchmarks/bench_kill_resume.py                     # 300 prompts, 64 in flight, kill at 4 s
    python benchmarks/bench_kill_resume.py --budget 0.45       # the orphans' worst case fills the budget
    python benchmarks/bench_kill_resume.py --code /tmp/before  # another checkout's datagen.openrouter

``--code DIR`` runs the CLI (and reads the ledger) from another checkout, e.g. a ``git archive``
of an older commit, against the same fake: the same scenario before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
model: moonshotai/kimi-k2.5
native_precision: int4
ignore: [fireworks, baseten]
max_tokens: {max_tokens}
concurrency: {concurrency}
request_timeout_s: {timeout}
log_every_s: 30
grace_s: 5
"""

LEDGER = """\
import json, sys
from datagen.openrouter.ledger import Ledger
led = Ledger(sys.argv[1]); led.close()
print(json.dumps({"spent": led.spent_usd, "orphans": led.orphans, "orphan_usd": led.orphan_usd}))
"""


def start_fake(latency: float, tokens: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "datagen.openrouter.fake_server", "--latency", str(latency),
         "--completion-tokens", tokens],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,  # `-m` puts the cwd first: this checkout's
    )  # fmt: skip
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"fake server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def billed(url: str) -> float:
    with urllib.request.urlopen(url + "/key", timeout=30) as resp:
        return float(json.load(resp)["data"]["usage"])


def ledger(code: Path, out: Path, env: dict) -> dict:
    text = subprocess.run(
        [sys.executable, "-c", LEDGER, str(out / "ledger.jsonl")],
        cwd=code, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return json.loads(text.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--kill-after", type=float, default=4.0, help="seconds after the start")
    ap.add_argument("--latency", type=float, default=3.0, help="the fake's seconds per request")
    ap.add_argument("--timeout", type=float, default=4.0, help="request_timeout_s")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--completion-tokens", default="200,2000", help="the fake's min,max")
    ap.add_argument("--budget", type=float, default=100.0)
    ap.add_argument("--code", default=str(ROOT), help="checkout whose datagen.openrouter runs")
    ap.add_argument("--show", action="store_true", help="print the resume's stderr too")
    args = ap.parse_args(argv)
    code = Path(args.code).resolve()
    env = {**os.environ, "PYTHONPATH": str(code), "OPENROUTER_API_KEY": "sk-or-bench"}
    env.pop("OPENROUTER_BASE_URL", None)

    fake, url = start_fake(args.latency, args.completion_tokens)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            cfg = tmp / "c.yaml"
            cfg.write_text(
                CONFIG.format(
                    max_tokens=args.max_tokens, concurrency=args.concurrency, timeout=args.timeout
                )
            )
            with open(tmp / "p.jsonl", "w") as f:
                for i in range(args.prompts):
                    f.write(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: explain."}) + "\n")
            out = tmp / "out"
            cmd = [sys.executable, "-m", "datagen.openrouter", "--budget", str(args.budget),
                   "--config", str(cfg), "--prompts", str(tmp / "p.jsonl"), "--out", str(out),
                   "--base-url", url]  # fmt: skip
            first = subprocess.Popen(
                cmd, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            time.sleep(args.kill_after)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            dead = ledger(code, out, env)
            t0 = time.monotonic()
            resume = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
            wall = time.monotonic() - t0
            time.sleep(args.latency + 0.5)  # anything still running upstream is billed by now
            after = ledger(code, out, env)
            server = billed(url)
            if args.show:
                print(resume.stderr, file=sys.stderr)
            summary = resume.stdout.strip().splitlines()[-1] if resume.stdout.strip() else ""
            m = re.search(r"(\d+)/(\d+) prompts done.*\$([0-9.]+) spent", summary)
            if m is None:
                raise SystemExit(f"no summary line; stderr:\n{resume.stderr[-3000:]}")
            print(
                f"kill -9 after {args.kill_after:g}s: {dead['orphans']} orphans, worst case "
                f"${dead['orphan_usd']:.4f}; resume exit {resume.returncode} in {wall:.1f}s, "
                f"{m.group(1)}/{m.group(2)} done; reported ${m.group(3)} (ledger "
                f"${after['spent']:.4f}, {after['orphans']} orphans held), billed ${server:.4f}: "
                f"ratio {after['spent'] / server:.3f}"
            )
    finally:
        fake.send_signal(signal.SIGTERM)
        fake.wait(30)


if __name__ == "__main__":
    main()
