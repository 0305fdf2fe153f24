"""``python -m datagen.local``: regenerate responses with the target itself, locally.

Two backends, one output format (the ``eagle3.data.records`` records ``datagen.openrouter`` writes,
resumed the same way: prompts already in ``--out`` are skipped)::

    # any OpenAI-compatible server(s): SGLang, vLLM; round-robin, --concurrency per server
    python -m datagen.local --prompts sharegpt --limit 2000 --out out/responses \\
        --base-url http://node1:30000 http://node2:30000 --concurrency 64

    # a managed vLLM server for the target (started, used as the server path above, stopped)
    python -m datagen.local --prompts sharegpt --limit 2000 --out out/responses \\
        --engine vllm --target smollm2-135m-q4 [--tensor-parallel-size 8] [--engine-arg=ARG]

    # in-process transformers generation (the embedded 4-bit SmolLM2 on a CPU, or any HF dir)
    python -m datagen.local --prompts sharegpt --limit 200 --out out/responses \\
        --target smollm2-135m-q4 --batch-size 16 --max-new-tokens 256

``--exclude-benchmarks mt_bench,humaneval,gsm8k=FILE`` drops, before anything is generated,
the prompts that overlap a benchmark (:mod:`eagle3.data.decontaminate`; one line says how many).
Multi-turn prompts are answered turn by turn, each request carrying the target's own earlier
answers. Reasoning is kept apart from the answer: servers return it in ``reasoning_content``
(SGLang/vLLM with a reasoning parser) or ``reasoning``; in-process it is the text before the
think-closing tag. Server responses are sorted by :func:`datagen.retry.check` (retry on 429,
5xx, connection errors, empty bodies; fail on other 4xx) with capped backoff; a retry goes to
the next server, so one server down slows the run instead of failing its share of prompts.
Default temperature and its reasons: :mod:`datagen.generate`. Progress (:mod:`eagle3.progress`)
counts answered turns (each as it finishes, in-process too), the prompts of earlier runs as
already done; the last line says how many prompts are records and in which files.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from datagen import retry
from datagen.generate import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
)
from datagen.transcript import Reply, Transcript, parse_reply
from eagle3.cli import HelpFormatter, run_main
from eagle3.data.chat import RenderError, check_renderable, load_chat_template
from eagle3.data.decontaminate import add_exclude_args, exclude_contaminated
from eagle3.data.prompts import Prompt, dedupe, load_prompts, split_prompts, user_turns
from eagle3.data.records import ResultStore, make_failure
from eagle3.engine.server import add_engine_args
from eagle3.errors import Eagle3Error
from eagle3.progress import Progress, count

log = logging.getLogger("datagen.local")

DEFAULT_CONCURRENCY = 32  # requests in flight per server
DEFAULT_MAX_ATTEMPTS = 6
DEFAULT_TIMEOUT_S = 1800.0  # per request: long reasoning answers take minutes on a busy server
TICK_S = 1.0  # servers: how often the progress line is looked at while requests run
CHUNK_BATCHES = 4  # in-process: prompts taken at a time = batch size x this (sorted together);
# small, because records are written when their chunk is done: a kill loses at most one chunk


@dataclass
class Stats:
    done: int = 0  # prompts
    failed: int = 0
    too_long: int = 0  # prompts over --max-prompt-tokens (skipped, in failed.jsonl)
    retries: Counter = field(default_factory=Counter)  # requests retried, by reason
    requests: int = 0
    completion_tokens: int = 0  # over all turns
    length: int = 0  # turns cut at max tokens (kept, flagged in the record)
    started: float = field(default_factory=time.monotonic)
    earlier: list[Prompt] = field(default_factory=list)  # done by earlier runs
    progress: Progress | None = None  # counts answered turns, from start()

    def start(self, todo: list[Prompt]) -> None:
        """Generation begins (the model is loaded, the servers answer): the clocks start."""
        self.started = time.monotonic()
        self.progress = generation_progress("local", self.earlier, todo, self)

    def count(self, reply: Reply) -> None:
        """Count one answered turn."""
        self.completion_tokens += int(reply.usage.get("completion_tokens") or 0)
        if reply.finish_reason == "length":
            self.length += 1
        if self.progress is not None:
            self.progress.update(1)

    def give_up(self, prompt: Prompt, answered: int) -> None:
        """A prompt failed after `answered` turns: its other turns leave the total."""
        if self.progress is not None:
            self.progress.drop(user_turns(prompt) - answered)

    def line(self) -> str:
        rate = self.completion_tokens / max(time.monotonic() - self.started, 1e-9)
        retries = sum(self.retries.values())
        return (
            f"{self.done} prompts done, {self.failed} failed, {self.completion_tokens:,} tokens "
            f"({rate:,.0f} tok/s), {self.length} cut at max tokens, {retries} retries"
            + (f", {self.too_long} prompts too long (skipped)" if self.too_long else "")
        )


def generation_progress(stage: str, done: list[Prompt], todo: list[Prompt], stats: Stats):
    """Progress in answered turns (prompts, when every prompt is one turn): the prompts done
    by earlier runs count as already done, a prompt that fails leaves the total."""
    already = sum(map(user_turns, done))
    total = already + sum(map(user_turns, todo))
    unit = "prompts" if total == len(done) + len(todo) else "turns"
    return Progress(stage, total, unit, already=already, status=stats.line)


def produced_line(stage: str, out: str, prompts: list[Prompt], store: ResultStore, stats) -> str:
    """The closing line: how many of the prompts are records now, and in which files."""
    ids = {p.id for p in prompts}
    done = store.done_ids()
    files = sorted({f"{p.dataset}.jsonl" for p in prompts})
    return (
        f"{stage}: {count(len(done & ids))} of {count(len(ids))} prompts are records "
        f"({stats.done:,} written in this run, {count(stats.completion_tokens)} tokens) -> {out} "
        f"({', '.join(files)}{failed_note(store.failed_reasons(), ids - done)})"
    )


def failed_note(failed_reasons: dict[str, str], missing: set[str]) -> str:
    """'; failed.jsonl: 2 prompt too long, 1 http 400' for the prompts that are not records
    (`missing`): a prompt skipped as too long is not one the server failed to answer."""
    reasons = Counter(reason for pid, reason in failed_reasons.items() if pid in missing)
    if not reasons:
        return ""
    why = ", ".join(f"{n:,} {reason}" for reason, n in reasons.most_common())
    return f"; failed.jsonl: {why}"


# ----------------------------------------------------------------------------- servers


def chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def models_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/models" if base.endswith("/v1") else "/v1/models")


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model a server lists (``--model`` not given)."""
    try:
        async with session.get(models_url(base_url)) as resp:
            body = await resp.json(content_type=None)
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError) as err:
        raise Eagle3Error(
            f"cannot list the models of {base_url} ({type(err).__name__}); is the server up? "
            "or pass --model"
        ) from err


