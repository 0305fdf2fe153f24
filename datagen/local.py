"""``python -m datagen.local``: regenerate responses with the target itself, locally.

Two backends, one output format (the ``eagle3.data.records`` records ``datagen.openrouter`` writes,
resumed the same way: prompts already in ``--out`` are skipped)::

    # any OpenAI-compatible server(s): SGLang, vLLM; round-robin, --concurrency per server
    python -m datagen.local --prompts sharegpt --limit 2000 --out out/responses \\
        --base-url http://node1:30000 http://node2:30000 --concurrency 64

    # in-process transformers generation (the embedded 4-bit SmolLM2 on a CPU, or any HF dir)
    python -m datagen.local --prompts sharegpt --limit 200 --out out/responses \\
        --target smollm2-135m-q4 --batch-size 16 --max-new-tokens 256

Multi-turn prompts are answered turn by turn, each request carrying the target's own earlier
answers. Reasoning is kept apart from the answer: servers return it in ``reasoning_content``
(SGLang/vLLM with a reasoning parser) or ``reasoning``; in-process it is the text before the
think-closing tag. Server responses are sorted by :func:`datagen.retry.check` (retry on 429,
5xx, connection errors, empty bodies; fail on other 4xx) with capped backoff; a retry goes to
the next server, so one server down slows the run instead of failing its share of prompts.
Default temperature and its reasons: :mod:`datagen.generate`.
"""

from __future__ import annotations

import argparse
import asyncio
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
from eagle3.data.chat import RenderError, load_chat_template, next_turns
from eagle3.data.prompts import Prompt, dedupe, load_prompts, split_prompts
from eagle3.data.records import ResultStore, make_failure, make_record
from eagle3.errors import Eagle3Error

log = logging.getLogger("datagen.local")

DEFAULT_CONCURRENCY = 32  # requests in flight per server
DEFAULT_MAX_ATTEMPTS = 6
DEFAULT_TIMEOUT_S = 1800.0  # per request: long reasoning answers take minutes on a busy server
LOG_EVERY_S = 30.0
CHUNK_BATCHES = 4  # in-process: prompts taken at a time = batch size x this (sorted together);
# small, because records are written when their chunk is done: a kill loses at most one chunk


@dataclass
class Stats:
    done: int = 0
    failed: int = 0
    requests: int = 0
    completion_tokens: int = 0
    length: int = 0  # turns cut at max tokens (kept, flagged in the record)
    too_long: int = 0  # prompts over --max-prompt-tokens (skipped, in failed.jsonl)
    retries: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        rate = self.completion_tokens / max(time.monotonic() - self.started, 1e-9)
        retries = sum(self.retries.values())
        return (
            f"{self.done} done, {self.failed} failed, {self.completion_tokens:,} tokens "
            f"({rate:,.0f} tok/s), {self.length} cut at max tokens, {retries} retries"
            + (f", {self.too_long} prompts too long (skipped)" if self.too_long else "")
        )


