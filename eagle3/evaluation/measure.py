"""Measuring drafters against the target by real speculative decoding: what `eagle3.evaluate`
counts (the rows and their statistics are `report` and `statistics` beside it).

For every prompt (every user turn of it: MT-bench's second turn is conditioned on the
target's own first answer, from plain decoding) the target first decodes alone (plain tok/s),
then once per drafter speculatively (spec tok/s, tau, alpha_i), in the same process, so the
speedup is a ratio measured in one run (:func:`run_benchmark` into a :class:`Tally` per
decoder, each prompt's counts kept apart for the intervals). A drafter spec is a checkpoint
directory (checked against the target first), `tree:DIR` (that checkpoint drafting an EAGLE-2
dynamic tree of the --topk/--depth/--total-tokens shape, whatever --mode says: its row is
"x/final [tree]", so one run measures a drafter's chain and tree against the same plain
decoding), `prompt-lookup` (n-gram lookup, no model) or `none` (the speculative loop with no
drafts: tau = 1, shows the loop's own overhead). Every turn's counts are kept apart too, for
rows per turn (MT-bench's second turn follows the target's own first answer).

The serving engine (:func:`engine_runs`): a managed vLLM server without a drafter answers every
turn (plain tok/s; its answers condition later turns), then one with each checkpoint drafter
(method eagle3, num_speculative_tokens = the chain steps) decodes the same token-id prompts at
the same temperature; tau and alpha_i come from vLLM's spec-decode counters over that window
(one window over all requests; each response's own per-step counts, below, give the
per-prompt counts). Each pass runs one request at a time and `--engine-batch` N at a time
(`--engine-passes`: both, or one of them), against plain vLLM run the same way. Engine flags:
eagle3.engine.server.add_engine_args.

Acceptance by context position: every in-house step is logged with its context (the tokens
before its first drafted token; `Tally.prompt_stats`, per prompt). The drafter servers run with
`--per-request-spec-decode-metrics detailed`, so each response carries its steps' accepted and
drafted counts in order (:func:`request_steps` rebuilds their contexts): the same steps as the
counters' window, per prompt and per step.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import load_config, load_draft
from eagle3.data.chat import next_turns, prompt_ids
from eagle3.data.prompts import user_turns
from eagle3.decoding.acceptance import AcceptanceStats
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import Generation, SpeculativeDecoder, plain_generate
from eagle3.decoding.eagle import EagleDrafter
from eagle3.decoding.prompt_lookup import PromptLookupDrafter
from eagle3.engine.metrics import SpecDecodeMetrics
from eagle3.engine.server import EngineSettings, managed_engine
from eagle3.engine.sizing import engine_context, target_context
from eagle3.errors import Eagle3Error
from eagle3.methods import method_of
from eagle3.progress import Progress
from eagle3.targets import eos_token_ids

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8
TREE = "tree:"  # drafter spec prefix: the checkpoint after it drafts a dynamic tree


# -- decoding flags -------------------------------------------------------------------------------
def add_decode_args(
    p: argparse.ArgumentParser, steps: int = 7, max_new_tokens: int = 256
) -> argparse.ArgumentParser:
    """The decoding flags (chain/tree shape, temperature, length); `decode_config` reads them."""
    p.add_argument("--mode", choices=("chain", "tree"), default="chain")
    p.add_argument("--steps", type=int, default=steps, help="chain: draft tokens per step")
    p.add_argument("--topk", type=int, default=10, help="tree: branching")
    p.add_argument(
        "--total-tokens", type=int, default=60, help="tree: tokens verified per step, root included"
    )
    p.add_argument("--depth", type=int, default=8, help="tree: max draft depth")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    return p


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        mode=args.mode,
        steps=args.steps,
        topk=args.topk,
        total_tokens=args.total_tokens,
        depth=args.depth,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )


# -- drafters -----------------------------------------------------------------------------------
def drafter_name(spec: str) -> str:
    if spec.startswith(TREE):
        return f"{drafter_name(spec[len(TREE) :])} [tree]"
    if spec in ("none", "prompt-lookup"):
        return spec
    path = Path(spec).resolve()
    if path.name in ("final", "draft") or path.name.startswith("step-"):
        return f"{path.parent.name}/{path.name}"  # runs/x/final -> x/final
    return path.name


def check_compatible(cfg, raw: dict[str, Any], target, ckpt: str) -> None:
    """Refuse a drafter trained for another target, in one line naming every mismatch."""
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab {cfg.vocab_size} vs the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {cfg.target_hidden_size} vs {target.hidden_size}")
    # a Target's embedding matrix; a TargetFiles (no weights) has the config's sizes
    weight = getattr(target, "embed_weight", None)
    embed = tuple(weight.shape) if weight is not None else (target.vocab_size, target.hidden_size)
    if (cfg.vocab_size, cfg.hidden_size) != embed:
        problems.append(f"embedding shape {(cfg.vocab_size, cfg.hidden_size)} vs {embed}")
    # other aux ids than the target's default are fine (the decoder captures the drafter's
    # own layers); ids past the target's last layer are not
    bad = [i for i in cfg.aux_layer_ids if not 0 <= int(i) < target.num_layers]
    if bad:
        problems.append(
            f"aux layers {list(cfg.aux_layer_ids)} outside the target's {target.num_layers} layers"
        )
    if problems:
        trained_for = (raw.get("extra_config") or {}).get("target")
        hint = f" (it was trained for {trained_for})" if trained_for else ""
        raise Eagle3Error(
            f"drafter {ckpt} does not fit target {target.name}{hint}: {'; '.join(problems)}; "
            "evaluate it with the target it was trained for"
        )


def check_drafter(spec: str, target) -> None:
    """Refuse a checkpoint directory that is missing or made for another target (one line);
    nothing is loaded but its config."""
    if not Path(spec).is_dir():
        raise Eagle3Error(
            f"--draft {spec}: no such checkpoint directory (or use prompt-lookup / none)"
        )
    draft_cfg, raw = load_config(spec, target_layers=target.num_layers)
    check_compatible(draft_cfg, raw, target, spec)


def load_drafter(spec: str, target, cfg: DecodeConfig):
    """-> a Drafter (None for 'none'); `tree:DIR` drafts a tree of `cfg`'s tree shape."""
    if spec.startswith(TREE):
        if spec[len(TREE) :] in ("none", "prompt-lookup"):
            raise Eagle3Error(f"--draft {spec}: tree: takes a checkpoint directory")
        return load_drafter(spec[len(TREE) :], target, replace(cfg, mode="tree"))
    if spec == "none":
        return None
    if spec == "prompt-lookup":
        return PromptLookupDrafter(num_tokens=cfg.max_depth)
    check_drafter(spec, target)
    dtype = target.model.dtype if target.device.type == "cuda" else torch.float32
    # a published layout too; the target's embeddings, or the drafter's own where they differ
    # (what vLLM serves from the same directory), copied after the cast: unrounded
    draft = load_draft(
        spec,
        embed_weight=target.embed_weight.detach(),
        device=target.device,
        dtype=dtype,
        target_layers=target.num_layers,
    )
    return method_of(draft.config).drafter(draft, cfg, name=drafter_name(spec))


