"""Math-equivalence worker: runs ``math_verify`` in a separate process.

This file is self-contained on purpose (stdlib + ``math_verify`` only, no package-relative
imports): the pool in :mod:`emapg_megatron.tasks.math_verifier` starts it with
``python -P -c 'runpy.run_path(<this file>)'`` so the child never imports the trainer's
``__main__`` (the usual spawn/forkserver pitfall) and never sees ``tasks/math.py`` shadowing
the stdlib ``math`` module.

Protocol (one JSON object per line):
  child -> parent, once at start:  {"ready": true, "pid": <pid>}
  parent -> child:                 {"i": <job id>, "g": [<gold latex>, ...], "p": <pred latex>,
                                    "t": <soft timeout seconds>}
  child -> parent:                 {"i": <job id>, "r": <bool>, "e": <error or null>}
  parent -> child (probe):         {"i": <job id>, "ping": true}   (answered with "r": true)

The soft timeout is an ``ITIMER_REAL`` alarm around the whole job, so a check that loops in
Python ends with ``False`` and the worker lives on. A check stuck inside C (a huge integer
power, say) does not see the alarm; the parent's hard timeout kills the process instead.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any, Optional


class _SoftTimeout(BaseException):
    """Raised from the SIGALRM handler (BaseException so library ``except Exception`` won't eat it)."""


def _alarm(signum, frame):  # pragma: no cover - signal path
    raise _SoftTimeout()


_GOLD_CACHE: dict = {}
_GOLD_CACHE_MAX = 4096


def _parse(text: str):
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _parse_gold(text: str):
    hit = _GOLD_CACHE.get(text)
    if hit is None:
        hit = _parse(text)
        if len(_GOLD_CACHE) >= _GOLD_CACHE_MAX:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[text] = hit
    return hit


def verify_latex(golds: list[str], pred: str) -> bool:
    """True when ``pred`` (latex, usually ``\\boxed{...}``) is equivalent to any gold.

    No timeout of its own: call it under an alarm (the worker) or accept the risk.
    """
    from math_verify import verify

    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False
    for g in golds:
        gold_parsed = _parse_gold(g)
        if gold_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
            return True
    return False


def _handle(req: dict) -> dict:
    out: dict[str, Any] = {"i": req.get("i"), "r": False, "e": None}
    if req.get("ping"):  # round-trip probe: measures the IPC overhead alone
        out["r"] = True
        return out
    soft = float(req.get("t") or 0.0)
    try:
        if soft > 0:
            signal.setitimer(signal.ITIMER_REAL, soft)
        try:
            out["r"] = bool(verify_latex(list(req["g"]), str(req["p"])))
        finally:
            if soft > 0:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        out["e"] = "timeout"
    except RecursionError:
        out["e"] = "RecursionError"
    except Exception as e:  # any parser/verifier failure is a zero reward
        out["e"] = f"{type(e).__name__}: {e}"[:300]
    return out


def _set_pdeathsig() -> None:
    """Ask Linux to kill this worker if the parent dies (even mid-computation).

    Linux ties this to the parent *thread*, so the pool only asks for it when it starts workers
    from the main thread; otherwise a worker still exits on stdin EOF once it is idle.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def main(parent_pid: Optional[int] = None, pdeathsig: bool = True) -> None:
    if pdeathsig:
        _set_pdeathsig()
    if parent_pid is not None and os.getppid() != parent_pid:
        return  # parent already gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    signal.signal(signal.SIGALRM, _alarm)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    import math_verify  # noqa: F401  (import cost paid once, before "ready")

    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.write(json.dumps(_handle(req)) + "\n")
        out.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None, pdeathsig="--no-pdeathsig" not in sys.argv)
