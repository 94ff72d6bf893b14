"""Token balance over data-parallel ranks, before and after ``training.sequence_balance``.

    python tools/bench_dp_balance.py --json

Deterministic counts, no timing: for each DP size, a rollout batch of ``--seqs-per-rank``
sequences per rank with log-normal lengths (``bench_packing``'s mix: median ``--median``, cut at
``--cap`` x the median), split into ``--mini-batches`` PPO mini-batches. Each optimizer step waits
for the busiest rank, so ``imbalance`` (the busiest rank's tokens over the mean, worst
mini-batch) bounds the time the other ranks idle. Also printed: how many sequences move and the
bytes the exchange sends (each moved sequence's real tokens, ``--bytes-per-token`` for the
fields that travel) against the bytes of the padded ``[S, L]`` rows an all-gather would send.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from bench_packing import lengths_mix  # noqa: E402

from emapg_megatron.training.sequence_balance import assign, imbalance  # noqa: E402


def measure(dp: int, per_rank: int, mini_batches: int, median: int, cap: float,
            bytes_per_token: int) -> dict:
    every = lengths_mix(dp * per_rank, median, cap, seed=dp)
    lengths = [every[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
    size = per_rank // mini_batches
    groups = [list(range(m, m + size)) for m in range(0, per_rank, size)]
    dest = assign(lengths, groups)
    moved = [(r, i) for r in range(dp) for i in range(per_rank) if dest[r][i] != r]
    width = max(every)
    return {"dp": dp, "sequences": dp * per_rank, "mini_batches": len(groups),
            "imbalance_before": round(imbalance(lengths, [[r] * per_rank for r in range(dp)], groups), 4),
            "imbalance_after": round(imbalance(lengths, dest, groups), 4),
            "sequences_moved": len(moved),
            "exchange_bytes": sum(lengths[r][i] for r, i in moved) * bytes_per_token,
            "all_gather_padded_bytes": (dp - 1) * dp * per_rank * width * bytes_per_token}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", default="2,4,8", help="comma-separated DP sizes")
    p.add_argument("--seqs-per-rank", type=int, default=128)
    p.add_argument("--mini-batches", type=int, default=4, help="PPO mini-batches per rollout batch")
    p.add_argument("--median", type=int, default=256, help="median sequence length (tokens)")
    p.add_argument("--cap", type=float, default=16.0, help="longest length, as a multiple of the median")
    p.add_argument("--bytes-per-token", type=int, default=20,
                   help="bytes a token carries in the exchange: int64 token and label, fp32 mask "
                        "and sampling log-prob")
    p.add_argument("--json", action="store_true", help="one JSON line per DP size")
    a = p.parse_args(argv)
    for dp in (int(x) for x in a.dp.split(",")):
        row = measure(dp, a.seqs_per_rank, a.mini_batches, a.median, a.cap, a.bytes_per_token)
        if a.json:
            print(json.dumps(row))
        else:
            print(f"DP={dp}: imbalance {row['imbalance_before']} -> {row['imbalance_after']}, "
                  f"{row['sequences_moved']} of {row['sequences']} sequences moved, "
                  f"{row['exchange_bytes'] / 2**20:.2f} MiB sent "
                  f"(padded all-gather: {row['all_gather_padded_bytes'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
