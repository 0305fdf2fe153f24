"""How close the OpenRouter client gets to the ideal rate, and what it costs in client CPU.

Runs the real requester (datagen.openrouter.requester, as ``python -m datagen.openrouter``
drives it: provider rule, ledger reservations, result store, retries) against the fake OpenRouter started as a
separate process with a set latency, and prints one line:

    ratio = achieved requests/s / ideal (concurrency / latency); client CPU s per 1000 requests

    python benchmarks/bench_openrouter.py --requests 20000 --concurrency 2000 --latency 0.2
    python benchmarks/bench_openrouter.py ... --compare-httpx   # bare aiohttp vs httpx loops too

The server shares the machine: on 2 cores its own CPU competes with the client's, so a ratio
below 1 at very high rates may be the server's limit as much as the client's; the CPU s/1000
requests figure is the client's alone (this process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The request the bare client loops send (the requester builds its own).
BARE_BODY = json.dumps(
    {
        "model": "moonshotai/kimi-k2.5",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "hi"}],
        "provider": {"ignore": ["fireworks", "baseten"]},
    }
).encode()


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "datagen.openrouter.fake_server",
            "--latency",
            str(latency),
            "--completion-tokens",
            "20,60",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,  # `-m` puts the cwd first on sys.path: this checkout's fake
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"fake server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


async def run_requester(url: str, n: int, concurrency: int, out: Path) -> tuple[float, float, int]:
    from datagen.openrouter import providers
    from datagen.openrouter.client import OpenRouter
    from datagen.openrouter.ledger import Ledger
    from datagen.openrouter.requester import Requester, Settings
    from eagle3.data.prompts import Prompt
    from eagle3.data.records import ResultStore

    async with OpenRouter(url) as api:
        endpoints = await api.endpoints("moonshotai/kimi-k2.5")
    allowed = providers.select(endpoints, "int4", ["fireworks", "baseten"], 256)
    prompts = [
        Prompt(f"b{i}", "bench", [{"role": "user", "content": f"Benchmark prompt {i}: explain."}])
        for i in range(n)
    ]
    settings = Settings(
        base_url=url,
        api_key="bench",
        model="moonshotai/kimi-k2.5",
        max_tokens=256,
        temperature=0.7,
        reasoning=None,
        provider=providers.provider_block(endpoints, "int4", ["fireworks", "baseten"]),
        prices=providers.dearest(allowed),
        budget=1e6,
        token_budgets={"bench": None},
        concurrency=concurrency,
        log_every=3600,
        progress_bar=False,
    )
    store = ResultStore(out, fsync_interval=1.0)
    ledger = Ledger(out / "ledger.jsonl")
    requester = Requester(settings, [prompts], store, ledger)
    cpu0, t0 = time.process_time(), time.perf_counter()
    outcome = await requester.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ledger.close()
    store.close()
    return wall, cpu, outcome.requests


async def bare_aiohttp(url: str, n: int, concurrency: int) -> tuple[float, float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            async with (
                sem,
                session.post(
                    url + "/chat/completions",
                    data=BARE_BODY,
                    headers={"Content-Type": "application/json"},
                ) as r,
            ):
                json.loads(await r.read())

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0, time.process_time() - cpu0


async def bare_httpx(url: str, n: int, concurrency: int) -> tuple[float, float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def one() -> None:
            async with sem:
                r = await client.post(
                    url + "/chat/completions",
                    content=BARE_BODY,
                    headers={"Content-Type": "application/json"},
                )
                json.loads(r.content)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0, time.process_time() - cpu0


def report(name: str, n: int, concurrency: int, latency: float, wall: float, cpu: float) -> str:
    ideal_wall = math.ceil(n / concurrency) * latency  # every wave of requests takes latency
    ideal_rate = concurrency / latency
    return (
        f"{name}: {n} requests, {concurrency} in flight, {latency * 1000:.0f} ms latency: "
        f"{n / wall:,.0f} req/s vs ideal {ideal_rate:,.0f} (ratio {ideal_wall / wall:.2f}); "
        f"client CPU {1000 * cpu / n:.3f} s per 1000 requests"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=2000)
    ap.add_argument("--latency", type=float, default=0.2, help="seconds per request at the server")
    ap.add_argument("--compare-httpx", action="store_true", help="also time bare client loops")
    args = ap.parse_args(argv)
    proc, url = start_server(args.latency)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wall, cpu, sent = asyncio.run(
                run_requester(url, args.requests, args.concurrency, Path(tmp))
            )
        print(report("datagen requester", sent, args.concurrency, args.latency, wall, cpu))
        if args.compare_httpx:
            for name, fn in (("bare aiohttp", bare_aiohttp), ("bare httpx", bare_httpx)):
                wall, cpu = asyncio.run(fn(url, args.requests, args.concurrency))
                print(report(name, args.requests, args.concurrency, args.latency, wall, cpu))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
