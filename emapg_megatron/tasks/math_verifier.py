"""math-verify in worker processes with a hard per-check timeout: :class:`MathVerifierPool`.

The pool is a set of ``python -P`` subprocesses running ``_math_worker.py`` and speaking JSON
lines over pipes: no fork of the trainer (safe with CUDA / torch.distributed), no re-import of
the trainer's ``__main__``. A pool belongs to whoever made it: :meth:`MathVerifierPool.close`
(or ``with``) stops its workers, and so does dropping the last reference to it.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT", "MathVerifierPool", "PoolStats", "default_num_workers",
           "require_math_verify"]

DEFAULT_TIMEOUT = 5.0
"""Seconds one check may take before it scores 0."""

_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")
_BOOT = "import runpy,sys; sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


@functools.cache  # a found module is remembered (find_spec costs ~50 us, a fast-path reward ~15 us)
def require_math_verify() -> None:
    """ImportError naming the extra when math-verify is not installed."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(
            "the math reward needs math-verify: pip install 'emapg-megatron[math]' "
            "(or pip install math-verify)"
        )


def default_num_workers() -> int:
    """$EMAPG_MATH_WORKERS, else min(4, CPUs)."""
    env = os.environ.get("EMAPG_MATH_WORKERS")
    return int(env) if env else max(1, min(4, os.cpu_count() or 1))


class _Worker:
    def __init__(self, startup_timeout: float) -> None:
        self.stderr = tempfile.TemporaryFile()
        cmd = [sys.executable]
        if sys.version_info >= (3, 11):
            cmd.append("-P")
        cmd += ["-u", "-c", _BOOT, _WORKER_PATH, str(os.getpid())]
        if threading.current_thread() is not threading.main_thread():
            cmd.append("--no-pdeathsig")  # PDEATHSIG would fire when this thread exits
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            bufsize=0,
            close_fds=True,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.dead = False
        self.jobs = 0
        self.start_deadline = time.monotonic() + startup_timeout

    def send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    def read_messages(self) -> list[dict]:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self.dead = True
            return []
        self.buf += chunk
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                try:
                    msgs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return msgs

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode(errors="replace")[-n:]
        except Exception:
            return ""

    def kill(self) -> None:
        try:
            self.proc.kill()
        except Exception:
            pass
        try:
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except Exception:
                pass
        self.dead = True


def _stop_workers(workers: list[_Worker], owner_pid: int) -> None:
    """Kill a pool's workers; a forked child leaves its parent's alone. The pool's finalizer:
    it holds the worker list, never the pool, so a dropped pool is collected and its workers go."""
    if os.getpid() != owner_pid:
        return
    for w in workers:
        w.kill()


@dataclass
class PoolStats:
    jobs: int = 0
    timeouts: int = 0  # hard timeouts: worker killed
    soft_timeouts: int = 0  # alarm fired inside the worker, worker kept
    errors: int = 0
    restarts: int = 0


