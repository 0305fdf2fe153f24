"""Acceptance length of drafters against the target, by real speculative decoding.

    python -m eagle3.evaluate --target smollm2-135m-q4 --draft runs/x/final --draft prompt-lookup \\
        --draft none --bench mt_bench,humaneval,gsm8k=PATH/gsm8k/test.jsonl \\
        [--mode chain|tree] [--steps 7] [--topk 10 --total-tokens 60 --depth 8] \\
        [--temperature 0] [--max-new-tokens 256] [--limit 20] [--json out.json] [--wandb]

For every prompt (every user turn of it: MT-bench's second turn is conditioned on the
target's own first answer, from plain decoding) the target first decodes alone (plain tok/s),
then once per drafter speculatively (spec tok/s, tau, alpha_i), in the same process, so the
speedup is a ratio measured in one run. Each row's tau and speedup come with a 95% interval
bootstrapped over prompts (`bootstrap_ci`; all turns of a prompt move together), and
`per_prompt` in the JSON holds every prompt's counts. `--draft` takes a checkpoint directory
(checked against the target first), `prompt-lookup` (n-gram lookup, no model) or `none` (the
speculative loop with no drafts: tau = 1, shows the loop's own overhead).

`--engine vllm` adds the serving engine's rows (drafter "x/final [vllm]"): a managed vLLM
server without a drafter answers every turn (plain tok/s; its answers condition later
turns), then one with each checkpoint drafter (method eagle3, num_speculative_tokens = the
chain steps) decodes the same token-id prompts at the same temperature; tau and alpha_i come
from vLLM's spec-decode counters over that window (alpha_i conditional, as in-house; one
window over all requests: no per-prompt counts, so no interval). Rows "[vllm]" run one
request at a time, rows "[vllm xN]" N at a time (`--engine-batch`), each against plain vLLM
run the same way. Engine flags: eagle3.serving.add_engine_args.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.cli import HelpFormatter
from eagle3.data.chat import next_turns, prompt_ids
from eagle3.data.decontaminate import parse_benches
from eagle3.data.prompts import load_prompts
from eagle3.errors import Eagle3Error
from eagle3.prompt_lookup import PromptLookupDrafter
from eagle3.serving import SpecDecodeMetrics, add_engine_args
from eagle3.speculative import (
    AcceptanceStats,
    DecodeConfig,
    EagleDrafter,
    Generation,
    SpeculativeDecoder,
    plain_generate,
)
from eagle3.target import eos_token_ids, load_target
from eagle3.tracking import wandb_mode

log = logging.getLogger("eagle3.evaluate")

EVAL_FILE = "eagle3_eval.json"  # the results file also stored with a W&B run
WARMUP_TOKENS = 8
BOOTSTRAP_RESAMPLES = 2000  # of the prompts, for the 95% intervals
BOOTSTRAP_SEED = 0
# vLLM's /metrics counters are one window over every request of a pass: no per-prompt counts
ENGINE_CI_NOTE = "none: vLLM's spec-decode counters are one window over all requests"
NO_ENGINE_CI = "n/a (one vLLM window)"


# -- drafters -----------------------------------------------------------------------------------
def drafter_name(spec: str) -> str:
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
    embed = tuple(target.embed_weight.shape)
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


def load_drafter(spec: str, target, cfg: DecodeConfig):
    """-> a Drafter (None for 'none')."""
    if spec == "none":
        return None
    if spec == "prompt-lookup":
        return PromptLookupDrafter(num_tokens=cfg.max_depth)
    from eagle3.checkpoint import load_config, load_draft

    if not Path(spec).is_dir():
        raise Eagle3Error(
            f"--draft {spec}: no such checkpoint directory (or use prompt-lookup / none)"
        )
    draft_cfg, raw = load_config(spec)
    check_compatible(draft_cfg, raw, target, spec)
    draft = load_draft(spec)
    draft.set_embeddings(target.embed_weight.detach().cpu())
    dtype = target.model.dtype if target.device.type == "cuda" else torch.float32
    draft = draft.to(device=target.device, dtype=dtype)
    return EagleDrafter(draft, cfg, name=drafter_name(spec))


# -- the measurement -----------------------------------------------------------------------------
@dataclass
class PromptCount:
    """One prompt's totals over all its turns."""

    id: str
    accepted: int = 0  # accepted draft tokens
    steps: int = 0  # verification steps (plain decoding: one per token)
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class Tally:
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    tokens: int = 0
    seconds: float = 0.0
    turns: int = 0
    per_prompt: list[PromptCount] = field(default_factory=list)  # in prompt order

    @property
    def prompts(self) -> int:
        return len(self.per_prompt)

    def start(self, prompt_id: str) -> None:
        """The turns added from now on are this prompt's."""
        self.per_prompt.append(PromptCount(prompt_id))

    def add(self, gen: Generation) -> None:
        self.stats.merge(gen.stats)
        self.tokens += len(gen.tokens)
        self.seconds += gen.seconds
        self.turns += 1
        mine = self.per_prompt[-1]
        mine.accepted += gen.stats.accepted_total
        mine.steps += gen.stats.steps
        mine.tokens += len(gen.tokens)
        mine.seconds += gen.seconds