# -- the in-house measurement ---------------------------------------------------------------------
@dataclass
class TurnCount:
    """One turn's counts."""

    accepted: int  # accepted draft tokens
    steps: int  # verification steps (plain decoding: one per token)
    tokens: int
    seconds: float


@dataclass
class PromptCount:
    """One prompt's totals over all its turns, and each turn's own."""

    id: str
    accepted: int = 0  # accepted draft tokens
    steps: int = 0  # verification steps (plain decoding: one per token)
    tokens: int = 0
    seconds: float = 0.0
    turns: list[TurnCount] = field(default_factory=list)


@dataclass
class Tally:
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    tokens: int = 0
    seconds: float = 0.0
    turns: int = 0
    per_prompt: list[PromptCount] = field(default_factory=list)  # in prompt order
    turn_stats: list[AcceptanceStats] = field(default_factory=list)  # [t]: every prompt's turn t
    # [j]: prompt j's steps over all its turns, each with its context (acceptance by position)
    prompt_stats: list[AcceptanceStats] = field(default_factory=list)

    @property
    def prompts(self) -> int:
        return len(self.per_prompt)

    def start(self, prompt_id: str) -> None:
        """The turns added from now on are this prompt's."""
        self.per_prompt.append(PromptCount(prompt_id))
        self.prompt_stats.append(AcceptanceStats())

    def add(self, gen: Generation) -> None:
        self.stats.merge(gen.stats)
        self.prompt_stats[-1].merge(gen.stats)
        self.tokens += len(gen.tokens)
        self.seconds += gen.seconds
        self.turns += 1
        mine = self.per_prompt[-1]
        mine.accepted += gen.stats.accepted_total
        mine.steps += gen.stats.steps
        mine.tokens += len(gen.tokens)
        mine.seconds += gen.seconds
        t = len(mine.turns)
        turn = TurnCount(gen.stats.accepted_total, gen.stats.steps, len(gen.tokens), gen.seconds)
        mine.turns.append(turn)
        if t == len(self.turn_stats):
            self.turn_stats.append(AcceptanceStats())
        self.turn_stats[t].merge(gen.stats)