class ServerPool:
    """Round-robin over OpenAI-compatible servers, `concurrency` requests in flight on each."""

    def __init__(self, args, store: ResultStore, stats: Stats):
        self.urls = list(args.base_url)
        self.args = args
        self.store = store
        self.stats = stats
        self.model = args.model
        self.rng = random.Random(args.seed)

    def payload(self, conversation: list[dict]) -> dict:
        a = self.args
        body = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in conversation],
            "max_tokens": a.max_new_tokens,
            "temperature": a.temperature,
            "top_p": a.top_p,
            "stream": False,
        }
        if a.template_kwargs:
            body["chat_template_kwargs"] = a.template_kwargs
        return body

    async def request(
        self, session: aiohttp.ClientSession, prompt: Prompt, conversation: list[dict], home: int
    ) -> Reply | None:
        """One assistant turn (its provider: the server that gave it), or None: failed for
        good and written to failed.jsonl."""
        body = json.dumps(self.payload(conversation), ensure_ascii=False).encode("utf-8")

        def server(attempt: int) -> str:
            return self.urls[(home + attempt - 1) % len(self.urls)]  # retries move on

        async def send(attempt: int) -> retry.Attempt:
            self.stats.requests += 1
            try:
                async with session.post(
                    chat_url(server(attempt)),
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    status, headers, raw = resp.status, dict(resp.headers), await resp.read()
            except TimeoutError:
                sent = retry.Attempt(retry.Verdict(retry.RETRY, "timeout"))
            except aiohttp.ClientError as err:
                reason = f"connection error ({type(err).__name__})"
                sent = retry.Attempt(retry.Verdict(retry.RETRY, reason))
            else:
                payload = retry.parse_body(raw)
                message = ((payload or {}).get("choices") or [{}])[0].get("message")
                if isinstance(message, dict) and not message.get("reasoning"):
                    # check() must see SGLang/vLLM's reasoning_content as reasoning
                    message["reasoning"] = message.get("reasoning_content") or ""
                sent = retry.Attempt(retry.check(status, payload), status, headers, payload)
            if sent.verdict.action == retry.RETRY:
                self.stats.retries[sent.verdict.reason] += 1
            return sent

        def on_retry(attempt: int, last: retry.Attempt, wait: float) -> None:
            log.debug(
                "%s: attempt %d on %s: %s; retry in %.2fs",
                prompt.id,
                attempt,
                server(attempt),
                last.verdict.reason,
                wait,
            )

        policy = retry.Policy(max_attempts=self.args.max_attempts)
        last, attempts = await retry.send_with_retries(send, policy, self.rng, on_retry=on_retry)
        if last.verdict.action == retry.OK:
            return dataclasses.replace(parse_reply(last.body), provider=server(attempts))
        # FAIL, RETRY (gave up), or 402, which a local server never means
        retry.fail_prompt(
            self.store,
            prompt,
            last.verdict,
            status=last.status,
            attempts=attempts,
            gave_up=last.verdict.action == retry.RETRY,
        )
        self.stats.failed += 1
        return None

    async def conversation(self, session: aiohttp.ClientSession, prompt: Prompt, home: int) -> None:
        transcript = Transcript(prompt)
        while transcript.advance():
            reply = await self.request(session, prompt, transcript.messages, home)
            if reply is None:
                self.stats.give_up(prompt, len(transcript.replies))
                return
            transcript.add(reply)
            self.stats.count(reply)
        record = transcript.record(self.model, "local " + ", ".join(transcript.providers()))
        if self.store.append(prompt.dataset, record):
            self.stats.done += 1

    async def run(self, prompts: list[Prompt]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        timeout = aiohttp.ClientTimeout(total=self.args.timeout)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if self.model is None:
                self.model = await served_model(session, self.urls[0])
            log.info(
                "%d prompts to %d server(s), model %s", len(prompts), len(self.urls), self.model
            )
            self.stats.start(prompts)

            async def worker(home: int) -> None:
                while not queue.empty():
                    await self.conversation(session, queue.get_nowait(), home)

            async def progress() -> None:  # a line also while no request finishes
                while self.stats.progress is not None:
                    await asyncio.sleep(TICK_S)
                    self.stats.progress.tick()

            n = len(self.urls) * self.args.concurrency
            ticker = asyncio.create_task(progress())
            try:
                await asyncio.gather(
                    *(worker(k % len(self.urls)) for k in range(min(n, len(prompts))))
                )
            finally:
                ticker.cancel()


# ----------------------------------------------------------------------------- in-process


def run_inprocess(args, prompts: list[Prompt], store: ResultStore, stats: Stats) -> None:
    # in-process only: a run against servers (--base-url) never loads torch or transformers
    import torch

    from datagen.generate import Generator
    from eagle3.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(
        args.target, dtype=args.model_dtype, device=args.device, device_map=args.device_map
    )
    check_renderable(target.tokenizer, args.chat_template, args.target)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}  # as ServerPool.payload
    gen = Generator(
        target.model,
        target.tokenizer,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        chat_template=args.chat_template,
        template_kwargs=args.template_kwargs,
        **sampling,
    )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model_name = args.model or target.name
    chunk = args.batch_size * CHUNK_BATCHES
    log.info("%d prompts, in-process on %s, batch %d", len(prompts), target.name, args.batch_size)
    stats.start(prompts)
    for start in range(0, len(prompts), chunk):
        group = [Transcript(p) for p in prompts[start : start + chunk]]
        alive = group
        while alive:  # one assistant turn for every conversation still open
            ready, prompt_ids = [], []
            for t in alive:
                if not t.advance():
                    continue
                try:
                    ids = gen.prompt(t.messages)
                except RenderError as err:  # one bad prompt: fail it, keep the rest
                    store.append_failed(make_failure(t.prompt, err.reason, detail=str(err)))
                    stats.failed += 1
                    stats.give_up(t.prompt, len(t.replies))
                    continue
                if args.max_prompt_tokens and len(ids) > args.max_prompt_tokens:
                    # One 6k-token ShareGPT prompt makes its whole batch crawl on a CPU.
                    store.append_failed(
                        make_failure(t.prompt, "prompt too long", tokens=len(ids),
                                     max_prompt_tokens=args.max_prompt_tokens)
                    )  # fmt: skip
                    stats.too_long += 1
                    stats.give_up(t.prompt, len(t.replies))
                    continue
                ready.append(t)
                prompt_ids.append(ids)

            def answered(i: int, turn, ready=ready) -> None:  # as each row finishes: progress
                message = {
                    "role": "assistant",
                    "content": turn.content,
                    "reasoning": turn.reasoning,
                }
                usage = {
                    "prompt_tokens": turn.prompt_tokens,
                    "completion_tokens": turn.completion_tokens,
                }
                reply = Reply(message, usage, turn.finish_reason, "transformers")
                ready[i].add(reply)
                stats.count(reply)

            if prompt_ids:
                gen.generate_ids(prompt_ids, on_done=answered)
            alive = ready
        for t in group:  # in prompt order; failed ones are in failed.jsonl
            if t.complete() and store.append(
                t.prompt.dataset, t.record(model_name, "transformers")
            ):
                stats.done += 1


# ----------------------------------------------------------------------------- main


def run_engine(args, prompts: list[Prompt], store: ResultStore, stats: Stats) -> None:
    """--engine vllm: a managed server for --target, then the server path (ServerPool)."""
    # --engine only: these import torch, which a run against servers (--base-url) never loads
    from eagle3.engine.server import EngineSettings, managed_engine
    from eagle3.engine.sizing import engine_context, target_context
    from eagle3.targets import load_tokenizer, resolve

    target = resolve(args.target)
    if args.chat_template is not None:
        raise Eagle3Error(
            "--chat-template is in-process only; with --engine pass "
            "--engine-arg=--chat-template=FILE to the server"
        )
    served = args.model or target.name
    # the server is told the context these prompts and answers need, not the target's whole
    max_model_len = engine_context(
        load_tokenizer(target), prompts, args.max_new_tokens, target_context(target)
    )
    engine = EngineSettings.from_args(args)
    with managed_engine(
        engine, target, served_model_name=served, max_model_len=max_model_len
    ) as server:
        log.info("vLLM server for %s up in %.0f s, %s (log %s)", target.name, server.startup_seconds,
                 server.serving.describe(), server.log_path)  # fmt: skip
        engine_args = argparse.Namespace(**{**vars(args), "base_url": [server.base_url],
                                            "model": served})  # fmt: skip
        asyncio.run(ServerPool(engine_args, store, stats).run(prompts))


def first_user_turns(prompt: Prompt, n: int) -> Prompt:
    """The prompt cut after its n-th user turn (same id: resume treats it as the same prompt)."""
    kept, users = [], 0
    for msg in prompt.messages:
        if msg["role"] == "user":
            if users == n:
                break
            users += 1
        kept.append(msg)
    return Prompt(id=prompt.id, dataset=prompt.dataset, messages=kept)


def select_prompts(args) -> list[Prompt]:
    prompts: list[Prompt] = []
    for source in args.prompts:
        prompts.extend(load_prompts(source, limit=args.limit))  # it logs its source's line
    prompts = dedupe(prompts)
    if args.max_turns:
        prompts = [first_user_turns(p, args.max_turns) for p in prompts]
    if args.split != "all":
        train, evals = split_prompts(prompts, args.eval_fraction, seed=args.split_seed)
        prompts = train if args.split == "train" else evals
    # after --max-turns: what is checked is what would be answered and kept in the records
    return exclude_contaminated(prompts, args.exclude_benchmarks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m datagen.local",
        description="Regenerate responses with the target: OpenAI-compatible servers or in-process.",
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        required=True,
        help="sources: sharegpt, mt_bench, humaneval, FILE, hf:org/name",
    )
    p.add_argument(
        "--out", required=True, help="result directory (eagle3.data.records format; resumable)"
    )
    p.add_argument("--limit", type=int, help="at most this many prompts per source")
    p.add_argument(
        "--split",
        choices=["all", "train", "eval"],
        default="all",
        help="deterministic train/eval split of the prompts",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        help="answer only the first N user turns of multi-turn prompts (default: all)",
    )
    add_exclude_args(p)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--split-seed", type=int, default=0)
    backend = p.add_mutually_exclusive_group(required=True)
    backend.add_argument(
        "--base-url", nargs="+", help="OpenAI-compatible server URL(s), e.g. http://host:30000"
    )
    backend.add_argument(
        "--target",
        help="in-process (or with --engine, served): registry name, HF model directory or .gguf",
    )
    add_generation_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    if args.engine and not args.target:
        p.error("--engine needs --target (the model to serve); --base-url is a running server")
    args.chat_template = load_chat_template(args.chat_template)
    return args


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """How each turn is generated, by the servers or in-process."""
    p.add_argument(
        "--model",
        help="model name sent to the servers / written in records (default: the server's or the target's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="in-process: skip turns whose rendered prompt is longer (listed in failed.jsonl)",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="also retry prompts listed in OUT/failed.jsonl (skipped on resume by default)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="0 = greedy (default 0.7, see datagen/generate.py)",
    )
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", help="in-process: a Jinja chat template (file or text)")
    p.add_argument(
        "--template-kwargs",
        type=json.loads,
        help="JSON for the template, e.g. '{\"thinking\": true}' (servers: chat_template_kwargs)",
    )
    p.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight per server"
    )
    p.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS)
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="servers: seconds per request"
    )
    p.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="in-process: sequences per batch"
    )
    p.add_argument("--device", help="in-process: cuda, cpu, ...")
    p.add_argument("--device-map", help='in-process: "auto" spreads a large target over all GPUs')
    p.add_argument(
        "--model-dtype", help="in-process weights dtype (default: bf16 on GPU, fp32 on CPU)"
    )
    p.add_argument("--threads", type=int, help="in-process: CPU threads (torch.set_num_threads)")


def run(args) -> int:
    prompts = select_prompts(args)
    with ResultStore(args.out) as store:
        ids = {p.id for p in prompts}
        done = store.done_ids() & ids
        failed = set() if args.retry_failed else (store.failed_ids() & ids) - done
        todo = [p for p in prompts if p.id not in done and p.id not in failed]
        stats = Stats(earlier=[p for p in prompts if p.id in done])
        log.info(
            "%d prompts, %d already done, %d failed before (skipped; --retry-failed to retry), "
            "%d to generate",
            len(prompts),
            len(done),
            len(failed),
            len(todo),
        )
        try:
            if todo:
                if args.engine:
                    run_engine(args, todo, store, stats)
                elif args.base_url:
                    asyncio.run(ServerPool(args, store, stats).run(todo))
                else:
                    run_inprocess(args, todo, store, stats)
        finally:
            if stats.progress is not None:
                stats.progress.close()  # how far it got, also when interrupted
        print(produced_line("local", args.out, prompts, store, stats), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
