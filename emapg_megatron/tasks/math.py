"""Math reasoning task: prompt, answer extraction, equivalence-checked reward.

Reward pipeline for one response:

1. **Extract** the final answer: the content of the last *complete* ``\\boxed{...}`` (or
   ``\\fbox{...}``; braces are matched, so nesting is fine; an unclosed, truncated ``\\boxed{``
   is skipped in favour of the previous complete one). When there is no boxed answer, the
   last number in the text (``-12``, ``3.5``, ``1,000``, ``3/4``). When several boxed answers
   appear, **the last one counts**. With ``think_end_tag`` (e.g. ``"</think>"``) set, only the
   text after the last such tag is searched, and a response without the tag has no answer.
2. **Fast path** (in process, no worker): normalised strings equal -> correct; both sides plain
   rationals (``0.5``, ``1/2``, ``\\frac{1}{2}``) that are equal -> correct; both plain integers
   that differ -> wrong.
3. Otherwise **math-verify** (``parse`` + ``verify``) decides, in a persistent worker process
   with a hard timeout. A check that exceeds it is killed, counts as wrong (0.0) and the
   worker is replaced; the run goes on.

``reward = 1.0 if correct else 0.0``, plus ``format_bonus`` when the response is well formatted
(a complete, non-empty ``\\boxed{}`` in the searched region). ``format_bonus`` is 0 by default.

The pool is a set of ``python -P`` subprocesses speaking JSON lines over pipes: no fork of the
trainer (safe with CUDA / torch.distributed), no re-import of the trainer's ``__main__``.
"""
from __future__ import annotations

import atexit
import collections
import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence, Union

from .base import Task, _iter_rows, as_messages, render_messages, render_prompt

logger = logging.getLogger(__name__)

__all__ = [
    "reward",
    "rewards",
    "is_correct",
    "correct_many",
    "extract_answer",
    "last_boxed",
    "last_number",
    "fast_check",
    "MathVerifierPool",
    "MathConfig",
    "MathTask",
    "default_pool",
    "configure_default_pool",
    "shutdown_default_pool",
    "require_math_verify",
]

GroundTruth = Union[str, Sequence[str]]

DEFAULT_TIMEOUT = 5.0
MAX_ANSWER_CHARS = 4000

# ----------------------------------------------------------------------------------------------
# dependency guard


_MV_FOUND = False  # cached positive lookup: find_spec costs ~50 us, a fast-path reward ~15 us


def require_math_verify() -> None:
    global _MV_FOUND
    if _MV_FOUND:
        return
    if importlib.util.find_spec("math_verify") is not None:
        _MV_FOUND = True
    else:
        raise ImportError(
            "the math reward needs math-verify: pip install 'emapg-megatron[math]' "
            "(or pip install math-verify)"
        )


# ----------------------------------------------------------------------------------------------
# answer extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")
_NUMBER_RE = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?![\w])|(?<![\w.])-?\.\d+"
)


def _brace_matches(text: str) -> dict[int, int]:
    """``{open index: close index}`` for every balanced ``{...}`` (``\\{``, ``\\}`` are literals).

    One linear pass, so a degenerate response with thousands of unclosed ``\\boxed{`` costs
    O(len) rather than O(len^2).
    """
    matches: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            matches[stack.pop()] = i
        i += 1
    return matches


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    found = list(_BOXED_RE.finditer(text))
    if not found:
        return None
    matches: Optional[dict[int, int]] = None
    for m in reversed(found):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            if matches is None:
                matches = _brace_matches(text)
            end = matches.get(i)
            if end is None:
                continue  # truncated: fall back to an earlier complete one
            return text[i + 1 : end].strip()
        if m.end() < len(text) and text[m.end()] in " \t":  # "\\boxed 5"
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0).rstrip(".")
    return None