def run_benchmark(
    target,
    drafters: dict[str, Any],
    prompts: list,
    cfg: DecodeConfig,
    seed: int,
    progress: Progress | None = None,
) -> tuple[Tally, dict[str, Tally]]:
    """-> (plain tally, drafter name -> speculative tally) over every turn of every prompt;
    `progress` counts each decode (a turn, plain or by one drafter: see `decodes`)."""
    eos = eos_token_ids(target)
    decoders = {
        n: SpeculativeDecoder(target, d, own_config(d, cfg), eos_ids=eos)
        for n, d in drafters.items()
    }
    plain = Tally()
    spec = {n: Tally() for n in drafters}
    for i, prompt in enumerate(prompts):
        for tally in (plain, *spec.values()):
            tally.start(prompt.id)
        conversation: list[dict] = []
        t = 0
        while (asked := next_turns(prompt, conversation)) is not None:
            conversation.extend(asked)
            ids = prompt_ids(target.tokenizer, conversation)
            gen = torch.Generator().manual_seed(seed + 1000 * i + t)
            out = plain_generate(
                target, ids, cfg.max_new_tokens, cfg.temperature, eos_ids=eos, generator=gen
            )
            plain.add(out)
            if progress is not None:
                progress.update(1)
            line = [f"{prompt.dataset}/{prompt.id} turn {t + 1}: plain {_rate(out)}"]
            for name, dec in decoders.items():
                gen = torch.Generator().manual_seed(seed + 1000 * i + t)
                res = dec.generate(ids, gen)
                spec[name].add(res)
                line.append(f"{name} tau {res.stats.tau:.2f} {_rate(res)}")
                if progress is not None:
                    progress.update(1)
            log.info("; ".join(line))
            answer = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": answer})
            t += 1
    return plain, spec


def decodes(benches: list[tuple[str, list]], drafters: int) -> int:
    """What `run_benchmark` decodes over every benchmark: each turn of each prompt plainly
    and once per drafter. The evaluation's progress total."""
    return sum(user_turns(p) for _, prompts in benches for p in prompts) * (1 + drafters)


def own_config(drafter, cfg: DecodeConfig) -> DecodeConfig:
    """A checkpoint drafter decodes in its own mode (`tree:DIR` next to chains)."""
    return drafter.cfg if isinstance(drafter, EagleDrafter) else cfg


def _rate(gen: Generation) -> str:
    return f"{len(gen.tokens) / gen.seconds:.1f} tok/s" if gen.seconds > 0 else "- tok/s"


def warm_up(target, drafters: dict[str, Any], prompts: list, cfg: DecodeConfig) -> None:
    """One short untimed run of each decoder, so no timing pays for first-call setup."""
    ids = prompt_ids(target.tokenizer, next_turns(prompts[0], []))
    short = DecodeConfig(**{**asdict(cfg), "max_new_tokens": WARMUP_TOKENS})
    plain_generate(target, ids, WARMUP_TOKENS, eos_ids=set())
    for drafter in drafters.values():  # drafters read only the tree shape from their config
        SpeculativeDecoder(target, drafter, short, eos_ids=set()).generate(ids)