def run_benchmark(
    target,
    drafters: dict[str, Any],
    prompts: list,
    cfg: DecodeConfig,
    seed: int,
) -> tuple[Tally, dict[str, Tally]]:
    """-> (plain tally, drafter name -> speculative tally) over every turn of every prompt."""
    eos = eos_token_ids(target)
    decoders = {n: SpeculativeDecoder(target, d, cfg, eos_ids=eos) for n, d in drafters.items()}
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
            line = [f"{prompt.dataset}/{prompt.id} turn {t + 1}: plain {_rate(out)}"]
            for name, dec in decoders.items():
                gen = torch.Generator().manual_seed(seed + 1000 * i + t)
                res = dec.generate(ids, gen)
                spec[name].add(res)
                line.append(f"{name} tau {res.stats.tau:.2f} {_rate(res)}")
            log.info("; ".join(line))
            answer = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": answer})
            t += 1
    return plain, spec


def _rate(gen: Generation) -> str:
    return f"{len(gen.tokens) / gen.seconds:.1f} tok/s" if gen.seconds > 0 else "- tok/s"


def warm_up(target, drafters: dict[str, Any], prompts: list, cfg: DecodeConfig) -> None:
    """One short untimed run of each decoder, so no timing pays for first-call setup."""
    ids = prompt_ids(target.tokenizer, next_turns(prompts[0], []))
    short = DecodeConfig(**{**asdict(cfg), "max_new_tokens": WARMUP_TOKENS})
    plain_generate(target, ids, WARMUP_TOKENS, eos_ids=set())
    for drafter in drafters.values():  # drafters read only the tree shape from their config
        SpeculativeDecoder(target, drafter, short, eos_ids=set()).generate(ids)


def bootstrap_ci(
    columns: Sequence[Sequence[float]],
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = 0.95,
) -> list[float] | None:
    """Percentile bootstrap interval of a statistic of column sums, resampling prompts.

    ``columns[j]`` is prompt j's row of counts; each of ``resamples`` resamples draws as many
    prompts with replacement (seeded: the same inputs give the same interval), sums their rows
    into a [resamples, c] array and ``statistic`` maps it to [resamples] values (e.g.
    :func:`ratio_of_sums`: tau = sum(accepted + steps) / sum(steps)); the interval is their
    (1 - level) / 2 and (1 + level) / 2 quantiles. Resamples where the statistic is undefined
    (a zero denominator) are left out. None under 2 prompts, where a bootstrap says nothing.
    It measures how much the prompts drawn move the number, not timing noise between runs, and
    with few prompts (under ~20) a percentile interval runs narrow.
    """
    rows = np.asarray(columns, dtype=np.float64)  # [n, c]
    if len(rows) < 2:
        return None
    n = len(rows)
    # how often each prompt is drawn in each resample: [resamples, n], rows summing to n
    draws = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(draws @ rows)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def ratio_of_sums(sums: np.ndarray) -> np.ndarray:
    """[R, 2] sums (numerator, denominator) -> [R] ratios."""
    return sums[:, 0] / sums[:, 1]


def speedup_of_sums(sums: np.ndarray) -> np.ndarray:
    """[R, 4] sums (spec tokens, spec s, plain tokens, plain s) -> [R] spec tok/s / plain tok/s."""
    return (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])


