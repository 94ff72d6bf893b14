"""Benchmark the math reward: one worker round trip, and the in-process fast path.

    python tools/bench_math_reward.py [--json] [--calls 200]

Both are measured in the same run on the same machine load: the IPC round trip of an empty
request to a math-verify worker, and one ``reward`` call on a plain numeric answer (decided
in-process, no worker). Prints one JSON line with seconds per call.
"""

from __future__ import annotations

import argparse
import json
import time

from emapg_megatron.tasks import math as mt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--calls", type=int, default=200, help="calls per measurement")
    args = ap.parse_args()
    with mt.MathVerifierPool(num_workers=1) as pool:
        round_trip = pool.ping(args.calls)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mt.reward("so \\boxed{\\frac{1}{2}}", "0.5", pool=pool)
        fast = (time.perf_counter() - t0) / args.calls
        t0 = time.perf_counter()
        for _ in range(args.calls // 10 or 1):
            mt.reward("\\boxed{x+1}", "1+x", pool=pool)
        verified = (time.perf_counter() - t0) / (args.calls // 10 or 1)
    out = {"worker_round_trip_s": round_trip, "fast_path_reward_s": fast,
           "math_verify_reward_s": verified, "calls": args.calls}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