def _usage_add(total: Counter, prompt_tokens: int, completion_tokens: int, usage: dict) -> None:
    total["prompt_tokens"] += prompt_tokens
    total["completion_tokens"] += completion_tokens
    details = usage.get("completion_tokens_details") or {}
    total["reasoning_tokens"] += int(details.get("reasoning_tokens") or 0)
    total["cached_tokens"] += int(
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    )


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

    async def request(self, session, prompt: Prompt, conversation: list[dict], home: int):
        """One assistant turn -> (message, usage, finish_reason, server) or None (failed)."""
        body = json.dumps(self.payload(conversation), ensure_ascii=False).encode("utf-8")
        verdict = retry.Verdict(retry.RETRY, "not sent")
        status = None
        for attempt in range(1, self.args.max_attempts + 1):
            url = self.urls[(home + attempt - 1) % len(self.urls)]  # retries move on
            headers: dict = {}
            payload = None
            self.stats.requests += 1
            try:
                async with session.post(
                    chat_url(url), data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    status, headers, raw = resp.status, dict(resp.headers), await resp.read()
                payload = retry.parse_body(raw)
                message = ((payload or {}).get("choices") or [{}])[0].get("message")
                if isinstance(message, dict) and not message.get("reasoning"):
                    message["reasoning"] = message.get("reasoning_content") or ""
                verdict = retry.check(status, payload)
            except TimeoutError:
                status, verdict = None, retry.Verdict(retry.RETRY, "timeout")
            except aiohttp.ClientError as err:
                status, verdict = (
                    None,
                    retry.Verdict(retry.RETRY, f"connection error ({type(err).__name__})"),
                )
            if verdict.action == retry.OK:
                choice = payload["choices"][0]
                return (
                    choice["message"],
                    payload.get("usage") or {},
                    choice.get("finish_reason"),
                    url,
                )
            if verdict.action != retry.RETRY:  # FAIL (or 402, which a local server never means)
                return self.fail(prompt, verdict, status, attempt)
            self.stats.retries[verdict.reason] += 1
            if attempt < self.args.max_attempts:
                wait = retry.delay(attempt, headers, payload, now=time.time(), rng=self.rng)
                log.debug(
                    "%s: attempt %d on %s: %s; retry in %.2fs",
                    prompt.id,
                    attempt,
                    url,
                    verdict.reason,
                    wait,
                )
                await asyncio.sleep(wait)
        return self.fail(prompt, verdict, status, self.args.max_attempts, gave_up=True)

    def fail(self, prompt, verdict, status, attempts, gave_up=False) -> None:
        reason = (
            f"gave up after {attempts} attempts; last: {verdict.reason}"
            if gave_up
            else verdict.reason
        )
        self.store.append_failed(
            make_failure(prompt, reason, status=status, detail=verdict.detail, attempts=attempts)
        )
        self.stats.failed += 1
        log.warning("%s/%s failed: %s %s", prompt.dataset, prompt.id, reason, verdict.detail)
        return None

    async def conversation(self, session, prompt: Prompt, home: int) -> None:
        conversation: list[dict] = []
        usage: Counter = Counter()
        servers: list[str] = []
        finish = None
        while (turns := next_turns(prompt, conversation)) is not None:
            conversation.extend(turns)
            got = await self.request(session, prompt, conversation, home)
            if got is None:
                return
            message, u, turn_finish, url = got
            conversation.append(
                {
                    "role": "assistant",
                    "content": message.get("content") or "",
                    "reasoning": message.get("reasoning") or "",
                }
            )
            _usage_add(
                usage, int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0), u
            )
            self.stats.completion_tokens += int(u.get("completion_tokens") or 0)
            if turn_finish == "length":
                self.stats.length += 1
            finish = "length" if "length" in (finish, turn_finish) else turn_finish
            if url not in servers:
                servers.append(url)
        record = make_record(
            prompt, conversation, self.model, "local " + ", ".join(servers), finish, dict(usage)
        )
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

            async def worker(home: int) -> None:
                while not queue.empty():
                    await self.conversation(session, queue.get_nowait(), home)

            async def progress() -> None:
                while True:
                    await asyncio.sleep(LOG_EVERY_S)
                    log.info("%s", self.stats.line())

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
    import torch

    from datagen.generate import Generator
    from eagle3.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(
        args.target, dtype=args.model_dtype, device=args.device, device_map=args.device_map
    )
    if target.tokenizer is None:
        raise Eagle3Error(f"target {args.target} has no tokenizer; pass a model directory with one")
    if args.chat_template is None and not getattr(target.tokenizer, "chat_template", None):
        raise Eagle3Error(
            f"target {args.target}'s tokenizer has no chat template; pass --chat-template FILE"
        )
    gen = Generator(
        target.model,
        target.tokenizer,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size,
        chat_template=args.chat_template,
        template_kwargs=args.template_kwargs,
    )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model_name = args.model or target.name
    chunk = args.batch_size * CHUNK_BATCHES
    last_log = time.monotonic()
    log.info("%d prompts, in-process on %s, batch %d", len(prompts), target.name, args.batch_size)
    for start in range(0, len(prompts), chunk):
        group = prompts[start : start + chunk]
        convs: list[list[dict]] = [[] for _ in group]
        usage = [Counter() for _ in group]
        finish: list[str | None] = [None] * len(group)
        alive = list(range(len(group)))
        while alive:  # one assistant turn for every conversation still open
            ready = []
            for i in alive:
                turns = next_turns(group[i], convs[i])
                if turns is not None:
                    convs[i].extend(turns)
                    ready.append(i)
            prompt_ids = []
            for i in list(ready):
                try:
                    ids = gen.prompt(convs[i])
                except RenderError as err:  # one bad prompt: fail it, keep the rest
                    store.append_failed(make_failure(group[i], err.reason, detail=str(err)))
                    stats.failed += 1
                    ready.remove(i)
                    continue
                if args.max_prompt_tokens and len(ids) > args.max_prompt_tokens:
                    # One 6k-token ShareGPT prompt makes its whole batch crawl on a CPU.
                    store.append_failed(
                        make_failure(group[i], "prompt too long", tokens=len(ids),
                                     max_prompt_tokens=args.max_prompt_tokens)
                    )  # fmt: skip
                    stats.too_long += 1
                    ready.remove(i)
                    continue
                prompt_ids.append(ids)
            answers = gen.generate_ids(prompt_ids) if prompt_ids else []
            for i, turn in zip(ready, answers):
                convs[i].append(
                    {"role": "assistant", "content": turn.content, "reasoning": turn.reasoning}
                )
                _usage_add(usage[i], turn.prompt_tokens, turn.completion_tokens, {})
                stats.completion_tokens += turn.completion_tokens
                if turn.finish_reason == "length":
                    stats.length += 1
                finish[i] = (
                    "length" if "length" in (finish[i], turn.finish_reason) else turn.finish_reason
                )
            alive = ready
            if time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                log.info("%s", stats.line())
        for i, prompt in enumerate(group):
            if (
                any(m["role"] == "assistant" for m in convs[i])
                and next_turns(prompt, convs[i]) is None
            ):
                record = make_record(
                    prompt, convs[i], model_name, "transformers", finish[i], dict(usage[i])
                )
                if store.append(prompt.dataset, record):
                    stats.done += 1