# -- the serving engine ----------------------------------------------------------------------------
@dataclass
class EngineRun:
    """One pass of a server over turns: tokens, seconds and the spec-decode window."""

    tokens: int = 0
    seconds: float = 0.0
    window: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    # [r]: request r's verification steps with their contexts, from the response's per-step
    # counts (vLLM --per-request-spec-decode-metrics detailed); None where it had none
    requests: list[AcceptanceStats | None] = field(default_factory=list)
    unaccounted: int = 0  # new tokens of no reported step (steps without drafts): 0 normally

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class EngineResult:
    """One drafter's pass over one benchmark's turns, `concurrency` in flight, beside plain
    vLLM's pass over the same turns run the same way."""

    drafter: str
    bench: str
    concurrency: int
    spec: EngineRun
    plain: EngineRun
    prompts: int
    turns: int
    owners: list[int] = field(default_factory=list)  # [r]: the prompt request r is a turn of

    def prompt_stats(self) -> list[AcceptanceStats] | None:
        """Each prompt's verification steps over its turns, with their contexts; None when a
        request came back without per-step counts (an engine that does not report them)."""
        if not self.spec.requests or any(r is None for r in self.spec.requests):
            return None
        out = [AcceptanceStats() for _ in range(self.prompts)]
        for owner, stats in zip(self.owners, self.spec.requests):
            out[owner].merge(stats)
        return out


def engine_generate(server, ids: list[int], cfg: DecodeConfig, eos: list[int]) -> tuple[int, str]:
    """One completion from token ids -> (new tokens, text)."""
    reply = engine_reply(server, ids, cfg, eos)
    return int(reply["usage"]["completion_tokens"]), reply["choices"][0].get("text") or ""


def engine_reply(server, ids: list[int], cfg: DecodeConfig, eos: list[int]) -> dict[str, Any]:
    """One completion from token ids -> the response JSON."""
    return server.complete(
        ids, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=eos
    )


# vLLM >= 0.32: every response carries its own steps' accepted/drafted counts, in order
PER_STEP_ARGS = ("--per-request-spec-decode-metrics", "detailed")
# --engine-passes -> the concurrency of each pass, from --engine-batch N
ENGINE_PASSES = {
    "both": lambda n: (1, n),
    "single": lambda n: (1,),
    "batched": lambda n: (n,),
}


def request_steps(reply: dict[str, Any], prompt_len: int) -> tuple[AcceptanceStats | None, int]:
    """One vLLM response's verification steps -> (AcceptanceStats with each step's context,
    new tokens no step accounts for); (None, 0) when the response has no per-step counts.

    vLLM samples the first new token from the prompt's forward, then each step verifies the
    drafted tokens and adds accepted + 1, so step s's context is prompt_len + 1 + the tokens
    the steps before it added: the in-house decoder's context (prompt + generated, root
    included). A step is counted only where it had drafts (vLLM observes no other), so a step
    without drafts would shift the later contexts by one: the tokens left over count them.
    alpha as in-house: a step accepting a of d drafts offered depths 1..min(a + 1, d)."""
    spec = (reply.get("metrics") or {}).get("speculative_decoding") or {}
    accepted, drafted = spec.get("per_step_accepted"), spec.get("per_step_drafted")
    if accepted is None or drafted is None:
        return None, 0
    stats = AcceptanceStats()
    context = prompt_len + 1
    for a, d in zip(accepted, drafted):
        stats.record(int(a), min(int(a) + 1, int(d)), context)
        context += int(a) + 1
    produced = int(reply["usage"]["completion_tokens"])
    # the last step may add past a stop or max_tokens: only a shortfall is unaccounted
    return stats, max(produced - (context - prompt_len), 0)


def engine_pass(
    server, turns: list[list[int]], cfg, eos, concurrency: int, progress: Progress | None = None
) -> EngineRun:
    """Every turn through `server`, `concurrency` in flight -> tokens, wall seconds, window."""
    from concurrent.futures import ThreadPoolExecutor

    out = EngineRun()

    def counted(replies):  # each request's new tokens, counted as it comes back (in order)
        for ids, reply in zip(turns, replies):
            stats, left = request_steps(reply, len(ids))
            out.requests.append(stats)
            out.unaccounted += left
            if progress is not None:
                progress.update(1)
            yield int(reply["usage"]["completion_tokens"])

    before = server.spec_decode_metrics()
    t0 = time.perf_counter()
    if concurrency <= 1:
        out.tokens = sum(counted(engine_reply(server, ids, cfg, eos) for ids in turns))
    else:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            out.tokens = sum(counted(pool.map(lambda i: engine_reply(server, i, cfg, eos), turns)))
    out.seconds = time.perf_counter() - t0
    out.window = server.spec_decode_metrics() - before
    if out.unaccounted:
        log.warning("vLLM: %d new tokens came from steps without drafts; the contexts of the "
                    "steps after them are that much short", out.unaccounted)  # fmt: skip
    return out


