"""Run a function on N local ranks with Megatron parallel_state set up.

Used by the tests and the benchmarks: ``run_distributed(fn, world_size=2,
tp=2)`` spawns 2 processes, initialises gloo (CPU) or nccl and parallel_state
with the given sizes in each, calls ``fn(*args)`` and returns each rank's
result, in rank order. A failing rank's traceback is re-raised in the caller;
a hang is killed after ``timeout`` seconds.

On CPU the ranks are forked from a forkserver that has imported torch, Megatron-Core and this
package once (:data:`PRELOAD`): a rank then starts in a fraction of a second instead of the
~4 s a spawned interpreter spends importing them, which was most of the test suite's time.
multiprocessing gives a forked rank the caller's ``sys.path`` and working directory at the
call; its environment would be the server's (that of the first call), so the caller's is
passed along. GPU runs spawn fresh interpreters: nothing that may initialise CUDA runs before
a fork.
"""

from __future__ import annotations

import io
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from emapg_megatron import runtime
from emapg_megatron.runtime.config import ParallelConfig

#: Imported once by the CPU forkserver, so that forked ranks start with them loaded.
PRELOAD = ["emapg_megatron.trainer", "emapg_megatron.multiprocess"]


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


def _worker(rank, world_size, port, cfg, seed, env, call, results):
    os.environ.clear()  # a forked rank starts with the forkserver's environment, not the caller's
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    runtime.quiet_expected_warnings()
    try:
        fn, args = pickle.loads(call)  # our caller's own objects; an import error is reported
        runtime.initialize(cfg, seed)
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


def _context(device: str):
    """A forkserver with :data:`PRELOAD` imported on CPU; fresh interpreters on a GPU."""
    if device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int = 2, *, tp: int = 1, pp: int = 1, args: tuple = (),
                    timeout: float = 300.0, device: str = "cpu", seed: int = 1234) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results in rank order.

    ``fn`` must be importable (a module-level function): the ranks import it by name.
    """
    cfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, device=device)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(world_size)))
    ctx = _context(device)
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, cfg, seed, dict(os.environ), call, results))
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
        failed = len(collected) < world_size  # the other ranks may wait in a collective for ever
        for p in procs:
            if failed:
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
