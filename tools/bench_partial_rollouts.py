"""Rollout tokens/s at a long and a short response budget (issue 30's measure), printed as JSON.

Runs ``emapg_megatron.launch --preset tiny-cpu`` (TP=2 on two processes) at ``--max-new-tokens``
SHORT and LONG (``--seq-length`` and ``--max-position-embeddings`` N+8), alternating the two for
``--rounds`` rounds (wall-clock rates on a shared machine drift; alternation pairs them), with the
extra flags given after ``--``. Per run: the median ``rollout_tokens_per_s`` over steps 2+ (a
partial-rollout step that sampled nothing logs no rate and is left out) and the tokens sampled per
model forward (``partial/forwards``: the same on any machine). Prints one JSON object with each
run and the LONG/SHORT ratios of the medians.

    python tools/bench_partial_rollouts.py --rounds 3 -- --partial-rollouts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(budget: int, iters: int, nproc: int, extra: list[str], workdir: Path) -> dict:
    log_dir = workdir / f"n{budget}-{len(list(workdir.iterdir()))}"
    cmd = [sys.executable, "-m", "emapg_megatron.launch", "--standalone", "--nproc-per-node", str(nproc),
           "--preset", "tiny-cpu", "--max-new-tokens", str(budget), "--seq-length", str(budget + 8),
           "--max-position-embeddings", str(budget + 8), "--train-iters", str(iters),
           "--log-dir", str(log_dir), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_partial_rollouts: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    later = [m for m in steps[1:] if "rollout_tokens_per_s" in m]
    rates = [m["rollout_tokens_per_s"] for m in later]
    tokens = sum(m["rollout_tokens_per_s"] * m["rollout_time_s"] for m in later)
    forwards = sum(m.get("partial/forwards", 0) for m in later)
    trained = sum(m["tokens_per_s"] * m["step_time_s"] for m in steps[1:])  # trained tokens, steps 2+
    every = sum(m.get("partial/forwards", 0) for m in steps[1:])
    return {"max_new_tokens": budget, "median_tokens_per_s": round(statistics.median(rates), 1),
            "tokens_per_forward": round(tokens / forwards, 1) if forwards else None,
            "trained_tokens_per_forward": round(trained / every, 1) if every else None,
            "reward_mean": round(statistics.mean(m["reward_mean"] for m in steps), 4),
            "dropped_stale": sum(m.get("partial/dropped_stale", 0) for m in steps)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", type=int, default=32, help="the short --max-new-tokens")
    p.add_argument("--long", type=int, default=256, help="the long --max-new-tokens")
    p.add_argument("--rounds", type=int, default=3, help="alternated (short, long) pairs of runs")
    p.add_argument("--train-iters", type=int, default=8, help="steps per run (the first is left out)")
    p.add_argument("--nproc", type=int, default=2, help="processes (tiny-cpu: TP=2)")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            pair = [run(b, args.train_iters, args.nproc, extra, Path(tmp)) for b in (args.short, args.long)]
            rounds.append({"short": pair[0], "long": pair[1],
                           "ratio": round(pair[1]["median_tokens_per_s"] / pair[0]["median_tokens_per_s"], 3)})
    ratios = [r["ratio"] for r in rounds]
    per_forward = [r["long"]["tokens_per_forward"] / r["short"]["tokens_per_forward"] for r in rounds
                   if r["short"]["tokens_per_forward"] and r["long"]["tokens_per_forward"]]
    print(json.dumps({"flags": extra, "rounds": rounds, "median_ratio": statistics.median(ratios),
                      "tokens_per_forward_ratio": round(statistics.median(per_forward), 3) if per_forward else None},
                     indent=1))


if __name__ == "__main__":
    main()
