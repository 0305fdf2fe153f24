"""Compare drafters side by side: `python -m eagle3.compare RUN_OR_JSON ... [--out DIR]`.

Each input is a file written by `python -m eagle3.evaluate --json`, a W&B run directory
(local, e.g. offline runs: its files/eagle3_eval.json) or a W&B run path ENTITY/PROJECT/RUN_ID
(needs the W&B API). Prints a markdown table of drafters x benchmarks (tau and speedup, with
their 95% intervals where the results have them) and writes two PNGs: tau per benchmark
(grouped bars, interval as error bars) and per-position acceptance alpha_i.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from eagle3.cli import HelpFormatter
from eagle3.errors import Eagle3Error
from eagle3.evaluation.report import EVAL_FILE


def load_results(source: str) -> dict[str, Any]:
    """One evaluate report from a JSON file, a local W&B run dir or a W&B run path."""
    path = Path(source)
    if path.is_file():
        return _read(path)
    if path.is_dir():
        found = sorted(path.rglob(EVAL_FILE))
        if not found:
            raise Eagle3Error(
                f"{path} holds no {EVAL_FILE}; was it logged by eagle3.evaluate --wandb?"
            )
        return _read(found[-1])
    if source.count("/") == 2:
        try:
            import wandb

            run = wandb.Api().run(source)
            with tempfile.TemporaryDirectory() as tmp:
                run.file(EVAL_FILE).download(root=tmp, replace=True)
                return _read(Path(tmp) / EVAL_FILE)
        except Exception as err:  # network, auth, missing file: one line
            raise Eagle3Error(f"cannot read W&B run {source}: {str(err).splitlines()[0]}") from err
    raise Eagle3Error(f"{source}: not a results JSON, a W&B run directory or ENTITY/PROJECT/RUN_ID")


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise Eagle3Error(f"{path} is not valid JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise Eagle3Error(f"{path} has no 'results' list; pass a file from eagle3.evaluate --json")
    return data


def collect(sources: list[str]) -> list[dict[str, Any]]:
    """Result rows of every input; a drafter name seen in two inputs gets its file as suffix."""
    reports = [(s, load_results(s)) for s in sources]
    owners: dict[str, set[str]] = {}
    for source, report in reports:
        for r in report["results"]:
            owners.setdefault(r["drafter"], set()).add(source)
    rows = []
    for source, report in reports:
        for r in report["results"]:
            label = r["drafter"]
            if len(owners[label]) > 1:
                label = f"{label} ({Path(source).stem})"
            rows.append({**r, "label": label})
    return rows


def _order(values) -> list:
    return list(dict.fromkeys(values))


def _with_ci(value: str, ci: list[float] | None) -> str:
    return f"{value} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else value


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: drafters x benchmarks, each cell 'tau / speedup', each with its 95% interval
    '[lo, hi]' where the results have one (eagle3.evaluate rows before intervals have none)."""
    benches = _order(r["bench"] for r in rows)
    labels = _order(r["label"] for r in rows)
    cell = {(r["label"], r["bench"]): r for r in rows}
    lines = [
        "| drafter | " + " | ".join(f"{b} τ / speedup" for b in benches) + " |",
        "|---|" + "---|" * len(benches),
    ]
    for label in labels:
        cells = []
        for b in benches:
            r = cell.get((label, b))
            if r is None:
                cells.append("–")
                continue
            tau = _with_ci(f"{r['tau']:.2f}", r.get("tau_ci95"))
            speedup = _with_ci(f"{r['speedup']:.2f}x", r.get("speedup_ci95"))
            cells.append(f"{tau} / {speedup}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(r.get("tau_ci95") or r.get("speedup_ci95") for r in rows):
        lines += ["", "[lo, hi]: 95% bootstrap interval over prompts"]
    return "\n".join(lines)


def plot_tau(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = _order(r["bench"] for r in rows)
    labels = _order(r["label"] for r in rows)
    cell = {(r["label"], r["bench"]): r for r in rows}
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(benches) * max(1, len(labels) / 2)), 4))
    for i, label in enumerate(labels):
        xs = [b + (i - (len(labels) - 1) / 2) * width for b in range(len(benches))]
        found = [cell.get((label, bench)) for bench in benches]
        taus = [r["tau"] if r else 0.0 for r in found]
        cis = [(r or {}).get("tau_ci95") or (t, t) for r, t in zip(found, taus)]
        below = [max(t - lo, 0.0) for t, (lo, _) in zip(taus, cis)]
        above = [max(hi - t, 0.0) for t, (_, hi) in zip(taus, cis)]
        yerr = [below, above] if any(below + above) else None  # the 95% interval, where known
        bars = ax.bar(xs, taus, width, label=label, yerr=yerr, capsize=3)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_ylabel("τ (tokens per verification step)")
    ax.set_title("Acceptance length per benchmark")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    benches = _order(r["bench"] for r in rows)
    fig, axes = plt.subplots(1, len(benches), figsize=(4 * len(benches), 3.5), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for r in rows:
            if r["bench"] != bench or not r.get("alpha"):
                continue
            points = [(i + 1, a) for i, a in enumerate(r["alpha"]) if a is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=r["label"])
        ax.set_title(bench)
        ax.set_xlabel("draft position i")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("α_i (accepted | offered)")
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=8, loc="lower center", ncol=min(4, len(names)))
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m eagle3.compare",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("sources", nargs="+", metavar="RUN_OR_JSON")
    p.add_argument("--out", default=".", help="directory for tau.png and acceptance.png")
    args = p.parse_args(argv)
    try:
        rows = collect(args.sources)
        if not rows:
            raise Eagle3Error("the inputs hold no results")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tau_png = plot_tau(rows, out / "tau.png")
        alpha_png = plot_acceptance(rows, out / "acceptance.png")
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print(f"\nwrote {tau_png} and {alpha_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
