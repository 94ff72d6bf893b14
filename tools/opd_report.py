"""The on-policy distillation demo's report: the student runs against the teacher, over seeds.

    python tools/opd_report.py OUT --seeds 1 2 3 4 5 [--teacher DIR] [--run opd --run opd-renorm --run rl]

Reads the teacher's DIR/metrics.jsonl (default OUT/teacher) and OUT/seed-<S>/<run>/metrics.jsonl of
each student run and seed. The teacher's reward is the mean of its last 20 logged steps. A run's
steps-to-90% is the first step whose mean reward over its last 10 steps reaches 90% of the
teacher's (null if none does within the run). Writes OUT/opd_curves.png (each run's 10-step mean
reward: the seeds' mean, their min-max band and each seed; the teacher's reward and the 90% line)
and prints, as its last line, one JSON object: ``out``, ``seeds``, ``steps``, ``teacher_reward``, ``target``
(90% of it), and per run (dashes become underscores) ``<run>_steps_to_90pct`` and
``<run>_reward_last_10``, each ``{"per_seed": [...], "median", "min", "max"}`` (a null ranks above
every step: see ``seed_report.distribution``), and ``machine``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from seed_report import WINDOW, distribution, figure, machine, mean, moving_mean, plot_band, rewards  # noqa: E402

TEACHER_WINDOW = 20  # the teacher's last steps averaged into its reward
FRACTION = 0.9
RUNS = ("opd", "opd-renorm", "rl")


def steps_to(values: list[float], target: float, window: int = WINDOW) -> int | None:
    """The first step (1-based) whose mean over the last ``window`` steps reaches ``target``."""
    means = moving_mean(values, window)
    return next((i + 1 for i in range(window - 1, len(values)) if means[i] >= target), None)


def report(out: str, seeds: list[int], teacher: str | None = None, runs=RUNS) -> dict:
    teacher_reward = mean(rewards(os.path.join(teacher or os.path.join(out, "teacher"), "metrics.jsonl"))
                          [-TEACHER_WINDOW:])
    target = FRACTION * teacher_reward
    curves = {name: [rewards(os.path.join(out, f"seed-{s}", name, "metrics.jsonl")) for s in seeds]
              for name in runs}
    result = {"out": out, "seeds": seeds, "steps": min(len(c) for runs_ in curves.values() for c in runs_),
              "teacher_reward": round(teacher_reward, 4), "target": round(target, 4)}
    for name, per_seed in curves.items():
        key = name.replace("-", "_")
        result[f"{key}_steps_to_90pct"] = distribution([steps_to(c, target) for c in per_seed])
        result[f"{key}_reward_last_{WINDOW}"] = distribution([mean(c[-WINDOW:]) for c in per_seed])
    result["machine"] = machine()
    plot(os.path.join(out, "opd_curves.png"), curves, teacher_reward)
    return result


def plot(path: str, curves: dict, teacher_reward: float) -> None:
    fig, ax = figure(height=4.6)
    for name, per_seed in curves.items():
        plot_band(ax, per_seed, name)
    ax.axhline(teacher_reward, color="black", linestyle="--", label="teacher")
    ax.axhline(FRACTION * teacher_reward, color="gray", linestyle=":", label="90% of the teacher")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8)  # below the curves
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the students' folder (seed-<S>/<run> per seed and run)")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds run")
    p.add_argument("--teacher", help="the teacher's log folder (default: OUT/teacher)")
    p.add_argument("--run", action="append", dest="runs", help="a student run's folder name (repeatable)")
    args = p.parse_args(argv)
    result = report(args.out, args.seeds, args.teacher, args.runs or RUNS)
    print(f"curves: {os.path.join(args.out, 'opd_curves.png')}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
