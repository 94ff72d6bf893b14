"""``emapg-train``: validate the run in one process, then start its ranks with torchrun.

    emapg-train --nproc-per-node 8 [--nnodes 2 --node-rank 0 --master-addr A --master-port P]
                [--standalone] TRAINER_FLAGS

Bad input is refused here, once, in one ``error:`` line with exit code 2, before any rank starts
(torchrun alone would print it once per rank, then its own report). The ranks then run
``python -m emapg_megatron.train`` under torchrun's agent (``torch.distributed.run``, in this
process). A rank that fails has printed its own line: the agent's report is not repeated, and the
exit code is the rank's. Ctrl-C (or SIGTERM) reaches the ranks, which finish their step, save
(with ``--save``) and exit; this process waits for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
default one hour) and exits 130 (143 for SIGTERM) without a traceback; Ctrl-C while the modules
still import is one line and 130 too.

Nothing of the run outlives this process: the ranks (in sessions of their own under torchrun) and
the processes they start end when it ends, however it ends (``runtime/lifetime.py``), and it is
the subreaper of what a dead rank leaves (:func:`adopt_orphans`).

Without ``--nproc-per-node`` (or under torchrun already) it is the trainer itself, in this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import tempfile

import psutil

from emapg_megatron.runtime.environment import environment
from emapg_megatron.runtime.lifetime import PARENT_ENV

#: torchrun's options this launcher takes (dash or underscore), and whether each takes a value.
#: Everything else is the trainer's (torchrun's own --log-dir is not among them: it is ours).
LAUNCHER_FLAGS = {"nproc-per-node": True, "nnodes": True, "node-rank": True, "master-addr": True,
                  "master-port": True, "standalone": False, "rdzv-backend": True,
                  "rdzv-endpoint": True, "rdzv-id": True, "max-restarts": True}
SHUTDOWN_TIMEOUT_S = 3600  # the ranks finish their step and save after Ctrl-C
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's flags) of ``argv``."""
    launcher, trainer, i = [], [], 0
    while i < len(argv):
        name, _, inline = argv[i].partition("=")
        key = name[2:].replace("_", "-") if name.startswith("--") else None
        if key in LAUNCHER_FLAGS:
            takes_value = LAUNCHER_FLAGS[key] and not inline
            launcher += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            trainer.append(argv[i])
            i += 1
    return launcher, trainer


def world_size(launcher: list[str]) -> int:
    """--nnodes x --nproc-per-node of torchrun's options (a fixed node count)."""
    from torch.distributed import run as torchrun

    args = torchrun.get_args_parser().parse_args([*launcher, "-m", "emapg_megatron.train"])
    low, high = torchrun.parse_min_max_nnodes(str(args.nnodes))
    if low != high:
        from emapg_megatron.errors import ConfigError

        raise ConfigError(f"--nnodes {args.nnodes}: emapg-train needs a fixed number of nodes")
    return high * int(args.nproc_per_node)


def validate(trainer: list[str], world: int) -> None:
    """Every check the ranks would make before their process group, here, for ``world`` ranks."""
    from emapg_megatron import build

    with environment(WORLD_SIZE=str(world)):
        build.prepare(trainer)



def adopt_orphans() -> None:
    """Make this process the subreaper of everything the ranks start (Linux): the checkpoint
    writers and results Manager of a rank that was killed are re-parented here, not to init, and
    :func:`end_descendants` ends them with the run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init as before
        pass


def end_descendants() -> None:
    """Kill whatever the ranks left running (the run is over: nothing of it may outlive it)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def run_ranks(launcher: list[str], trainer: list[str]) -> int:
    """torchrun's agent on ``python -m emapg_megatron.train TRAINER_FLAGS``; the exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet_torchrun_logs()
    timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    args = torchrun.parse_args([*launcher, "--shutdown-timeout", timeout, "-m", "emapg_megatron.train",
                                *trainer])
    adopt_orphans()
    try:
        with environment(**{PARENT_ENV: str(os.getpid())}):  # the ranks end with this process
            torchrun.run(args)
    except ChildFailedError as e:
        return failure_code(e.failures)
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        end_descendants()
    return 0


def quiet_torchrun_logs() -> None:
    """The agent's log lines (a rank's failure, a signal): the ranks say what happened themselves."""
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401  (its loggers)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def failure_code(failures: dict) -> int:
    """The first failed rank's exit code; a rank killed by a signal is reported in one line. A
    rank that exited with a code wins over ranks torchrun then stopped with SIGTERM."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode <= 0, item[0]))
    if failure.exitcode > 0:
        return failure.exitcode
    name = signal.Signals(-failure.exitcode).name if failure.exitcode < 0 else "an unknown cause"
    print(f"error: rank {rank} was stopped by {name} (out of memory, or killed)", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> None:
    try:
        code = launch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C while the trainer's modules import (10-30 s under load)
        print("error: interrupted before training started", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def launch(argv: list[str]) -> int:
    """Validate, then run the ranks (or, in one process, the trainer itself); the exit code."""
    launcher, trainer = split_argv(argv)
    from emapg_megatron import train

    if not launcher or "LOCAL_RANK" in os.environ or "-h" in trainer or "--help" in trainer:
        train.main(trainer)  # one process (or a rank torchrun started): the trainer itself
        return 0
    from emapg_megatron.training.prompt_cache import CACHE_DIR_ENV

    # (the ranks delete it once they have read it: prompt_cache.release)
    with tempfile.TemporaryDirectory(prefix="emapg-prompts-", ignore_cleanup_errors=True) as cache:
        os.environ[CACHE_DIR_ENV] = cache  # validation loads the prompts once; the ranks read them
        code = train.run_checked(lambda: validate(trainer, world_size(launcher)))
        return code or run_ranks(launcher, trainer)


if __name__ == "__main__":
    main()