# ----------------------------------------------------------------------------- main


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
        loaded = load_prompts(source, limit=args.limit)
        log.info("%s", loaded.report.summary())
        prompts.extend(loaded)
    prompts = dedupe(prompts)
    if args.max_turns:
        prompts = [first_user_turns(p, args.max_turns) for p in prompts]
    if args.split != "all":
        train, evals = split_prompts(prompts, args.eval_fraction, seed=args.split_seed)
        prompts = train if args.split == "train" else evals
    return prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
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
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--split-seed", type=int, default=0)
    backend = p.add_mutually_exclusive_group(required=True)
    backend.add_argument(
        "--base-url", nargs="+", help="OpenAI-compatible server URL(s), e.g. http://host:30000"
    )
    backend.add_argument("--target", help="in-process: registry name, HF model directory or .gguf")
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
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="servers: requests in flight per server",
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
    args = p.parse_args(argv)
    args.chat_template = load_chat_template(args.chat_template)
    return args


def run(args) -> int:
    prompts = select_prompts(args)
    stats = Stats()
    with ResultStore(args.out) as store:
        ids = {p.id for p in prompts}
        done = store.done_ids() & ids
        failed = set() if args.retry_failed else (store.failed_ids() & ids) - done
        todo = [p for p in prompts if p.id not in done and p.id not in failed]
        log.info(
            "%d prompts, %d already done, %d failed before (skipped; --retry-failed to retry), "
            "%d to generate",
            len(prompts),
            len(done),
            len(failed),
            len(todo),
        )
        if todo:
            if args.base_url:
                asyncio.run(ServerPool(args, store, stats).run(todo))
            else:
                run_inprocess(args, todo, store, stats)
    print(stats.line())
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        return run(args)
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