def result_row(drafter: str, bench: str, plain: Tally, spec: Tally, k: int) -> dict[str, Any]:
    plain_tps = plain.tokens / plain.seconds if plain.seconds else 0.0
    spec_tps = spec.tokens / spec.seconds if spec.seconds else 0.0
    pairs = list(zip(spec.per_prompt, plain.per_prompt))
    return {
        "drafter": drafter,
        "bench": bench,
        "tau": spec.stats.tau,
        "tau_ci95": bootstrap_ci(
            [[s.accepted + s.steps, s.steps] for s, _ in pairs], ratio_of_sums
        ),
        "alpha": spec.stats.alpha(k) if drafter != "none" else [],
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps else 0.0,
        "speedup_ci95": bootstrap_ci(
            [[s.tokens, s.seconds, p.tokens, p.seconds] for s, p in pairs], speedup_of_sums
        ),
        "prompts": spec.prompts,
        "turns": spec.turns,
        "tokens": spec.tokens,
        "plain_tokens": plain.tokens,
        "verify_steps": spec.stats.steps,
        "spec_seconds": spec.seconds,
        "plain_seconds": plain.seconds,
        "per_prompt": [
            {
                "id": s.id,
                "tau": (s.accepted + s.steps) / s.steps if s.steps else 0.0,
                "accepted": s.accepted,
                "steps": s.steps,
                "tokens": s.tokens,
                "seconds": s.seconds,
                "plain_tokens": p.tokens,
                "plain_seconds": p.seconds,
            }
            for s, p in pairs
        ],
    }


