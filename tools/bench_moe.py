"""Step time of a MoE policy at expert parallelism 1 and 2, and with each token dispatcher,
side by side in one run (CPU, gloo, two processes):

    python tools/bench_moe.py --steps 20 --json

Each layout trains ``--steps`` steps of ``--preset moe-tiny-cpu`` (a Qwen3-MoE-shaped policy,
4 experts, top-2; routing replay R2) on two ranks: EP=1 (DP=2, every rank holds every expert), EP=2
with the allgather dispatcher, EP=2 with alltoall. Reports each layout's median step time (steps
after ``--warmup``), rollout and update time, and the ratios to EP=1. ``--experts`` and
``--hidden`` widen the model. The layouts run one after the other on the same machine: compare
ratios from one run, not numbers from two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

LAYOUTS = {
    "ep1": (1, []),
    "ep2_allgather": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]),
    "ep2_alltoall": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
}


def steps_of(argv: list, steps: int) -> list[dict]:
    """The trainer as ``emapg_megatron.train`` builds it, ``steps`` steps; their metrics."""
    from emapg_megatron import build

    trainer = build.build_trainer(build.prepare(argv))
    return [trainer.step(i).metrics for i in range(1, steps + 1)]


def measure(steps: int, warmup: int, extra: list) -> dict:
    from emapg_megatron.multiprocess import run_distributed

    rows = {}
    for name, (ep, flags) in LAYOUTS.items():
        argv = ["--preset", "moe-tiny-cpu", "--train-iters", str(steps), *flags, *extra]
        if ep == 1:
            argv += ["--expert-model-parallel-size", "1"]
        metrics = run_distributed(steps_of, 2, ep=ep, args=(argv, steps), timeout=3600)[0][warmup:]
        rows[name] = {k: round(statistics.median(m[k] for m in metrics), 4)
                      for k in ("step_time_s", "rollout_time_s", "update_time_s")}
        rows[name]["steps_timed"] = len(metrics)
    base = rows["ep1"]["step_time_s"]
    return {"layouts": rows, "step_time_ratio_to_ep1": {k: round(v["step_time_s"] / base, 3) for k, v in rows.items()},
            "alltoall_over_allgather": round(rows["ep2_alltoall"]["step_time_s"] /
                                             rows["ep2_allgather"]["step_time_s"], 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--experts", type=int, default=None, help="--num-experts (default: the preset's 4)")
    p.add_argument("--hidden", type=int, default=None, help="--hidden-size (default: the preset's 64)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    extra = (["--num-experts", str(a.experts)] if a.experts else []) + \
            (["--hidden-size", str(a.hidden)] if a.hidden else [])
    from seed_report import machine

    result = {**measure(a.steps, a.warmup, extra), "steps": a.steps, "warmup": a.warmup,
              "extra_flags": extra, "machine": machine()}
    if a.json:
        print(json.dumps(result))
        return
    for name, row in result["layouts"].items():
        print(f"{name:>14}: step {row['step_time_s']:.3f} s (rollout {row['rollout_time_s']:.3f}, "
              f"update {row['update_time_s']:.3f}); x{result['step_time_ratio_to_ep1'][name]} of EP=1")
    print(f"alltoall / allgather: {result['alltoall_over_allgather']}", file=sys.stderr)


if __name__ == "__main__":
    main()
