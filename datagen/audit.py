"""Data fidelity audit: do a provider's responses come from the model we serve?

    python -m datagen.audit --target NAME_OR_PATH --data DIR_OR_FILES [--sample N] [--json OUT]

The provider rule of ``datagen.openrouter`` trusts what providers declare. A provider that
silently serves another quantization, kernel or revision produces responses from a different
distribution, and a drafter trained on them accepts poorly against the real target. The local
copy of the target is the referee: every sampled assistant turn is rendered with the same chat
template and loss mask as capture (``eagle3.data.chat.render_record``) and scored token by token:

- ``nll``: mean negative log-likelihood (nats/token) of the response tokens under the target;
- ``argmax``: fraction of tokens that are the target's greedy choice (~1 for a faithful provider
  at T=0, lower for anything else);
- ``out_top_p``: fraction of tokens outside the target's top-p (0.95) set. A faithful provider
  at T=0 has ~0, at T <= 1 (top_p <= 1) at most ~5%; a different model lands outside more often.

Records are grouped by ``provider`` (and by ``dataset``); per provider the table shows records,
tokens, mean NLL with a 95% bootstrap interval (resampling records, fixed seed), argmax
agreement and out_top_p. A provider is **flagged** when its mean NLL differs from that of the
pooled other providers by more than ``--threshold`` nats/token AND the two intervals do not
overlap. Flagging is done one provider at a time, worst first, and a flagged provider leaves the
pool, so that several bad providers cannot make a good one look like the outlier; when the
choice is ambiguous (e.g. two providers left), the one that fits the target worse (higher NLL)
is flagged, because the target's own outputs are the ones it finds most likely.

Exit status: 0 with the table; 1 with ``--fail-on-flag`` when a provider is flagged; 2 on bad
input (one line on stderr). ``--json OUT`` writes the tables and flags.

On the fly (``datagen.openrouter --audit-every N``): :class:`datagen.online_audit.OnlineAudit`
takes finished records as they arrive, scores a small sample per provider every N records with
the same scoring and comparison, and returns the providers to stop routing to, with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.cli import HelpFormatter, run_cli
from eagle3.data.chat import RenderError, load_chat_template, render_record
from eagle3.data.records import read_records
from eagle3.errors import Eagle3Error
from eagle3.evaluation.statistics import bootstrap_ci, ratio_of_sums

log = logging.getLogger(__name__)

# Defaults (CLI flags of the same name override them).
SAMPLE = 200  # records scored per provider and dataset
THRESHOLD = 0.05  # nats/token: the smallest NLL difference worth flagging
TOP_P = 0.95  # nucleus for the out_top_p statistic
CONFIDENCE = 0.95  # bootstrap interval
BOOTSTRAP = 1000  # bootstrap resamples
MIN_RECORDS = 8  # fewer scored records: reported, never compared (bootstrap too optimistic)
SEED = 0  # sampling of records and bootstrap
MAX_LENGTH = 4096  # tokens per rendered record (longer ones are cut)
BATCH_TOKENS = 8192  # padded tokens per forward pass
HEAD_CHUNK = 512  # positions per lm_head chunk (bounds the [n, V] logits)
ALL = "all"  # name of the table over every dataset


class AuditError(Eagle3Error):
    """Bad audit input; the CLI prints it as one line and exits 2."""


# -- scoring -----------------------------------------------------------------------------------
@dataclass
class RecordScore:
    """Sums over the loss-masked tokens of one record (means are taken over pooled sums)."""

    id: str
    dataset: str
    provider: str
    tokens: int
    nll: float  # summed negative log-likelihood, nats
    argmax: int  # tokens equal to the target's argmax
    out_top_p: int  # tokens outside the target's top-p set


def provider_of(record: dict) -> str:
    return str(record.get("provider") or "unknown")


@torch.no_grad()
def score_tokens(
    target: Any,
    sequences: Sequence[tuple[list[int], list[int]]],
    *,
    top_p: float = TOP_P,
    batch_tokens: int = BATCH_TOKENS,
) -> list[tuple[int, float, int, int]]:
    """(input_ids, loss_mask) pairs -> (tokens, nll sum, argmax hits, outside top-p) each.

    Token t (loss_mask[t] = 1, t >= 1) is scored with the target's distribution after t - 1,
    i.e. teacher-forced on the response as the provider wrote it.
    """
    head = target.model.get_output_embeddings()
    results: list[tuple[int, float, int, int]] = [(0, 0.0, 0, 0)] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
    batches, batch = [], []
    for i in order:  # longest first: the first sequence of a batch sets its padded length
        if batch and len(sequences[batch[0]][0]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    for batch in batches:
        width = len(sequences[batch[0]][0])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, i in enumerate(batch):
            seq, loss_mask = sequences[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            attn[row, : len(seq)] = 1
            mask[row, : len(seq)] = torch.tensor(loss_mask, dtype=torch.bool)
        mask[:, 0] = False  # nothing predicts the first token
        _, last = target.capture(ids, attn)  # last: [B, T, H] after the final norm
        rows, cols = mask.nonzero(as_tuple=True)  # scored positions, row-major
        hidden = last[rows.to(last.device), (cols - 1).to(last.device)]  # [N, H] predicts t
        labels = ids[rows, cols].to(last.device)
        nll, hit, out = [], [], []
        for s in range(0, len(labels), HEAD_CHUNK):
            h, y = hidden[s : s + HEAD_CHUNK], labels[s : s + HEAD_CHUNK]
            logp = head(h.to(head.weight.device, head.weight.dtype)).float().log_softmax(-1)
            lp = logp.gather(-1, y.to(logp.device)[:, None])  # [n, 1]
            probs = logp.exp()
            above = (probs * (logp > lp)).sum(-1)  # mass of strictly likelier tokens
            nll.append(-lp[:, 0].double().cpu())
            hit.append((logp.argmax(-1) == y.to(logp.device)).cpu())
            out.append((above >= top_p).cpu())
        nll_t, hit_t, out_t = (torch.cat(x) if x else torch.zeros(0) for x in (nll, hit, out))
        counts = torch.bincount(rows, minlength=len(batch))
        for row, i in enumerate(batch):
            sel = rows == row
            results[i] = (
                int(counts[row]),
                float(nll_t[sel].sum()),
                int(hit_t[sel].sum()),
                int(out_t[sel].sum()),
            )
    return results


def score_records(
    target: Any,
    records: Iterable[dict],
    *,
    top_p: float = TOP_P,
    max_length: int = MAX_LENGTH,
    batch_tokens: int = BATCH_TOKENS,
    chat_template: str | None = None,
    skipped: Counter | None = None,
) -> list[RecordScore]:
    """Score records (eagle3.data.records format) under the target; unrenderable or empty ones are
    counted in ``skipped`` (reason -> n) and left out."""
    skipped = skipped if skipped is not None else Counter()
    kept, sequences = [], []
    for record in records:
        try:
            rendered = render_record(
                target.tokenizer, record, max_length=max_length, chat_template=chat_template
            )
        except RenderError as err:
            skipped[err.reason] += 1
            continue
        if sum(rendered.loss_mask[1:]) == 0:
            skipped["no response tokens"] += 1
            continue
        kept.append(record)
        sequences.append((rendered.input_ids, rendered.loss_mask))
    sums = score_tokens(target, sequences, top_p=top_p, batch_tokens=batch_tokens)
    return [
        RecordScore(str(r.get("id")), str(r.get("dataset") or "unknown"), provider_of(r), *s)
        for r, s in zip(kept, sums)
    ]


# -- statistics --------------------------------------------------------------------------------
def mean_nll(scores: Sequence[RecordScore]) -> float:
    tokens = sum(s.tokens for s in scores)
    return sum(s.nll for s in scores) / tokens if tokens else float("nan")


def nll_interval(
    scores: Sequence[RecordScore],
    *,
    confidence: float = CONFIDENCE,
    n: int = BOOTSTRAP,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile interval of the pooled mean NLL, resampling whole records (fixed seed:
    eagle3.evaluation.statistics.bootstrap_ci); one record: its own NLL twice, none: nan."""
    rows = [(s.nll, s.tokens) for s in scores]
    interval = bootstrap_ci(rows, ratio_of_sums, resamples=n, seed=seed, level=confidence)
    if interval is None:
        mean = mean_nll(scores)
        return mean, mean
    lo, hi = interval
    return lo, hi


