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
``--help``, a misspelt flag and every check of the flags alone answer before torch is imported;
``--dry-run`` validates everything in this process and never starts a rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import tempfile
import threading

import psutil

from emapg_megatron.runtime.environment import environment
from emapg_megatron.runtime.lifetime import PARENT_ENV

#: torchrun's options this launcher takes (dash or underscore): the metavar of its value (None: it
#: takes none) and its help. Everything else is the trainer's (torchrun's own --log-dir is not among them: it is ours).
LAUNCHER_FLAGS = {
    "nproc-per-node": ("N", "Ranks to start on this node (torchrun's). The run's world size, --nnodes x "
                            "--nproc-per-node, must be TP x PP x DP. Without it emapg-train is one process."),
    "nnodes": ("M", "Nodes of the run (a fixed number); start emapg-train on each with its own --node-rank."),
    "node-rank": ("R", "This node's rank among the --nnodes (0 .. nnodes - 1)."),
    "master-addr": ("ADDR", "Address of node 0 for the static rendezvous (with --master-port)."),
    "master-port": ("PORT", "A free port on node 0 (default 29500)."),
    "standalone": (None, "One node, with a free port and a local rendezvous chosen for you (the CPU "
                         "examples use it)."),
    "rdzv-backend": ("NAME", "torchrun's rendezvous backend (e.g. c10d) instead of --master-addr/--master-port."),
    "rdzv-endpoint": ("HOST:PORT", "Where the rendezvous is (with --rdzv-backend)."),
    "rdzv-id": ("ID", "The job's id at the rendezvous: the same on every node."),
    "max-restarts": ("K", "Times torchrun restarts the ranks after a failure (default 0)."),
}
SHUTDOWN_TIMEOUT_S = 3600  # the ranks finish their step and save after Ctrl-C
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's flags) of ``argv``."""
    launcher, trainer, i = [], [], 0
    while i < len(argv):
        name, _, inline = argv[i].partition("=")
        key = name[2:].replace("_", "-") if name.startswith("--") else None
        if key in LAUNCHER_FLAGS:
            takes_value = LAUNCHER_FLAGS[key][0] is not None and not inline
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


def run_ranks(launcher: list[str], trainer: list[str], save: str | None = None) -> int:
    """torchrun's agent on ``python -m emapg_megatron.train TRAINER_FLAGS``; the exit code.

    Ctrl-C and SIGTERM are this process's to handle (:class:`StopRequests`), not the agent's: the
    agent would send them to each rank's whole process group, killing the writer processes of a
    checkpoint being saved along with the rank."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from emapg_megatron.run.loop import LAUNCHED_ENV

    quiet_torchrun_logs()
    timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    args = torchrun.parse_args([*launcher, "--shutdown-timeout", timeout, *AGENT_SIGNALS,
                                "-m", "emapg_megatron.train", *trainer])
    adopt_orphans()
    os.environ[LAUNCHED_ENV] = "1"  # the ranks leave saying what a signal does to this process
    stops = StopRequests(save).install()
    try:
        with environment(**{PARENT_ENV: str(os.getpid())}):  # the ranks end with this process
            torchrun.run(args)
    except ChildFailedError as e:
        if stops.second is None:
            return failure_code(e.failures)
    finally:
        end_descendants()
    if stops.second is not None:
        say_stopped_at_once(stops.second, save)
    return 128 + stops.first if stops.first is not None else 0


#: The signals torch's elastic agent turns into its own shutdown, which sends them to whole process
#: groups: not Ctrl-C and SIGTERM (see :class:`StopRequests`).
AGENT_SIGNALS = ("--signals-to-handle", "SIGHUP,SIGQUIT")


class StopRequests:
    """The run's Ctrl-C / SIGTERM: the first is said at once and passed to each rank process alone
    (it finishes its step, saves with ``--save`` and exits); a second kills the run at once."""

    def __init__(self, save: str | None):
        self.save = save
        self.first: int | None = None
        self.second: int | None = None

    def install(self) -> StopRequests:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)
        return self

    def __call__(self, signum, frame) -> None:
        if self.first is None:
            self.first = signum
            say_stopping(signum, self.save)
            for rank in psutil.Process().children():  # the ranks, not their helpers
                with contextlib.suppress(psutil.Error):
                    rank.send_signal(signum)
        elif self.second is None:
            self.second = signum
            end_descendants()


def signal_key(sig) -> str:
    """How the user sent it: ``Ctrl-C (SIGINT)``, ``SIGTERM``, ..."""
    name = signal.Signals(sig).name
    return f"Ctrl-C ({name})" if sig == signal.SIGINT else name


def say_stopping(sig, save: str | None) -> None:
    """The first signal, at once (unbuffered: it may arrive while anything is being printed)."""
    key = signal_key(sig).split(" ")[0]
    what = f"saves a checkpoint in {save} and stops" if save else "stops (no --save: nothing is saved)"
    os.write(2, f"{signal_key(sig)} received: each rank finishes the step it is in, {what}; "
                f"{key} again stops at once{', without that checkpoint' if save else ''}\n".encode())


def say_stopped_at_once(sig, save: str | None) -> None:
    """After a second signal: what is left of the run's checkpoints."""
    from emapg_megatron.checkpoint.paths import discard_partial_saves, latest_complete

    last = None
    if save and os.path.isdir(save):
        discard_partial_saves(save)  # the ranks are gone: a half-written step is no checkpoint
        last = latest_complete(save)
    print(f"error: stopped at once by a second {signal_key(sig)}, without a checkpoint of this step; "
          f"the last complete checkpoint: {last or 'none'}", file=sys.stderr, flush=True)