class MathVerifierPool:
    """Persistent math-verify worker processes with a hard per-check timeout.

    ``verify_many(jobs)`` runs ``(golds, pred)`` checks in parallel over the workers and returns
    one bool per job, in order. A job that exceeds ``timeout`` seconds returns False, and its
    worker is killed and replaced (the replacement warms up in the background). Inside the
    worker a soft alarm at ``soft_fraction * timeout`` ends Python-level loops without a restart.
    Thread-safe (calls are serialised); a forked child must not reuse its parent's pool
    (:attr:`usable` says whether this process may).
    """

    def __init__(
        self,
        num_workers: Optional[int] = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        startup_timeout: float = 120.0,
        soft_fraction: float = 0.8,
        max_jobs_per_worker: int = 20000,
    ) -> None:
        require_math_verify()
        if num_workers is None:
            num_workers = default_num_workers()
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.timeout = float(timeout)
        self.startup_timeout = float(startup_timeout)
        self.soft_fraction = float(soft_fraction)
        self.max_jobs_per_worker = int(max_jobs_per_worker)
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._next_id = 0
        self._closed = False
        self._start_failures = 0
        self.max_start_failures = 3
        self._workers: list[_Worker] = []
        self._stop = weakref.finalize(self, _stop_workers, self._workers, self._pid)
        self._workers.extend(_Worker(self.startup_timeout) for _ in range(num_workers))

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def usable(self) -> bool:
        """Open, and made by this process (not inherited through a fork)."""
        return not self._closed and self._pid == os.getpid()

    def _replace(self, idx: int) -> None:
        self._workers[idx].kill()
        self._workers[idx] = _Worker(self.startup_timeout)
        self.stats.restarts += 1

    def warmup(self) -> None:
        """Block until every worker has started (optional: calls wait for a ready worker)."""
        with self._lock:
            while True:
                starting = [w for w in self._workers if not w.ready]
                if not starting:
                    return
                wait_s = min(w.start_deadline for w in starting) - time.monotonic()
                self._poll(starting, wait_s, {}, [])

    def ping(self, n: int = 100) -> float:
        """Mean seconds of one request/response round trip to a worker (IPC overhead only)."""
        self.warmup()
        t0 = time.perf_counter()
        self.verify_many([None] * n)  # type: ignore[list-item]
        return (time.perf_counter() - t0) / max(n, 1)

    def _poll(self, waiting: list[_Worker], wait_s: float, inflight: dict, results: list) -> None:
        poller = select.poll()
        by_fd = {}
        for w in waiting:
            poller.register(w.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            by_fd[w.fd] = w
        events = poller.poll(max(0, int(wait_s * 1000) + 1))
        for fd, _ in events:
            w = by_fd[fd]
            for msg in w.read_messages():
                if msg.get("ready"):
                    w.ready = True
                    self._start_failures = 0
                elif w in inflight and msg.get("i") == inflight[w][1]:
                    j = inflight.pop(w)[0]
                    results[j] = bool(msg.get("r"))
                    err = msg.get("e")
                    if err == "timeout":
                        self.stats.soft_timeouts += 1
                    elif err:
                        self.stats.errors += 1
                    w.jobs += 1
            if w.dead:
                idx = self._workers.index(w)
                if not w.ready:
                    self._startup_failed(idx, "exited during start-up")
                    continue
                self._start_failures = 0
                if w in inflight:
                    inflight.pop(w)
                    self.stats.errors += 1
                self._replace(idx)
        now = time.monotonic()
        for w in waiting:
            if not w.ready and not w.dead and now > w.start_deadline and w in self._workers:
                self._startup_failed(self._workers.index(w),
                                     f"did not start within {self.startup_timeout:.0f}s")

    def _startup_failed(self, idx: int, what: str) -> None:
        """Replace a worker that failed to start; give up after a few failures in a row."""
        w = self._workers[idx]
        tail = w.stderr_tail()
        self._start_failures += 1
        if self._start_failures >= self.max_start_failures:
            w.kill()
            self._workers[idx] = _Worker(self.startup_timeout)  # keep the pool usable later
            raise RuntimeError(f"math-verify worker {what} ({self._start_failures} times in a row):\n{tail}")
        logger.warning("math-verify worker %s; starting another:\n%s", what, tail)
        self._replace(idx)

    def verify_many(
        self, jobs: Sequence[tuple[Sequence[str], str]], timeout: Optional[float] = None
    ) -> list[bool]:
        """One bool per ``(golds, pred)`` job; never raises for bad inputs, never hangs."""
        hard = self.timeout if timeout is None else float(timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifierPool is closed")
            if os.getpid() != self._pid:
                raise RuntimeError("MathVerifierPool used in a forked child; create a new pool")
            inflight: dict[_Worker, tuple[int, int, float]] = {}
            try:
                return self._run(jobs, hard, inflight)
            except BaseException:
                # e.g. KeyboardInterrupt or a start-up failure: don't leave workers busy on
                # jobs nobody will collect
                for w in list(inflight):
                    if w in self._workers:
                        self._replace(self._workers.index(w))
                raise

    def _run(self, jobs, hard: float, inflight: dict) -> list[bool]:
        n = len(jobs)
        results = [False] * n
        pending = collections.deque(range(n))
        while pending or inflight:
            now = time.monotonic()
            for idx, w in enumerate(list(self._workers)):
                if not pending:
                    break
                if not w.ready or w in inflight:
                    continue
                j = pending.popleft()
                jid = self._next_id
                self._next_id += 1
                if jobs[j] is None:  # ping
                    msg = {"i": jid, "ping": True}
                else:
                    golds, pred = jobs[j]
                    msg = {"i": jid, "g": list(golds), "p": pred, "t": hard * self.soft_fraction}
                try:
                    w.send(msg)
                except (BrokenPipeError, OSError):
                    pending.appendleft(j)
                    self._replace(idx)
                    continue
                inflight[w] = (j, jid, now + hard)
                self.stats.jobs += 1
            waiting = [w for w in self._workers if w in inflight or not w.ready]
            if not waiting:
                continue
            deadlines = [d for (_, _, d) in inflight.values()]
            deadlines += [w.start_deadline for w in waiting if not w.ready]
            self._poll(waiting, min(deadlines) - now, inflight, results)
            now = time.monotonic()
            for w, (j, _, d) in list(inflight.items()):
                if now >= d:
                    inflight.pop(w)
                    results[j] = False
                    self.stats.timeouts += 1
                    logger.warning(
                        "math-verify check exceeded %.1fs; scored 0 and restarted the worker", hard
                    )
                    self._replace(self._workers.index(w))
            for idx, w in enumerate(list(self._workers)):
                if w.ready and w not in inflight and w.jobs >= self.max_jobs_per_worker:
                    self._replace(idx)  # bound sympy cache growth
        return results

    def close(self) -> None:
        """Stop the workers (a forked child only forgets its parent's pool)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop()

    def __enter__(self) -> "MathVerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
