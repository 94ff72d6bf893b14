"""What one small collective costs between 2 CPU processes on gloo, between bursts of compute, as
inside a TP=2 decoding forward of the tiny-cpu model (issue 17's 256-vs-32 token ratio).

    OMP_NUM_THREADS=1 python tools/bench_gloo_latency.py --json

Each process alternates ``--compute-ms`` of small matmuls with one operation on a
``[rows, hidden]`` fp32 tensor, ``--iters`` times; a row is the added time per operation (the
loop's time per iteration minus the compute alone). ``pinned`` runs the same with each process
bound to its own core.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from emapg_megatron.multiprocess import free_port


def _ops(buf: torch.Tensor):
    """name -> one collective on ``x`` (between the two ranks)."""
    other = 1 - dist.get_rank()

    def exchange(x):  # what an all-reduce of 2 ranks needs: one send and one receive each
        recv = dist.irecv(buf, other)
        dist.isend(x, other).wait()
        recv.wait()
        x += buf

    return {"all_reduce": dist.all_reduce, "all_reduce_1_float": lambda x: dist.all_reduce(x[:1, :1].contiguous()),
            "send_recv_exchange": exchange, "barrier": lambda x: dist.barrier()}


def _rank(rank: int, port: int, args, pinned: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if pinned:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a, w = torch.randn(args.rows, args.hidden), torch.randn(args.hidden, args.hidden)
    reps = 1

    def compute():
        x = a
        for _ in range(reps):
            x = torch.tanh(x @ w)

    for _ in range(20):  # warm-up, then size the compute burst on the mean of 20 calls
        compute()
    while reps < 1e6:
        start = time.perf_counter()
        for _ in range(20):
            compute()
        if (time.perf_counter() - start) * 1e3 / 20 >= args.compute_ms:
            break
        reps *= 2
    x, buf = torch.randn(args.rows, args.hidden), torch.empty(args.rows, args.hidden)
    start = time.perf_counter()
    for _ in range(args.iters):
        compute()
    alone = (time.perf_counter() - start) / args.iters
    rows = {}
    for name, op in _ops(buf).items():
        for _ in range(args.iters // 5):  # warm-up
            compute()
            op(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            compute()
            op(x)
        rows[name] = round(((time.perf_counter() - start) / args.iters - alone) * 1e3, 3)
    if rank == 0:
        out.put({"pinned": pinned, "compute_ms": round(alone * 1e3, 3), "added_ms_per_op": rows})
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20, help="rows of the tensor (sequences being decoded)")
    p.add_argument("--hidden", type=int, default=64, help="its width (the tiny-cpu model's hidden size)")
    p.add_argument("--compute-ms", type=float, default=0.2, help="compute between two collectives")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json", action="store_true", help="one JSON object")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = []
    for pinned in (False, True):
        out = ctx.Queue()
        mp.start_processes(_rank, args=(free_port(), args, pinned, out), nprocs=2, start_method="spawn")
        results.append(out.get())
    report = {"cpus": os.cpu_count(), "rows": args.rows, "hidden": args.hidden, "runs": results}
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
