"""Compare training configurations over seeds: curves with their spread and a summary table.

    python tools/compare_runs.py --out runs/compare --seeds 1 2 3 4 5 \
        --config "grpo-k3-fixed=--kl-loss-type k3 --ema-eta 1.0" \
        --config "ema-pg-topk=--kl-loss-type topk-reverse --ema-eta 0.9" \
        -- --preset tiny-cpu --kl-coef 0.01

Each (config, seed) runs `torchrun --nproc_per_node N -m emapg_megatron.train` into
OUT/<name>/seed<S>/ unless its metrics.jsonl is already complete (so a rerun only plots;
--read-only never launches). Each figure (the reward of the first and of the last --last steps,
the KL of the last --last steps) is given per seed with its median, min and max
(``seed_report.distribution``), and the machine that measured it. Writes OUT/compare.png (the seeds'
median and min-max band), OUT/summary.md and OUT/summary.json; prints the table and, last, one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the seed report's helpers
from seed_report import distribution, machine  # noqa: E402

from emapg_megatron.run.metrics import read_jsonl  # noqa: E402

CURVES = ("reward_mean", "kl", "entropy", "ema_lag")
DEFAULT_CONFIGS = [
    "grpo-k3-fixed=--kl-loss-type k3 --ema-eta 1.0",
    "ema-pg-topk=--kl-loss-type topk-reverse --kl-tail unbiased --ema-eta 0.9",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", action="append", default=None,
                   help="NAME=TRAINER FLAGS (repeatable); default: GRPO-K3 fixed anchor vs EMA-PG Top-k")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="seeds per config")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun)")
    p.add_argument("--read-only", action="store_true", help="only read existing runs and plot")
    p.add_argument("--last", type=int, default=10, help="steps averaged for the final numbers")
    p.add_argument("common", nargs=argparse.REMAINDER, help="-- flags passed to every run")
    args = p.parse_args(argv)
    args.common = [a for a in args.common if a != "--"] or ["--preset", "tiny-cpu"]
    args.config = args.config or DEFAULT_CONFIGS
    return args


def parse_config(spec: str) -> tuple[str, list[str]]:
    if "=" not in spec:
        raise SystemExit(f"error: --config must be NAME=FLAGS (got {spec!r})")
    name, flags = spec.split("=", 1)
    return name.strip(), shlex.split(flags)


def run_dir(out: str, name: str, seed: int) -> str:
    return os.path.join(out, name, f"seed{seed}")


def expected_steps(flags: list[str]) -> int | None:
    from emapg_megatron.arguments import parse_args as trainer_args

    return trainer_args(flags).loop.train_iters


def complete(path: str, steps: int | None) -> bool:
    f = os.path.join(path, "metrics.jsonl")
    return os.path.isfile(f) and steps is not None and len(read_jsonl(f)) >= steps


def launch(path: str, flags: list[str], seed: int, nproc: int) -> None:
    if os.path.exists(os.path.join(path, "metrics.jsonl")):
        os.remove(os.path.join(path, "metrics.jsonl"))  # an incomplete run restarts
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "emapg_megatron.train", *flags, "--seed", str(seed), "--log-dir", path]
    print("running:", shlex.join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def curves(path: str) -> dict[str, np.ndarray]:
    recs = read_jsonl(os.path.join(path, "metrics.jsonl"))
    return {k: np.array([r.get(k, np.nan) for r in recs]) for k in ("step", *CURVES)}


def summarize(runs: dict[str, list[dict]], seeds: dict[str, list[int]], last: int) -> dict:
    """Each config's figures per seed, with their median, min and max."""
    out = {}
    for name, curves_of in runs.items():
        out[name] = {"seeds": seeds[name],
                     "reward_first": distribution([float(np.nanmean(c["reward_mean"][:last])) for c in curves_of]),
                     "reward_last": distribution([float(np.nanmean(c["reward_mean"][-last:])) for c in curves_of]),
                     "kl_last": distribution([float(np.nanmean(c["kl"][-last:])) for c in curves_of])}
    return out


def plot(runs: dict[str, list[dict]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for name, seeds in runs.items():
        n = min(len(c["step"]) for c in seeds)
        step = seeds[0]["step"][:n]
        for ax, key in zip(axes, CURVES):
            ys = np.stack([c[key][:n] for c in seeds])
            line, = ax.plot(step, np.nanmedian(ys, 0), label=f"{name} (median of {len(seeds)} seeds)")
            ax.fill_between(step, np.nanmin(ys, 0), np.nanmax(ys, 0), color=line.get_color(), alpha=0.2)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _spread(d: dict, fmt: str = ".3f") -> str:
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}–{d['max']:{fmt}})"


def markdown(summary: dict, last: int, where: str) -> str:
    """The figures' medians (min–max over the seeds), then every seed's."""
    lines = [f"Median (min–max) over the seeds, on {where}:", "",
             f"| config | seeds | reward, first {last} steps | reward, last {last} steps | KL, last {last} |",
             "|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {len(s['seeds'])} | {_spread(s['reward_first'])} | "
                     f"{_spread(s['reward_last'])} | {_spread(s['kl_last'])} |")
    lines += ["", f"| config | seed | reward, first {last} | reward, last {last} | KL, last {last} |",
              "|---|---|---|---|---|"]
    for name, s in summary.items():
        for i, seed in enumerate(s["seeds"]):
            lines.append(f"| {name} | {seed} | {s['reward_first']['per_seed'][i]:.3f} | "
                         f"{s['reward_last']['per_seed'][i]:.3f} | {s['kl_last']['per_seed'][i]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    done: dict[str, list[int]] = {}
    for spec in args.config:
        name, flags = parse_config(spec)
        flags = args.common + flags
        steps = expected_steps(flags)
        for seed in args.seeds:
            path = run_dir(args.out, name, seed)
            if not complete(path, steps):
                if args.read_only:
                    continue
                launch(path, flags, seed, args.nproc)
            runs.setdefault(name, []).append(curves(path))
            done.setdefault(name, []).append(seed)
    if not runs:
        raise SystemExit(f"error: no complete runs under {args.out}")
    summary = summarize(runs, done, args.last)
    where = machine()
    plot(runs, os.path.join(args.out, "compare.png"))
    table = markdown(summary, args.last, where)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"summary": summary, "machine": where}, f, indent=2)
    print(table)
    print(json.dumps({"png": os.path.join(args.out, "compare.png"), "summary": summary, "machine": where}))

if __name__ == "__main__":
    main()