def quiet_torchrun_logs() -> None:
    """The agent's log lines (a rank's failure): the ranks say what happened themselves."""
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


def help_text() -> str:
    """The trainer's flags (generated from its configs) and the launcher's, without torch."""
    from emapg_megatron import arguments

    parser = arguments.build_parser()
    group = parser.add_argument_group("torchrun", "emapg-train's launch options (anywhere among the "
                                                  "trainer's flags; torchrun takes them as they are)")
    for name, (metavar, text) in LAUNCHER_FLAGS.items():
        group.add_argument(f"--{name}", help=text,
                           **({"metavar": metavar} if metavar else {"action": "store_true"}))
    return parser.format_help()


def check_flags(trainer: list[str]):
    """The trainer's flags parsed and checked on their own (no torch): one ``error:`` line and exit
    code 2 for a misspelt flag or a bad value, at once."""
    from emapg_megatron import arguments
    from emapg_megatron.errors import ConfigError

    try:
        return arguments.parse_args(trainer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


class InterruptsBeforeStart:
    """Ctrl-C before the ranks start: a KeyboardInterrupt as usual, and remembered, because some of
    megatron-core's imports swallow it (a bare ``except:`` around an optional import): :meth:`check`
    raises it again once those imports are done. The ranks' start replaces it (StopRequests)."""

    def __init__(self):
        self.received = False

    @contextlib.contextmanager
    def installed(self):
        """Ours for the block (in the main thread: the only one that can take a handler)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    def __call__(self, signum, frame) -> None:
        self.received = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    try:
        with InterruptsBeforeStart().installed() as interrupts:
            code = launch(list(sys.argv[1:] if argv is None else argv), interrupts)
    except KeyboardInterrupt:  # Ctrl-C while the trainer's modules import (10-30 s under load)
        print("error: interrupted before training started", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def launch(argv: list[str], interrupts: InterruptsBeforeStart) -> int:
    """Validate, then run the ranks (or, in one process, the trainer itself); the exit code."""
    launcher, trainer = split_argv(argv)
    if "-h" in trainer or "--help" in trainer:
        print(help_text())
        return 0
    cfg = check_flags(trainer)
    from emapg_megatron import train

    interrupts.check()
    if cfg.launch.dry_run or not launcher or "LOCAL_RANK" in os.environ:
        # one process (a dry run, or a rank torchrun started): the trainer itself; the dry run of a
        # launch checks the layout that launch would have
        layout = ({"WORLD_SIZE": str(world_size(launcher))} if cfg.launch.dry_run and launcher
                  and "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ else {})
        with environment(**layout):
            train.main(trainer)
        return 0
    from emapg_megatron.training.prompt_cache import CACHE_DIR_ENV

    # (the ranks delete it once they have read it: prompt_cache.release)
    with tempfile.TemporaryDirectory(prefix="emapg-prompts-", ignore_cleanup_errors=True) as cache:
        os.environ[CACHE_DIR_ENV] = cache  # validation loads the prompts once; the ranks read them

        def checks() -> None:
            validate(trainer, world_size(launcher))
            interrupts.check()

        code = train.run_checked(checks)
        return code or run_ranks(launcher, trainer, cfg.checkpoint.save)


if __name__ == "__main__":
    main()