@dataclass
class ProviderStats:
    provider: str
    records: int
    tokens: int
    nll: float
    nll_ci: tuple[float, float]
    argmax: float
    out_top_p: float
    ref_nll: float | None = None  # pooled others (those not flagged before it)
    ref_ci: tuple[float, float] | None = None
    flag: str | None = None  # why it is flagged, or None


@dataclass
class Table:
    dataset: str  # ALL or one dataset
    providers: list[ProviderStats] = field(default_factory=list)

    @property
    def flagged(self) -> dict[str, str]:
        return {p.provider: p.flag for p in self.providers if p.flag}


def compare_providers(
    scores: Sequence[RecordScore],
    *,
    dataset: str = ALL,
    threshold: float = THRESHOLD,
    min_records: int = MIN_RECORDS,
    confidence: float = CONFIDENCE,
    n_boot: int = BOOTSTRAP,
    seed: int = SEED,
) -> Table:
    """Per-provider statistics and flags (rule in the module docstring)."""
    groups: dict[str, list[RecordScore]] = defaultdict(list)
    for s in scores:
        groups[s.provider].append(s)

    def ci(group: Sequence[RecordScore]) -> tuple[float, float]:
        return nll_interval(group, confidence=confidence, n=n_boot, seed=seed)

    stats = {}
    for name in sorted(groups):
        g = groups[name]
        tokens = sum(s.tokens for s in g)
        stats[name] = ProviderStats(
            provider=name,
            records=len(g),
            tokens=tokens,
            nll=mean_nll(g),
            nll_ci=ci(g),
            argmax=sum(s.argmax for s in g) / tokens if tokens else float("nan"),
            out_top_p=sum(s.out_top_p for s in g) / tokens if tokens else float("nan"),
        )

    pool = [name for name in sorted(groups) if len(groups[name]) >= min_records]
    while len(pool) >= 2:
        candidates = []
        for name in pool:
            others = [s for q in pool if q != name for s in groups[q]]
            ref, ref_ci = mean_nll(others), ci(others)
            st = stats[name]
            st.ref_nll, st.ref_ci = ref, ref_ci
            diff = st.nll - ref
            disjoint = st.nll_ci[0] > ref_ci[1] or st.nll_ci[1] < ref_ci[0]
            if abs(diff) > threshold and disjoint:
                # Worse fit first (higher NLL), then the larger difference.
                candidates.append((diff > 0, abs(diff), name))
        if not candidates:
            break
        _, _, worst = max(candidates)
        st = stats[worst]
        others = [q for q in pool if q != worst]
        st.flag = (
            f"mean NLL {st.nll:.3f} [{st.nll_ci[0]:.3f}, {st.nll_ci[1]:.3f}] vs "
            f"{st.ref_nll:.3f} [{st.ref_ci[0]:.3f}, {st.ref_ci[1]:.3f}] for "
            f"{', '.join(others)}: {st.nll - st.ref_nll:+.3f} nats/token "
            f"(threshold {threshold}, intervals disjoint); argmax agreement {st.argmax:.3f}"
        )
        pool.remove(worst)
    if len(pool) == 1:  # the last one standing has no reference left
        st = stats[pool[0]]
        if st.flag is None:
            st.ref_nll = st.ref_ci = None
    return Table(dataset, list(stats.values()))