def _interval(r: dict[str, Any], key: str) -> str:
    """A row's '[lo, hi]' cell; engine rows say why they have none; '–' in older results."""
    if r.get(key):
        lo, hi = r[key]
        return f"[{lo:.2f}, {hi:.2f}]"
    return NO_ENGINE_CI if "engine" in r else "–"


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per drafter x benchmark; 95% intervals are bootstrapped over prompts."""
    k = max((len(r["alpha"]) for r in results), default=0)
    head = ["drafter", "bench", "τ", "τ 95% CI", *[f"α{i + 1}" for i in range(k)]]
    head += ["spec tok/s", "plain tok/s", "speedup", "speedup 95% CI", "prompts", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        alphas = [r["alpha"][i] if i < len(r["alpha"]) else None for i in range(k)]
        cells = [r["drafter"], r["bench"], f"{r['tau']:.2f}", _interval(r, "tau_ci95")]
        cells += ["–" if a is None else f"{a:.2f}" for a in alphas]
        cells += [
            f"{r['spec_tokens_per_s']:.1f}",
            f"{r['plain_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            _interval(r, "speedup_ci95"),
            str(r["prompts"]),
            str(r["tokens"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the serving engine ----------------------------------------------------------------------------
@dataclass
class EngineRun:
    """One pass of a server over turns: tokens, seconds and the spec-decode window."""

    tokens: int = 0
    seconds: float = 0.0
    window: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def engine_alpha(window: SpecDecodeMetrics, k: int) -> list[float | None]:
    """vLLM's per-position counts (accepted at i / drafts: unconditional) -> alpha_i as
    AcceptanceStats reports it: accepted at depth i / steps that accepted depths 1..i-1."""
    counts = [window.num_drafts, *window.accepted_per_position]
    counts += [0.0] * (k + 1 - len(counts))
    return [counts[i + 1] / counts[i] if counts[i] else None for i in range(k)]


def engine_generate(server, ids: list[int], cfg: DecodeConfig, eos: list[int]) -> tuple[int, str]:
    """One completion from token ids -> (new tokens, text)."""
    reply = server.complete(
        ids, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=eos
    )
    choice = reply["choices"][0]
    return int(reply["usage"]["completion_tokens"]), choice.get("text") or ""


def engine_pass(server, turns: list[list[int]], cfg, eos, concurrency: int) -> EngineRun:
    """Every turn through `server`, `concurrency` in flight -> tokens, wall seconds, window."""
    from concurrent.futures import ThreadPoolExecutor

    before = server.spec_decode_metrics()
    t0 = time.perf_counter()
    if concurrency <= 1:
        tokens = sum(engine_generate(server, ids, cfg, eos)[0] for ids in turns)
    else:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            tokens = sum(
                n for n, _ in pool.map(lambda i: engine_generate(server, i, cfg, eos), turns)
            )
    seconds = time.perf_counter() - t0
    return EngineRun(tokens, seconds, server.spec_decode_metrics() - before)


def engine_plain_turns(server, target, benches, cfg, eos) -> dict[str, list[list[int]]]:
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
    return turns


def engine_rows(args, target, benches, names: dict[str, str], cfg: DecodeConfig) -> list[dict]:
    """Rows "[vllm]" (batch 1) and "[vllm xN]" of every checkpoint drafter on every benchmark,
    next to plain vLLM run the same way; at most one server runs at a time."""
    from eagle3.serving import managed_engine
    from eagle3.target import resolve

    hf_dir = resolve(args.target)[1]
    eos = sorted(eos_token_ids(target))
    k, batch = cfg.max_depth, args.engine_batch
    drafters = {n: s for n, s in names.items() if s not in ("none", "prompt-lookup")}
    if not drafters:
        log.warning(
            "--engine: no checkpoint drafter to serve (prompt-lookup/none are in-house only)"
        )
        return []

    def warm(server, ids):  # first requests pay for graph capture / compilation
        server.complete(ids, max_tokens=WARMUP_TOKENS, stop_token_ids=eos)

    plain: dict[tuple[str, int], EngineRun] = {}
    with managed_engine(args, hf_dir, served_model_name=target.name) as server:
        log.info("vLLM plain server up in %.0f s, %s (log %s)", server.startup_seconds,
                 server.serving.describe(), server.log_path)  # fmt: skip
        turns = engine_plain_turns(server, target, benches, cfg, eos)
        warm(server, next(iter(turns.values()))[0])
        for bench, ids in turns.items():
            for n in (1, batch):
                plain[bench, n] = engine_pass(server, ids, cfg, eos, n)
    rows = []
    for name, spec in drafters.items():
        with managed_engine(
            args, hf_dir, served_model_name=target.name, drafter=spec, num_speculative_tokens=k
        ) as server:
            log.info("vLLM server with %s up in %.0f s, %s (log %s)", name,
                     server.startup_seconds, server.serving.describe(), server.log_path)  # fmt: skip
            warm(server, next(iter(turns.values()))[0])
            for bench, ids in turns.items():
                for n in (1, batch):
                    run_ = engine_pass(server, ids, cfg, eos, n)
                    base = plain[bench, n]
                    rows.append(
                        {
                            "drafter": f"{name} [vllm]" if n == 1 else f"{name} [vllm x{n}]",
                            "bench": bench,
                            "tau": run_.window.tau,
                            "tau_ci95": None,
                            "ci_note": ENGINE_CI_NOTE,
                            "alpha": engine_alpha(run_.window, k),
                            "spec_tokens_per_s": run_.rate,
                            "plain_tokens_per_s": base.rate,
                            "speedup": run_.rate / base.rate if base.rate else 0.0,
                            "speedup_ci95": None,
                            "prompts": len(dict(benches)[bench]),
                            "turns": len(ids),
                            "tokens": run_.tokens,
                            "plain_tokens": base.tokens,
                            "verify_steps": run_.window.num_drafts,
                            "spec_seconds": run_.seconds,
                            "plain_seconds": base.seconds,
                            "per_prompt": None,
                            "engine": {"name": "vllm", "concurrency": n, **run_.window.as_dict()},
                        }
                    )
    return rows


# -- W&B ------------------------------------------------------------------------------------------
def _training_run(ckpt: str) -> tuple[Path | None, dict[str, Any]]:
    """The training out_dir above a checkpoint (it holds `wandb_run_id`) and its wandb config."""
    path = Path(ckpt).resolve()
    for parent in [path, *list(path.parents)[:3]]:
        if (parent / "wandb_run_id").is_file():
            config: dict[str, Any] = {}
            if (parent / "config.yaml").is_file():
                import yaml

                config = (yaml.safe_load((parent / "config.yaml").read_text()) or {}).get(
                    "wandb"
                ) or {}
            config["id"] = (parent / "wandb_run_id").read_text().strip()
            return parent, config
    return None, {}


def log_wandb(report: dict[str, Any], specs: dict[str, str], args: argparse.Namespace) -> None:
    """Each drafter's numbers go to its training run (resumed), else to a new eval run in
    the same group; baselines join the group of the first trained drafter."""
    mode = wandb_mode()
    if mode == "disabled":
        log.info("W&B is disabled (WANDB_MODE=disabled): nothing logged to W&B")
        return
    import wandb

    runs: dict[str, tuple[Path | None, dict[str, Any]]] = {
        n: _training_run(s) for n, s in specs.items() if s not in ("none", "prompt-lookup")
    }
    first = next((cfg for _, cfg in runs.values() if cfg), {})
    for name in specs:
        out_dir, cfg = runs.get(name, (None, {}))
        rows = [r for r in report["results"] if r["drafter"] == name]
        kwargs: dict[str, Any] = dict(
            project=cfg.get("project") or args.wandb_project,
            group=cfg.get("group") or first.get("group") or args.wandb_group,
            mode=mode,
            dir=str(out_dir or Path(args.json or ".").resolve().parent),
            settings=wandb.Settings(silent=True),
        )
        if cfg.get("id"):
            kwargs.update(id=cfg["id"], resume="allow")
        else:
            kwargs.update(job_type="eval", name=f"eval-{name}", config={"eval": report["config"]})
        run = wandb.init(**kwargs)
        try:
            for r in rows:
                prefix = f"eval/{r['bench']}"
                run.summary[f"{prefix}/tau"] = r["tau"]
                for side, value in zip(("lo", "hi"), r.get("tau_ci95") or ()):
                    run.summary[f"{prefix}/tau_ci95_{side}"] = value
                run.summary[f"{prefix}/speedup"] = r["speedup"]
                run.summary[f"{prefix}/spec_tokens_per_s"] = r["spec_tokens_per_s"]
                run.summary[f"{prefix}/plain_tokens_per_s"] = r["plain_tokens_per_s"]
                for i, a in enumerate(r["alpha"]):
                    if a is not None:
                        run.summary[f"{prefix}/alpha_{i + 1}"] = a
            columns = [
                "drafter",
                "bench",
                "tau",
                "speedup",
                "spec_tokens_per_s",
                "plain_tokens_per_s",
                "prompts",
                "tokens",
            ]
            run.log(
                {
                    "eval/results": wandb.Table(
                        columns=columns, data=[[r[c] for c in columns] for r in rows]
                    )
                }
            )
            if run.dir and Path(run.dir).is_dir():
                Path(run.dir, EVAL_FILE).write_text(
                    json.dumps({**report, "results": rows}, indent=2)
                )
        finally:
            run.finish()


# -- CLI -------------------------------------------------------------------------------------------
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m eagle3.evaluate",
        description="Acceptance length (tau) and speedup of drafters by real speculative decoding.",
    )
    p.add_argument("--target", required=True, help="registry name, HF dir or .gguf")
    p.add_argument(
        "--draft",
        action="append",
        required=True,
        help="checkpoint dir | prompt-lookup | none (repeatable)",
    )
    p.add_argument(
        "--bench",
        default="mt_bench,humaneval",
        help="mt_bench,humaneval,NAME=FILE.jsonl,FILE.jsonl",
    )
    add_decode_args(p)
    p.add_argument("--limit", type=int, default=None, help="prompts per benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--wandb", action="store_true", help="log to W&B (offline without WANDB_API_KEY)"
    )
    p.add_argument("--wandb-project", default="eagle3")
    p.add_argument("--wandb-group", default=None)
    add_engine_args(p)
    p.add_argument(
        "--engine-batch", type=int, default=8, help="engine: concurrent requests of the x-N rows"
    )
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="engine: only the engine's rows (skip in-house decoding, e.g. of a big target)",
    )
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine_only and not args.engine:
        raise Eagle3Error("--engine-only needs --engine vllm (it keeps only the engine's rows)")
    cfg = decode_config(args)
    benches = parse_benches(args.bench)
    specs = [s.strip() for item in args.draft for s in item.split(",") if s.strip()]
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    if target.tokenizer is None:
        raise Eagle3Error(
            f"target {args.target} has no tokenizer; the benchmarks need its chat template"
        )
    names: dict[str, str] = {}
    for spec in specs:  # every checkpoint is checked before any decoding starts
        name, n = drafter_name(spec), 1
        while name in names:
            n += 1
            name = f"{drafter_name(spec)}#{n}"
        names[name] = spec
    drafters = {name: load_drafter(spec, target, cfg) for name, spec in names.items()}
    report: dict[str, Any] = {
        "target": target.name,
        "config": {**asdict(cfg), "seed": args.seed, "limit": args.limit},
        "device": str(target.device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "drafters": names,
        "results": [],
    }
    warmed = False
    loaded = []
    for bench, source in benches:
        prompts = load_prompts(source, dataset=bench, limit=args.limit)
        if not prompts:
            raise Eagle3Error(f"benchmark {bench} ({source}) has no prompts")
        loaded.append((bench, prompts))
    for bench, prompts in [] if args.engine_only else loaded:
        if not warmed:
            warm_up(target, drafters, prompts, cfg)
            warmed = True
        plain, spec = run_benchmark(target, drafters, prompts, cfg, args.seed)
        for name, tally in spec.items():
            report["results"].append(result_row(name, bench, plain, tally, cfg.max_depth))
    if args.engine:
        report["results"] += engine_rows(args, target, loaded, names, cfg)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        report = run(args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.wandb:
            try:
                log_wandb(report, report["drafters"], args)
            except Exception as err:  # W&B is a copy of the results: it must never cost them
                where = f"{args.json} and " if args.json else ""
                log.warning(
                    "W&B logging failed (%s: %s); the results are in %sthe table below",
                    type(err).__name__,
                    err,
                    where,
                )
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(report["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