def last_number(text: str) -> Optional[str]:
    """The last number in the text (``-12``, ``3.5``, ``1,000``, ``3/4``), or None."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return re.sub(r"\s+", "", found[-1])


def _region(response: str, think_end_tag: Optional[str]) -> Optional[str]:
    if think_end_tag:
        pos = response.rfind(think_end_tag)
        if pos < 0:
            return None
        return response[pos + len(think_end_tag) :]
    return response


def extract_answer(response: str, think_end_tag: Optional[str] = None) -> Optional[str]:
    """The final answer of a response (see the module docstring), or None."""
    region = _region(response, think_end_tag)
    if region is None:
        return None
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed if boxed else None
    return last_number(region)


def is_well_formatted(response: str, think_end_tag: Optional[str] = None) -> bool:
    region = _region(response, think_end_tag)
    if region is None:
        return False
    boxed = last_boxed(region)
    return bool(boxed)


def _gold_answer(gt: str) -> str:
    gt = str(gt).strip()
    if "\\boxed" in gt or "\\fbox" in gt:
        b = last_boxed(gt)
        if b:
            return b
    return gt


# ----------------------------------------------------------------------------------------------
# fast path

_SPACING_RE = re.compile(r"\\(?:left|right|displaystyle|,|;|:|!| |quad|qquad)(?![a-zA-Z])")


def _normalize(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$")
    s = _SPACING_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s


_INT_RE = re.compile(r"^[+-]?\d+$")
_DEC_RE = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+)$")
_SLASH_RE = re.compile(r"^([+-]?\d+)/(\d+)$")
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}$")
_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\frac(\d)(\d)$")


def _rational(s: str) -> Optional[tuple[Fraction, bool]]:
    """(value, is_integer_literal) for a plain rational literal, else None."""
    try:
        if _INT_RE.match(s):
            return Fraction(int(s)), True
        if _DEC_RE.match(s):
            return Fraction(s), False
        m = _SLASH_RE.match(s)
        if m and int(m.group(2)) != 0:
            return Fraction(int(m.group(1)), int(m.group(2))), False
        m = _FRAC_RE.match(s) or _FRAC_SHORT_RE.match(s)
        if m and int(m.group(3)) != 0:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return (-v if m.group(1) == "-" else v), False
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def fast_check(golds: Sequence[str], pred: str) -> Optional[bool]:
    """Decide easy cases without math-verify; None means "ask the verifier"."""
    pn = _normalize(pred)
    gns = [_normalize(g) for g in golds]
    if any(pn == g for g in gns):
        return True
    if len(pn) > 64:
        return None
    pr = _rational(pn)
    if pr is None:
        return None
    grs = [_rational(g) if len(g) <= 64 else None for g in gns]
    if any(gr is not None and gr[0] == pr[0] for gr in grs):
        return True
    if pr[1] and all(gr is not None and gr[1] for gr in grs):
        return False
    return None


# ----------------------------------------------------------------------------------------------
# worker pool

_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")
_BOOT = "import runpy,sys; sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


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
    Thread-safe (calls are serialised); a forked child must not reuse its parent's pool.
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
            env = os.environ.get("EMAPG_MATH_WORKERS")
            num_workers = int(env) if env else max(1, min(4, os.cpu_count() or 1))
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
        self._workers = [_Worker(self.startup_timeout) for _ in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self._workers)

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
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if os.getpid() != self._pid:
                return
            for w in self._workers:
                w.kill()

    def __enter__(self) -> "MathVerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


_DEFAULT_POOL: Optional[MathVerifierPool] = None
_DEFAULT_LOCK = threading.Lock()
_DEFAULT_KW: dict = {}


def default_pool() -> MathVerifierPool:
    """The process-wide pool used by :func:`reward` (created on first use)."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._closed or _DEFAULT_POOL._pid != os.getpid():
            if _DEFAULT_POOL is not None and _DEFAULT_POOL._pid != os.getpid():
                _DEFAULT_POOL._closed = True  # the parent's workers are not ours to kill
            _DEFAULT_POOL = MathVerifierPool(**_DEFAULT_KW)
        return _DEFAULT_POOL


