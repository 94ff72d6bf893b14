"""One run per ``--save`` directory and per ``--log-dir``.

Rank 0 holds an exclusive POSIX record lock (``fcntl.lockf``) on ``SAVE/.emapg-run.lock`` (and
``LOG_DIR/.emapg-run.lock``: two runs appending to one metrics.jsonl interleave their steps, and
``--overwrite`` would delete a live run's metrics) for the run's lifetime and writes its PID (and
host) into it. A second run on the same directory fails in one line naming the directory and the
holder; ``--overwrite`` deletes nothing of a run that holds its lock. The kernel drops the lock when its holder exits,
however it exits, so a lock file left by a dead run never blocks (its stale PID is just
overwritten). A record lock belongs to the process, not to the open file: the writer processes
Megatron forks during a save do not inherit it, so writers that outlive a killed rank cannot hold
it (an ``flock`` would stay with them). Network file systems lock per host at best: two hosts
writing one shared directory are not detected everywhere.
"""

from __future__ import annotations

import fcntl
import os
import socket

from emapg_megatron.errors import ConfigError
from emapg_megatron.training.collectives import on_rank0

LOCK_NAME = ".emapg-run.lock"
_HELD: dict[str, int] = {}  # lock files this process holds -> their open file


class SaveDirLock:
    """The lock of one of a run's output directories (``flag`` names it in messages; ``what``:
    what two runs there would both write)."""

    def __init__(self, directory: str, flag: str = "--save", what: str = "checkpoint directory"):
        self.directory, self.flag, self.what = directory, flag, what
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> SaveDirLock:
        os.makedirs(self.directory, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in _HELD:  # a record lock does not conflict within its own process: say it here
            raise self._in_use(_read_holder(_HELD[key]))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise self._in_use(holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd, _HELD[key] = fd, fd
        return self

    def _in_use(self, holder: str) -> ConfigError:
        return ConfigError(f"{self.flag} {self.directory} is in use by another run ({holder}): two "
                           f"runs must not write the same {self.what}")

    def release(self) -> None:
        if self._fd is not None:
            _HELD.pop(os.path.realpath(self.path), None)
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SaveDirLock:
        return self.acquire() if not self.held else self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "pid unknown"


def lock_outputs(save: str | None, log_dir: str) -> list[SaveDirLock]:
    """Take the locks of ``--save`` (if any) and ``--log-dir`` (one lock when they are one folder)
    on global rank 0: all or none; every rank raises the same ConfigError when one is held
    elsewhere. Collective once the process group is up. Release them at the end of the run."""
    locks: dict[str, SaveDirLock] = {}
    if save:
        locks[os.path.realpath(save)] = SaveDirLock(save)
    locks.setdefault(os.path.realpath(log_dir), SaveDirLock(log_dir, "--log-dir", "metrics"))

    def take() -> None:
        try:
            for lock in locks.values():
                lock.acquire()
        except BaseException:
            for lock in locks.values():
                lock.release()
            raise

    on_rank0(take)
    return list(locks.values())


def lock_save_dir(directory: str) -> SaveDirLock:
    """Take the ``--save`` lock on global rank 0; every rank raises the same ConfigError when it
    is held elsewhere. Collective once the process group is up (call it on all ranks). Keep the
    returned lock for the run (``release()`` at the end, or let the process exit)."""
    lock = SaveDirLock(directory)

    def take() -> None:  # the lock itself (an open file) stays on rank 0
        lock.acquire()

    on_rank0(take)
    return lock
