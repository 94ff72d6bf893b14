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

:func:`launch_ranks` runs a program (``main(*args)``, e.g. the trainer's ``run``) on ranks
forked the same way, with torchrun's environment and no process group (the program makes its
own), each rank's output captured and its exit code returned as torchrun would: what a test of
that program needs of ``torchrun``, without its agent and one fresh interpreter per rank.
:func:`preload` adds what such a program imports to the server's preload.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue as queue_mod
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import wait as wait_for

import torch
import torch.multiprocessing as mp

from emapg_megatron import runtime
from emapg_megatron.runtime.config import ParallelConfig

#: Imported once by the CPU forkserver, so that forked ranks start with them loaded.
PRELOAD = ["emapg_megatron.trainer", "emapg_megatron.multiprocess"]


def preload(*modules: str) -> None:
    """Have the CPU forkserver import ``modules`` too when it starts (a caller whose ranks run a
    higher layer, e.g. the trainer's entry point), so that no rank imports them itself. No effect
    on a server already running."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


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


def _failure(procs, collected, failed: int, payload: str, grace: float = 5.0) -> RankError:
    """The error of a run in which rank ``failed`` reported ``payload``. A peer that died without
    reporting is named first: its death is likely what made this rank fail (a collective with it,
    or the store it hosted, broke), and its exit code may reach us a moment after this report. So
    wait up to ``grace`` seconds for every other rank to report or exit."""
    deadline = time.monotonic() + grace
    while True:
        others = [(r, p) for r, p in enumerate(procs) if r != failed and r not in collected]
        dead = [(r, p.exitcode) for r, p in others if p.exitcode not in (None, 0)]
        if dead:
            rank, code = dead[0]
            return RankError(f"rank {rank} died with exit code {code} before reporting (rank {failed} "
                             f"failed too:\n{payload})")
        if all(p.exitcode is not None for _, p in others) or time.monotonic() > deadline:
            return RankError(f"rank {failed} failed:\n{payload}")
        time.sleep(0.05)


def _context(device: str):
    """A forkserver with :data:`PRELOAD` imported on CPU; fresh interpreters on a GPU."""
    if device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


#: Launches tried when rank 0 finds the rendezvous port taken: :func:`free_port` closes the port
#: it found before rank 0 binds it, and another process (a suite beside this one) may take it.
PORT_TRIES = 3


def run_distributed(fn, world_size: int = 2, *, tp: int = 1, pp: int = 1, ep: int = 1, args: tuple = (),
                    timeout: float = 300.0, device: str = "cpu", seed: int = 1234) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks (``ep``: expert-parallel size); return the
    results in rank order.

    ``fn`` must be importable (a module-level function): the ranks import it by name. A launch
    whose rendezvous port was taken meanwhile (before any rank ran ``fn``) starts again on another.
    """
    cfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, device=device)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(world_size)))
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _launch(fn, args, world_size, cfg, timeout, device, seed, free_port())
        except RankError as e:
            if attempt == PORT_TRIES or not _port_taken(str(e)):
                raise


def _port_taken(error: str) -> bool:
    """Whether a rank failed creating the rendezvous store on a port in use."""
    return "EADDRINUSE" in error and "init_process_group" in error


def _launch(fn, args: tuple, world_size: int, cfg: ParallelConfig, timeout: float, device: str, seed: int,
            port: int) -> list:
    ctx = _context(device)
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
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
                raise _failure(procs, collected, rank, payload)
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


# --- programs on ranks, as torchrun starts them ---------------------------------------------------
def _launched_rank(rank, world_size, port, run_id, env, cwd, logs, call):
    """A rank as torchrun starts one: its environment, its own stdout/stderr files, the program's
    exit code as the process's. In its own process group, so that whatever it leaves running
    (checkpoint writers, a results Manager) is ended with the run."""
    os.setpgid(0, 0)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "out"), (2, "err")):
        out = os.open(os.path.join(logs, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_NAME="default", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                      TORCHELASTIC_MAX_RESTARTS="0")
    if cwd is not None:
        os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or threads_per_rank(world_size)))
    try:
        main, args = pickle.loads(call)
        code = main(*args)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what an interpreter does with an uncaught error
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def _end_group(pid: int) -> None:
    """Kill what is left of a rank's process group (the rank itself and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:  # the rank was killed before it got there
        return ""


def launch_ranks(main, nproc: int, *, args: tuple = (), timeout: float = 300.0, env: dict | None = None,
                 cwd: str | None = None, stop_grace: float = 5.0,
                 name: str = "ranks") -> subprocess.CompletedProcess:
    """Run ``main(*args)`` as the program of ``nproc`` ranks started as torchrun starts them;
    return what ``subprocess.run`` on ``torchrun`` would.

    Each rank is forked from the CPU forkserver (:func:`_context`) with the caller's environment
    (or ``env``) plus torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT`` of a free port, ``TORCHELASTIC_RUN_ID`` of this run, ...) and
    no process group: ``main`` initialises what it needs. Its exit code is ``main``'s return
    value (or ``SystemExit`` code; an uncaught error prints its traceback and exits 1, as an
    interpreter does). stdout and stderr are each rank's, in rank order. ``returncode`` is the
    first rank's (in rank order) that exited with a code; a rank killed by a signal makes it 1
    and says so in one line, as ``emapg-train`` does. Once a rank has failed, the others get
    ``stop_grace`` seconds to end on their own (a peer waiting in a collective would wait for
    ever), then are killed, as torchrun's agent stops them. Past ``timeout`` every rank is killed
    and :class:`subprocess.TimeoutExpired` raised. Nothing a rank started outlives the call.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    ctx = _context("cpu")
    call = pickle.dumps((main, args))
    port, run_id = free_port(), f"emapg-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="emapg-ranks-") as logs:
        procs = [ctx.Process(target=_launched_rank, args=(r, nproc, port, run_id, env, cwd, logs, call),
                             name=f"{name}-rank{r}") for r in range(nproc)]
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            for p in procs:
                p.start()
            while True:
                alive = [p for p in procs if p.exitcode is None]
                if not alive:
                    break
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline:
                    raise subprocess.TimeoutExpired(name, timeout, *_outputs(procs, logs))
                if failed_at is not None and now > failed_at + stop_grace:
                    for p in alive:
                        p.kill()
                wait_for([p.sentinel for p in alive], timeout=0.5)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join(timeout=10)
                if p.pid is not None:
                    _end_group(p.pid)
        stdout, stderr = _outputs(procs, logs)
    codes = [p.exitcode for p in procs]
    returncode = next((c for c in codes if c > 0), 0)
    if not returncode and any(c < 0 for c in codes):
        rank = next(r for r, c in enumerate(codes) if c < 0)
        stderr += f"error: rank {rank} was stopped by {signal.Signals(-codes[rank]).name}\n"
        returncode = 1
    return subprocess.CompletedProcess(name, returncode, stdout, stderr)


def _outputs(procs, logs: str) -> tuple[str, str]:
    return ("".join(_read(os.path.join(logs, f"{r}.out")) for r in range(len(procs))),
            "".join(_read(os.path.join(logs, f"{r}.err")) for r in range(len(procs))))
