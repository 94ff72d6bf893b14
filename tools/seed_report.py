"""Figures over seeds: each seed's value, their median and spread, and the machine measuring them.

    python tools/seed_report.py OUT --seeds 1 2 3 4 5

The main job's report (``examples/tiny_cpu.sh``). Reads OUT/seed-<S>/metrics.jsonl of each seed.
A seed's figures are its mean reward over the first and over the last 10 logged steps. Writes
OUT/reward_seeds.png (each seed's 10-step mean reward, the seeds' mean and their min-max band) and
prints, as its last line, one JSON object:

    {"out": OUT, "seeds": [1, 2, ...], "steps": 150,
     "reward_first_10": {"per_seed": [...], "median": m, "min": a, "max": b},
     "reward_last_10": {...}, "machine": "CPU model, N CPUs"}

The helpers (``distribution``, ``machine``, ``plot_band``, ...) are the distillation demo's too
(``tools/opd_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from emapg_megatron.run.metrics import read_jsonl

WINDOW = 10  # steps averaged: a seed's first / last figure, and the curves' moving mean
DIGITS = 4


def rewards(path: str) -> list[float]:
    """``reward_mean`` of every logged step of a metrics.jsonl."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} does not exist (did that run finish?)")
    records = [r for r in read_jsonl(path) if "reward_mean" in r]
    if not records:
        raise SystemExit(f"error: {path} has no logged steps")
    return [float(r["reward_mean"]) for r in records]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def moving_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def distribution(values: list, digits: int = DIGITS) -> dict:
    """Each seed's value, their median, min and max.

    A None (a figure a seed never reached, e.g. steps to a target within the run) ranks above every
    number: the max is None when any seed has one, the median when the middle rank(s) hold one.
    """
    ranked = sorted(values, key=lambda v: (v is None, v if v is not None else 0))
    n = len(ranked)
    middle = ranked[(n - 1) // 2: n // 2 + 1]
    median = None if None in middle else middle[0] if len(middle) == 1 else mean(middle)

    def rounded(v):
        return None if v is None else (round(v, digits) if isinstance(v, float) else v)

    return {"per_seed": [rounded(v) for v in values], "median": rounded(median),
            "min": rounded(ranked[0]), "max": rounded(ranked[-1])}


def machine() -> str:
    """The CPU model (from /proc/cpuinfo where there is one) and the number of CPUs."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model}, {os.cpu_count()} CPUs"


def plot_band(ax, curves: list[list[float]], label: str, color: str | None = None) -> None:
    """Each seed's moving mean (thin), the seeds' mean (thick) and their min-max band."""
    smooth = [moving_mean(c) for c in curves]
    n = min(len(c) for c in smooth)
    steps = range(1, n + 1)
    columns = [[c[i] for c in smooth] for i in range(n)]
    line, = ax.plot(steps, [mean(col) for col in columns], color=color, lw=2,
                    label=f"{label} (mean of {len(curves)} seeds)")
    ax.fill_between(steps, [min(col) for col in columns], [max(col) for col in columns],
                    color=line.get_color(), alpha=0.2)
    for c in smooth:
        ax.plot(range(1, len(c) + 1), c, color=line.get_color(), lw=0.6, alpha=0.6)


def figure(height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, height))  # no pyplot: no global figure state, no GUI backend
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward ({WINDOW}-step mean)")
    ax.grid(alpha=0.3)
    return fig, ax


def report(out: str, seeds: list[int]) -> dict:
    curves = [rewards(os.path.join(out, f"seed-{s}", "metrics.jsonl")) for s in seeds]
    fig, ax = figure()
    plot_band(ax, curves, "reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "reward_seeds.png"), dpi=100)
    return {"out": out, "seeds": seeds, "steps": min(len(c) for c in curves),
            f"reward_first_{WINDOW}": distribution([mean(c[:WINDOW]) for c in curves]),
            f"reward_last_{WINDOW}": distribution([mean(c[-WINDOW:]) for c in curves]),
            "machine": machine()}


def report_main(report_fn, doc: str, png: str, argv=None) -> None:
    """A demo report's command line: ``OUT --seeds S ...``; ``report_fn(out, seeds)``'s JSON as the
    last line, after saying where its plot ``png`` (in OUT) is."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the demo's output folder (one seed-<S> folder per seed)")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds run")
    args = p.parse_args(argv)
    result = report_fn(args.out, args.seeds)
    print(f"curves: {os.path.join(args.out, png)}", file=sys.stderr)
    print(json.dumps(result))


def main(argv=None) -> None:
    report_main(report, __doc__, "reward_seeds.png", argv)


if __name__ == "__main__":
    main()
