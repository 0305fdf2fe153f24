"""The engine's shared 429 gate and adaptive concurrency limit, on a real event loop."""

import asyncio

from datagen.engine import MIN_CONCURRENCY, Throttle, interleave
from eagle3.data.prompts import Prompt


def test_limit_cuts_once_per_round_and_gate_holds_everyone():
    async def scenario():
        loop = asyncio.get_running_loop()
        t = Throttle(100)
        sent = loop.time()
        for _ in range(50):  # 50 429s of requests sent in the same round: one cut
            t.on_rate_limit(0.05, sent)
        assert t.limit == 70
        assert t.gate_until >= loop.time() + 0.04
        t.on_rate_limit(None, loop.time())  # a request sent after the cut: cut again
        assert t.limit == 49
        start = loop.time()
        await t.acquire()  # the gate holds the sender until the hint has passed
        assert loop.time() >= t.gate_until - 1e-3 and loop.time() > start
        t.release()
        for _ in range(50):
            t.on_rate_limit(0.0, loop.time() + 1)
        assert t.limit == MIN_CONCURRENCY

    asyncio.run(scenario())


def test_acquire_blocks_at_the_limit_and_release_wakes():
    async def scenario():
        t = Throttle(2)
        await t.acquire()
        await t.acquire()
        waiter = asyncio.create_task(t.acquire())
        await asyncio.sleep(0)
        assert not waiter.done() and t.active == 2
        t.release()
        await asyncio.wait_for(waiter, 1)
        assert t.active == 2

    asyncio.run(scenario())


def test_interleave_round_robins_datasets():
    def ps(name, n):
        return [Prompt(f"{name}{i}", name, [{"role": "user", "content": "x"}]) for i in range(n)]

    order = [p.id for p in interleave([ps("a", 3), ps("b", 1), ps("c", 2)])]
    assert order == ["a0", "b0", "c0", "a1", "c1", "a2"]