def configure_default_pool(**kwargs: Any) -> None:
    """Set ``num_workers`` / ``timeout`` / ... of the default pool (restarts it if running)."""
    global _DEFAULT_KW
    _DEFAULT_KW = dict(kwargs)
    shutdown_default_pool()


def shutdown_default_pool() -> None:
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is not None:
            _DEFAULT_POOL.close()
            _DEFAULT_POOL = None


atexit.register(shutdown_default_pool)


# ----------------------------------------------------------------------------------------------
# public reward API


def _golds(ground_truth: GroundTruth) -> list[str]:
    if isinstance(ground_truth, (list, tuple)):
        items = [str(g) for g in ground_truth if g is not None and str(g).strip()]
    elif ground_truth is None:
        items = []
    else:
        items = [str(ground_truth)] if str(ground_truth).strip() else []
    return [_gold_answer(g) for g in items]


def _prepare(response: Any, ground_truth: GroundTruth, think_end_tag: Optional[str]):
    """(decided result or None, job or None)."""
    if not isinstance(response, str):
        return False, None
    golds = _golds(ground_truth)
    if not golds:
        return False, None
    ans = extract_answer(response, think_end_tag)
    if not ans or len(ans) > MAX_ANSWER_CHARS:
        return False, None
    fast = fast_check(golds, ans)
    if fast is not None:
        return fast, None
    return None, ([f"\\boxed{{{g}}}" for g in golds], f"\\boxed{{{ans}}}")


def correct_many(
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
    *,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
) -> list[bool]:
    """Correctness of each response; math-verify checks run in parallel over the pool."""
    require_math_verify()
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses for {len(ground_truths)} ground truths")
    out: list[bool] = [False] * len(responses)
    todo: list[int] = []
    jobs: list[tuple[list[str], str]] = []
    for i, (resp, gt) in enumerate(zip(responses, ground_truths)):
        try:
            decided, job = _prepare(resp, gt, think_end_tag)
        except Exception:  # extraction must never take the run down
            decided, job = False, None
        if job is None:
            out[i] = bool(decided)
        else:
            todo.append(i)
            jobs.append(job)
    if jobs:
        p = pool or default_pool()
        try:
            res = p.verify_many(jobs, timeout=timeout)
        except Exception:  # e.g. workers cannot start (fd/memory exhaustion): zero, don't crash
            logger.exception("math-verify pool failed; scoring %d pending checks as 0", len(jobs))
            res = [False] * len(jobs)
        for i, r in zip(todo, res):
            out[i] = r
    return out


def is_correct(
    response: str,
    ground_truth: GroundTruth,
    *,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
) -> bool:
    return correct_many([response], [ground_truth], think_end_tag=think_end_tag, timeout=timeout, pool=pool)[0]


def rewards(
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
    *,
    format_bonus: float = 0.0,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
) -> list[float]:
    """Batch version of :func:`reward` (parallel over the worker pool)."""
    ok = correct_many(responses, ground_truths, think_end_tag=think_end_tag, timeout=timeout, pool=pool)
    out = []
    for resp, c in zip(responses, ok):
        r = 1.0 if c else 0.0
        if format_bonus:
            try:
                if isinstance(resp, str) and is_well_formatted(resp, think_end_tag):
                    r += float(format_bonus)
            except Exception:
                pass
        out.append(r)
    return out


def reward(
    response: str,
    ground_truth: str,
    *,
    format_bonus: float = 0.0,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
) -> float:
    """1.0 if the final answer of ``response`` is equivalent to ``ground_truth`` else 0.0,
    plus ``format_bonus`` when the response has a complete non-empty ``\\boxed{}``.

    Never raises for any input and never blocks longer than ``timeout`` (default 5 s) on the
    equivalence check; raises ImportError only when math-verify is not installed.
    """
    return rewards(
        [response], [ground_truth], format_bonus=format_bonus, think_end_tag=think_end_tag,
        timeout=timeout, pool=pool,
    )[0]


# ----------------------------------------------------------------------------------------------
# the task

DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass
class MathConfig:
    #: appended to the question (DeepScaleR style)
    instruction: str = DEFAULT_INSTRUCTION
    #: "auto" | "always" | "never": use the tokenizer's chat template
    chat_template: str = "auto"
    system: Optional[str] = None
    #: template when no chat template is used
    plain_template: str = "{content}\n"
    format_bonus: float = 0.0
    think_end_tag: Optional[str] = None
    timeout: float = DEFAULT_TIMEOUT
    num_workers: Optional[int] = None
    fields: dict = field(default_factory=lambda: {
        "question": "problem", "ground_truth": "answer", "data_source": "data_source"})


class MathTask(Task):
    """Single-turn math: prompt = question + instruction, reward = :func:`reward`."""

    name = "math"
    multi_turn = False
    required_fields = ("question", "ground_truth")
    #: verl's layout (DeepScaleR, GSM8K as verl and the paper's reference code ship them)
    alternative_fields = {"question": "prompt", "ground_truth": "reward_model.ground_truth",
                          "data_source": "data_source"}

    def __init__(self, config: Optional[MathConfig] = None, **overrides: Any) -> None:
        require_math_verify()
        cfg = config or MathConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.default_fields = dict(cfg.fields)
        self._pool: Optional[MathVerifierPool] = None

    @property
    def pool(self) -> MathVerifierPool:
        if self._pool is None or self._pool._closed or self._pool._pid != os.getpid():
            self._pool = MathVerifierPool(num_workers=self.config.num_workers, timeout=self.config.timeout)
        return self._pool

    def normalize_row(self, row: dict) -> dict:
        gt = row.get("ground_truth")
        if isinstance(gt, (list, tuple)):
            gt = [str(g) for g in gt if g is not None]
            if not gt:
                raise ValueError("empty 'ground_truth'")
            row["ground_truth"] = gt[0] if len(gt) == 1 else json.dumps(gt)
        elif isinstance(gt, (int, float)):
            row["ground_truth"] = str(gt)
        elif not isinstance(gt, str):
            raise ValueError(f"ground_truth has type {type(gt).__name__}")
        row["question"] = as_messages(row["question"]) or str(row["question"])
        if not row.get("data_source"):
            row["data_source"] = os.path.splitext(row.get("_file") or "math")[0]
        return row

    @staticmethod
    def _gt(row: Mapping[str, Any]) -> GroundTruth:
        gt = row["ground_truth"]
        if isinstance(gt, str) and gt.startswith("[") and gt.endswith("]"):
            try:
                val = json.loads(gt)
                if isinstance(val, list):
                    return [str(v) for v in val]
            except json.JSONDecodeError:
                pass
        return gt

    def prompt(self, row: Mapping[str, Any], tokenizer: Any = None) -> str:
        messages = as_messages(row["question"])
        if messages is not None:  # verl-style chat prompt: it carries its own instruction
            return render_messages(messages, tokenizer, chat_template=self.config.chat_template)
        user = str(row["question"]).strip()
        if self.config.instruction:
            user = f"{user} {self.config.instruction}"
        return render_prompt(
            user, tokenizer, chat_template=self.config.chat_template, system=self.config.system,
            plain_template=self.config.plain_template,
        )

    def reward(self, response: str, row: Mapping[str, Any]) -> float:
        return self.rewards([response], [row])[0]

    def rewards(self, responses, rows) -> list[float]:
        rows = list(_iter_rows(rows))
        return rewards(
            responses, [self._gt(r) for r in rows], format_bonus=self.config.format_bonus,
            think_end_tag=self.config.think_end_tag, timeout=self.config.timeout, pool=self.pool,
        )

    def correct(self, response: str, row: Mapping[str, Any]) -> bool:
        return self.correct_many([response], [row])[0]

    def correct_many(self, responses, rows) -> list[bool]:
        rows = list(_iter_rows(rows))
        return correct_many(
            responses, [self._gt(r) for r in rows], think_end_tag=self.config.think_end_tag,
            timeout=self.config.timeout, pool=self.pool,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
