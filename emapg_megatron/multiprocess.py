"""Run a function on N local ranks with Megatron parallel_state set up.

Used by the tests and the benchmarks: ``run_distributed(fn, world_size=2,
tp=2)`` spawns 2 processes, initialises gloo (CPU) or nccl and parallel_state
with the given sizes in each, calls ``fn(*args)`` and returns each rank's
result, in rank order. A failing rank's traceback is re-raised in the caller;
a hang is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from emapg_megatron import runtime
from emapg_megatron.runtime import ParallelConfig


class RankError(RuntimeError):
    """A rank raised: carries that rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(rank, world_size, port, cfg, fn, args, results):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads_per_rank(world_size))
    runtime.quiet_expected_warnings()
    try:
        runtime.initialize(cfg)
        out = fn(*args)
        results.put((rank, True, _to_bytes(out)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            runtime.destroy()
        except Exception:  # noqa: BLE001 - best effort after a failure
            pass


def _check_alive(procs, collected, deadline: float, timeout: float) -> None:
    """A rank that died without reporting (segfault, OOM kill) fails the run at once."""
    for rank, p in enumerate(procs):
        if rank not in collected and p.exitcode not in (None, 0):
            raise RankError(f"rank {rank} died with exit code {p.exitcode} before reporting")
    if time.monotonic() > deadline:
        raise TimeoutError(f"distributed run timed out after {timeout}s; ranks done: {sorted(collected)}")


def run_distributed(fn, world_size: int = 2, *, tp: int = 1, pp: int = 1, args: tuple = (),
                    timeout: float = 300.0, device: str = "cpu", seed: int = 1234) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results in rank order.

    ``fn`` must be importable (a module-level function) because ranks are spawned.
    """
    cfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         device=device, seed=seed)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(world_size)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, cfg, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                _check_alive(procs, collected, deadline, timeout)
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
