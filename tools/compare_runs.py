"""Compare training configurations over several seeds: mean +- std curves and a summary table.

    python tools/compare_runs.py --out runs/compare --seeds 1 2 3 \
        --config "grpo-k3-fixed=--kl-loss-type k3 --ema-eta 1.0" \
        --config "ema-pg-topk=--kl-loss-type topk-reverse --ema-eta 0.9" \
        -- --preset tiny-cpu --kl-coef 0.01

Each (config, seed) runs `torchrun --nproc_per_node N -m emapg_megatron.train` into
OUT/<name>/seed<S>/ unless its metrics.jsonl is already complete (so a rerun only plots;
--read-only never launches). Writes OUT/compare.png, OUT/summary.md and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import numpy as np

from emapg_megatron.run.metrics import read_jsonl

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
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds per config")
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


def summarize(runs: dict[str, list[dict]], last: int) -> dict:
    out = {}
    for name, seeds in runs.items():
        final = np.array([np.nanmean(c["reward_mean"][-last:]) for c in seeds])
        first = np.array([np.nanmean(c["reward_mean"][:last]) for c in seeds])
        kl = np.array([np.nanmean(c["kl"][-last:]) for c in seeds])
        out[name] = {"seeds": len(seeds), "reward_first": float(first.mean()),
                     "reward_final_mean": float(final.mean()), "reward_final_std": float(final.std()),
                     "kl_final_mean": float(kl.mean())}
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
            mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
            ax.plot(step, mean, label=f"{name} (n={len(seeds)})")
            ax.fill_between(step, mean - std, mean + std, alpha=0.2)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def markdown(summary: dict, last: int) -> str:
    lines = [f"| config | seeds | reward, first {last} steps | reward, last {last} steps (mean ± std) "
             f"| KL, last {last} |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['seeds']} | {s['reward_first']:.3f} | "
                     f"{s['reward_final_mean']:.3f} ± {s['reward_final_std']:.3f} | {s['kl_final_mean']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, list[dict]] = {}
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
    if not runs:
        raise SystemExit(f"error: no complete runs under {args.out}")
    summary = summarize(runs, args.last)
    plot(runs, os.path.join(args.out, "compare.png"))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(markdown(summary, args.last))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(markdown(summary, args.last))
    print(json.dumps({"png": os.path.join(args.out, "compare.png"), "summary": summary}))


if __name__ == "__main__":
    main()
