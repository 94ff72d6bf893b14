"""A run's processes end with the process that started them (Linux).

torchrun starts each rank in a session of its own, so a rank outlives a launcher or a torchrun
killed with SIGKILL (and their process group): it would train on unsupervised, keep writing
checkpoints and hold the ``--save`` lock. A rank's own helpers (the results Manager and writers
Megatron starts during a save, spawned or forked) outlive a rank killed by the OOM killer. So
every process of a run asks the kernel for SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``), and ends at once if its parent has ended already:

* a rank (``TORCHELASTIC_RUN_ID`` set): its parent is torchrun's agent (emapg-train's launcher
  names itself in :data:`PARENT_ENV`, so a rank whose launcher died while it started ends too);
* a process a rank spawns that imports this package (multiprocessing's ``spawn`` re-imports the
  rank's main module, ``emapg_megatron.train``): :data:`PARENT_ENV` names the rank;
* a child forked from a bound process's main thread (multiprocessing's ``fork``): the fork hook.

The signal follows the *thread* that made the child: a child forked from another thread is not
bound (that thread may end before it). Nothing here imports torch: it runs when the package is
imported, before a rank's heavy imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_ENV = "EMAPG_PARENT_PID"
"""The pid of the process that started this one as part of a run (set for its children)."""

_hooked = False  # the fork hook is registered
_fork_parent = 0  # the pid forking from its main thread (0: a fork from another thread)


def end_with_parent() -> None:
    """Bind this process to its parent if it is part of a run (see the module doc); else nothing."""
    global _hooked
    expected = os.environ.get(PARENT_ENV) or (str(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else None)
    if expected is None or not sys.platform.startswith("linux"):
        return
    _bind(int(expected))
    os.environ[PARENT_ENV] = str(os.getpid())  # what this process spawns is bound to it
    if not _hooked:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hooked = True


def _bind(expected: int) -> None:
    """SIGKILL when the parent ends; end now if ``expected`` (the parent this process was started
    by) has ended already: it was re-parented before it could ask."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != expected and not alive(expected):
        _orphaned(expected)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it ended and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _orphaned(parent: int) -> None:
    try:
        print(f"error: process {os.getpid()} ends: the process that started it ({parent}) has ended",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr went with the parent
        pass
    os._exit(1)


def _before_fork() -> None:
    global _fork_parent
    _fork_parent = os.getpid() if threading.current_thread() is threading.main_thread() else 0


def _after_fork_in_child() -> None:
    if _fork_parent:  # forked from the main thread of a bound process
        _bind(_fork_parent)
        os.environ[PARENT_ENV] = str(os.getpid())