def engine_plain_turns(
    server, target, benches, cfg, eos, progress: Progress | None = None
) -> dict[str, list[list[int]]]:
    """Each benchmark's turns as token ids, later turns conditioned on the server's answers."""
    turns: dict[str, list[list[int]]] = {}
    for bench, prompts in benches:
        out = turns.setdefault(bench, [])
        for prompt in prompts:
            conversation: list[dict] = []
            while (asked := next_turns(prompt, conversation)) is not None:
                conversation.extend(asked)
                ids = prompt_ids(target.tokenizer, conversation)
                out.append(ids)
                _, answer = engine_generate(server, ids, cfg, eos)
                conversation.append({"role": "assistant", "content": answer})
                if progress is not None:
                    progress.update(1)
    return turns


def engine_drafters(names: dict[str, str]) -> dict[str, str]:
    """The drafters an engine serves: checkpoints (vLLM has no token trees, and prompt-lookup
    and none are in-house only)."""
    return {
        n: s
        for n, s in names.items()
        if s not in ("none", "prompt-lookup") and not s.startswith(TREE)
    }


def engine_runs(
    engine: EngineSettings,
    model,
    target,
    benches,
    names: dict[str, str],
    cfg: DecodeConfig,
    levels: tuple[int, ...],
) -> list[EngineResult]:
    """Every checkpoint drafter on every benchmark, once at each concurrency of `levels` (1:
    one request at a time; N: --engine-batch in flight; --engine-passes picks them), next to
    plain vLLM run the same way; at most one server runs
    at a time, each started as `engine` says. `model`: the resolved target the servers serve;
    `target`: its tokenizer and generation config (a Target or a TargetFiles). Every server is
    told the context the benchmarks need (eagle3.engine.sizing); --engine-arg=--max-model-len=N
    overrides it."""
    eos = sorted(eos_token_ids(target))
    prompts = [prompt for _, bench_prompts in benches for prompt in bench_prompts]
    max_model_len = engine_context(
        target.tokenizer, prompts, cfg.max_new_tokens, target_context(model)
    )
    k = cfg.max_depth
    drafters = engine_drafters(names)
    if not drafters:
        log.warning(
            "--engine: no chain drafter to serve (prompt-lookup, none, tree:DIR are in-house only)"
        )
        return []

    def warm(server, ids):  # first requests pay for graph capture / compilation
        server.complete(ids, max_tokens=WARMUP_TOKENS, stop_token_ids=eos)

    # requests: the plain answers, then every turn once at each level by plain vLLM and by
    # each drafter; the servers' start-ups are in the time, as they are in the ETA
    turns_all = decodes(benches, 0)
    total = turns_all * (1 + len(levels) * (1 + len(drafters)))
    progress = Progress("evaluate [vllm]", total, "requests")
    plain: dict[tuple[str, int], EngineRun] = {}
    with managed_engine(
        engine, model, served_model_name=target.name, max_model_len=max_model_len
    ) as server:
        log.info("vLLM plain server up in %.0f s, %s (log %s)", server.startup_seconds,
                 server.serving.describe(), server.log_path)  # fmt: skip
        turns = engine_plain_turns(server, target, benches, cfg, eos, progress)
        warm(server, next(iter(turns.values()))[0])
        for bench, ids in turns.items():
            for n in levels:
                plain[bench, n] = engine_pass(server, ids, cfg, eos, n, progress)
    results = []
    for name, spec in drafters.items():
        with managed_engine(
            engine,
            model,
            served_model_name=target.name,
            drafter=spec,
            num_speculative_tokens=k,
            max_model_len=max_model_len,
            extra_args=PER_STEP_ARGS,  # acceptance by context position, from each response
        ) as server:
            log.info("vLLM server with %s up in %.0f s, %s (log %s)", name,
                     server.startup_seconds, server.serving.describe(), server.log_path)  # fmt: skip
            warm(server, next(iter(turns.values()))[0])
            for bench, ids in turns.items():
                for n in levels:
                    run_ = engine_pass(server, ids, cfg, eos, n, progress)
                    prompts = dict(benches)[bench]
                    owners = [j for j, p in enumerate(prompts) for _ in range(user_turns(p))]
                    results.append(
                        EngineResult(
                            name, bench, n, run_, plain[bench, n], len(prompts), len(ids), owners
                        )  # fmt: skip
                    )
    progress.close()
    return results