def audit_tables(scores: Sequence[RecordScore], **kwargs: Any) -> list[Table]:
    """The table over all datasets, then one per dataset when there are several."""
    tables = [compare_providers(scores, dataset=ALL, **kwargs)]
    datasets = sorted({s.dataset for s in scores})
    if len(datasets) > 1:
        for name in datasets:
            subset = [s for s in scores if s.dataset == name]
            tables.append(compare_providers(subset, dataset=name, **kwargs))
    return tables


def flagged(tables: Sequence[Table]) -> dict[str, str]:
    """provider -> reason, over every table (first reason wins; dataset named when not ALL)."""
    out: dict[str, str] = {}
    for table in tables:
        for name, reason in table.flagged.items():
            out.setdefault(name, reason if table.dataset == ALL else f"{table.dataset}: {reason}")
    return out


def format_tables(
    tables: Sequence[Table],
    *,
    target: str = "",
    threshold: float = THRESHOLD,
    confidence: float = CONFIDENCE,
) -> str:
    total = next((t for t in tables if t.dataset == ALL), tables[0]) if tables else Table(ALL)
    records = sum(p.records for p in total.providers)
    tokens = sum(p.tokens for p in total.providers)
    lines = [
        f"audit under {target or 'the target'}: {records} records, {tokens} response tokens; "
        f"flag = |NLL - others| > {threshold} nats/token with disjoint "
        f"{confidence:.0%} bootstrap intervals"
    ]
    header = (
        f"{'provider':<20} {'records':>7} {'tokens':>8}  {'mean NLL [CI]':<22} "
        f"{'others [CI]':<22} {'argmax':>6} {'out_top_p':>9}  flag"
    )
    for table in tables:
        lines += ["", f"dataset: {table.dataset}", header]
        for p in table.providers:
            nll = f"{p.nll:.3f} [{p.nll_ci[0]:.3f}, {p.nll_ci[1]:.3f}]"
            ref = (
                f"{p.ref_nll:.3f} [{p.ref_ci[0]:.3f}, {p.ref_ci[1]:.3f}]"
                if p.ref_nll is not None and p.ref_ci is not None
                else "-"
            )
            mark = f"FLAG {p.nll - p.ref_nll:+.3f}" if p.flag and p.ref_nll is not None else ""
            lines.append(
                f"{p.provider:<20} {p.records:>7} {p.tokens:>8}  {nll:<22} {ref:<22} "
                f"{p.argmax:>6.3f} {p.out_top_p:>9.3f}  {mark}"
            )
    flags = flagged(tables)
    lines.append("")
    if flags:
        lines += [f"flagged {name}: {reason}" for name, reason in flags.items()]
    else:
        lines.append("no provider flagged")
    return "\n".join(lines)


