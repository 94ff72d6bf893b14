"""The on-policy distillation demo's report: reward curves of the student runs against the teacher.

    python tools/opd_report.py OUT [--teacher teacher] [--run opd --run opd-renorm --run rl]

Reads OUT/<name>/metrics.jsonl of the teacher and of each student run. The teacher's reward is the
mean of its last 20 logged steps. A run's steps-to-90% is the first step whose mean reward over
its last 10 steps reaches 90% of the teacher's (null if none does). Writes OUT/opd_curves.png
(each run's 10-step mean reward, the teacher's reward and the 90% line) and prints, as its last
line, one JSON object: ``teacher_reward`` and ``<run>_steps_to_90pct`` per run (dashes become
underscores: ``opd_steps_to_90pct``, ``opd_renorm_steps_to_90pct``, ``rl_steps_to_90pct``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from emapg_megatron.run.metrics import read_jsonl

TEACHER_WINDOW = 20  # the teacher's last steps averaged into its reward
WINDOW = 10  # a student's moving mean
FRACTION = 0.9


def rewards(path: str) -> list[float]:
    records = [r for r in read_jsonl(path) if "reward_mean" in r]
    if not records:
        raise SystemExit(f"error: {path} has no logged steps")
    return [float(r["reward_mean"]) for r in records]


def moving_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def steps_to(values: list[float], target: float, window: int = WINDOW) -> int | None:
    """The first step (1-based) whose mean over the last ``window`` steps reaches ``target``."""
    means = moving_mean(values, window)
    return next((i + 1 for i in range(window - 1, len(values)) if means[i] >= target), None)


def report(out: str, teacher: str, runs: list[str]) -> dict:
    teacher_rewards = rewards(os.path.join(out, teacher, "metrics.jsonl"))
    tail = teacher_rewards[-TEACHER_WINDOW:]
    teacher_reward = sum(tail) / len(tail)
    curves = {name: rewards(os.path.join(out, name, "metrics.jsonl")) for name in runs}
    result = {"teacher_reward": round(teacher_reward, 4)}
    for name, values in curves.items():
        result[f"{name.replace('-', '_')}_steps_to_90pct"] = steps_to(values, FRACTION * teacher_reward)
    plot(os.path.join(out, "opd_curves.png"), curves, teacher_reward)
    return result


def plot(path: str, curves: dict, teacher_reward: float) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), moving_mean(values), label=name)
    ax.axhline(teacher_reward, color="black", linestyle="--", label="teacher")
    ax.axhline(FRACTION * teacher_reward, color="gray", linestyle=":", label="90% of the teacher")
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward ({WINDOW}-step mean)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the demo's output folder")
    p.add_argument("--teacher", default="teacher", help="the teacher run's folder in OUT")
    p.add_argument("--run", action="append", dest="runs", help="a student run's folder in OUT (repeatable)")
    args = p.parse_args(argv)
    result = report(args.out, args.teacher, args.runs or ["opd", "opd-renorm", "rl"])
    print(f"curves: {os.path.join(args.out, 'opd_curves.png')}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