# -- reading records ---------------------------------------------------------------------------
def load_records(paths: Sequence[str | Path], skipped: Counter) -> list[dict]:
    """The conversations to audit (records with a messages list), or one AuditError."""
    records = []
    for record in read_records(paths, skipped):
        if isinstance(record.get("messages"), list):
            records.append(record)
        else:
            skipped["not a record"] += 1
    if not records:
        raise AuditError(
            f"no records in {', '.join(map(str, paths))}: pass a datagen output directory "
            "or .jsonl files of records (eagle3.data.records format)"
        )
    return records


def sample_records(records: Sequence[dict], n: int | None, seed: int = SEED) -> list[dict]:
    """At most n records per (provider, dataset), chosen at random with a fixed seed."""
    if n is None:
        return list(records)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(provider_of(r), str(r.get("dataset") or "unknown"))].append(r)
    rng = random.Random(seed)
    out = []
    for key in sorted(groups):
        g = groups[key]
        out += g if len(g) <= n else rng.sample(g, n)
    return out


# -- CLI ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m datagen.audit",
        description="Check that each provider's responses come from the target: score them "
        "under the local target and flag providers whose mean NLL stands out.",
    )
    p.add_argument("--target", required=True, help="registry name, HF directory or .gguf")
    p.add_argument("--data", required=True, nargs="+", help="datagen output dir(s) or .jsonl files")
    p.add_argument(
        "--sample",
        type=int,
        default=SAMPLE,
        help=f"records per provider and dataset (default {SAMPLE}; 0 = all)",
    )
    p.add_argument("--json", dest="json_out", help="write tables and flags to this JSON file")
    p.add_argument("--fail-on-flag", action="store_true", help="exit 1 when a provider is flagged")
    p.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help=f"NLL difference (nats/token) worth flagging (default {THRESHOLD})",
    )
    p.add_argument(
        "--min-records",
        type=int,
        default=MIN_RECORDS,
        help=f"fewest records for a provider to be compared (default {MIN_RECORDS})",
    )
    p.add_argument("--top-p", type=float, default=TOP_P, help="nucleus for out_top_p")
    p.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=SEED, help="record sampling and bootstrap seed")
    p.add_argument("--max-length", type=int, default=MAX_LENGTH, help="tokens per record")
    p.add_argument(
        "--batch-tokens", type=int, default=BATCH_TOKENS, help="padded tokens per forward pass"
    )
    p.add_argument("--chat-template", help="jinja file or string (default: the tokenizer's)")
    p.add_argument("--device", help="e.g. cuda:0 (default: cuda if available, else cpu)")
    p.add_argument("--device-map", help="e.g. auto, for a target spread over several GPUs")
    p.add_argument("--dtype", help="e.g. bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    problems = []
    if args.sample < 0:
        problems.append(f"--sample must be >= 0, got {args.sample}")
    if args.threshold < 0:
        problems.append(f"--threshold must be >= 0, got {args.threshold}")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.bootstrap < 1 or args.min_records < 1:
        problems.append("--bootstrap and --min-records must be >= 1")
    if args.dtype and not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        problems.append(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
    if problems:
        raise AuditError("; ".join(problems))
    skipped: Counter = Counter()
    records = sample_records(load_records(args.data, skipped), args.sample or None, args.seed)

    # torch and transformers load once the records are read (a bad --data fails fast)
    from eagle3.targets import load_target

    target = load_target(
        args.target, dtype=args.dtype, device=args.device, device_map=args.device_map
    )
    if target.tokenizer is None:
        raise AuditError(
            f"target {args.target} has no tokenizer; the audit needs its chat template"
        )
    scores = score_records(
        target,
        records,
        chat_template=load_chat_template(args.chat_template),
        top_p=args.top_p,
        max_length=args.max_length,
        batch_tokens=args.batch_tokens,
        skipped=skipped,
    )
    if not scores:
        raise AuditError(
            f"none of the {len(records)} records could be scored ({dict(skipped)}); "
            "check the records or pass --chat-template"
        )
    kwargs = dict(
        threshold=args.threshold,
        min_records=args.min_records,
        n_boot=args.bootstrap,
        seed=args.seed,
    )
    tables = audit_tables(scores, **kwargs)
    print(format_tables(tables, target=target.name, threshold=args.threshold))
    if skipped:
        print(f"skipped: {', '.join(f'{k} {v}' for k, v in sorted(skipped.items()))}")
    flags = flagged(tables)
    if args.json_out:
        report = {
            "target": target.name,
            "threshold": args.threshold,
            "top_p": args.top_p,
            "confidence": CONFIDENCE,
            "bootstrap": args.bootstrap,
            "seed": args.seed,
            "sample": args.sample,
            "skipped": dict(skipped),
            "tables": [
                {"dataset": t.dataset, "providers": [asdict(p) for p in t.providers]}
                for t in tables
            ],
            "flagged": flags,
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if flags and args.fail_on_flag else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
