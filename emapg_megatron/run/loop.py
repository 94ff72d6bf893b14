"""The training loop: steps, logging, checkpoints, and a clean stop on a signal.

Checkpoint state is the trainer's :class:`~emapg_megatron.step.state.TrainState` (``trainer.state``:
``sharded_state_dict``, ``common_state_dict``, ``load_state_dict``); this module decides when to
save and how to resume. A step gives its metrics and samples as a record (``trainer.step(i)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core import parallel_state as ps

from emapg_megatron import runtime
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.checkpoint.convert import METADATA
from emapg_megatron.errors import RunError, SkippedStepsError, agreed
from emapg_megatron.run.config import CheckpointConfig, LogConfig, LoopConfig
from emapg_megatron.training.collectives import (
    any_true_each,
    gather_objects_to_first,
    on_rank0,
)
from emapg_megatron.training.optimizer_step import check_weights


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


@dataclass
class RunRecord:
    """What each checkpoint of a run records besides the training state."""

    flags: dict = field(default_factory=dict)
    """The run's flags (``RunConfig.flags()``): a resume says which ones changed its trajectory."""
    model: dict | None = None
    """The converter's model metadata (``checkpoint.convert.METADATA``): a checkpoint exports to
    HF on its own (``emapg-convert mcore-to-hf --load SAVE``)."""
    trajectory: tuple[str, ...] = ()
    """The flags (dests) whose change on resume changes the data order or the samples: the run
    then no longer follows the uninterrupted one, which a resume otherwise reproduces exactly
    (the options declared ``trajectory=True``: ``configurable.trajectory_dests``)."""

    def files(self) -> dict[str, str]:
        return {METADATA: json.dumps(self.model, indent=2) + "\n"} if self.model else {}


def save(state, root: str, iteration: int, record: RunRecord | None = None) -> None:
    """A checkpoint of step ``iteration`` (``state``: a ``TrainState``) under ``root``, never of
    non-finite or exploded weights."""
    record = record or RunRecord()
    check_weights(state.model_chunks, f"before saving step {iteration}")
    checkpointing.check_finite_before_save(state.model_chunks, state.anchor, iteration)
    common = {"iteration": iteration, **state.common_state_dict(),
              "args": json.dumps(record.flags, default=str)}
    with stop_signals_held():
        path = checkpointing.save(root, iteration, state.sharded_state_dict(), common, record.files())
    log0(f"saved checkpoint {path}")


@contextlib.contextmanager
def stop_signals_held():
    """SIGINT and SIGTERM held back (blocked, not lost) for the block: torchrun sends a stop signal
    to each rank's whole process group, and the writer and results-manager processes Megatron
    starts during a save inherit the blocked mask, so they finish the save instead of dying with
    it; the rank takes the signal (:class:`StopFlag`) when the save is done."""
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def changed_trajectory_flags(saved: dict, flags: dict, trajectory: tuple[str, ...]) -> list[str]:
    """``--flag old -> new`` for each of the ``trajectory`` flags that differs from the saved run
    (the checkpoint keeps its flags as strings)."""
    return [f"--{k.replace('_', '-')} {saved[k]} -> {flags[k]}" for k in trajectory
            if k in saved and k in flags and str(saved[k]) != str(flags[k])]


def resume(root: str, state, record: RunRecord | None = None) -> int:
    """Load the latest checkpoint under ``root`` (--load) into ``state`` (a ``TrainState``);
    returns its step. Warns when the run's flags (``record``) change the trajectory the
    checkpoint's run followed."""
    record = record or RunRecord()
    iteration = checkpointing.agreed_latest_iteration(root)
    state.prepare_to_load(checkpointing.iteration_dir(root, iteration))
    loaded = checkpointing.load(root, state.sharded_state_dict(is_loading=True), iteration)
    state.load_state_dict(loaded)
    log0(f"resumed from {root} at step {iteration}{state.resume_note()}")
    saved = json.loads(loaded["common"].get("args", "{}"))
    if changed := changed_trajectory_flags(saved, record.flags, record.trajectory):
        log0(f"warning: resumed with other settings than the checkpoint's ({'; '.join(changed)}): "
             "data order and samples differ from the uninterrupted run")
    return iteration


class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step,
    however long the step and the save take (the ranks agree on it after each step).

    Nothing here waits for a dead peer: collectives time out (--distributed-timeout-minutes). A
    signal again more than :attr:`REPEAT_S` after the first exits at once, without a checkpoint;
    one sooner is the same request delivered twice (Ctrl-C reaches a worker from the terminal and
    again from torchrun). Global rank 0 says each at once, in one line for the run, unless
    ``emapg-train`` started the ranks: it says them itself (it knows the signal the user sent).
    """

    REPEAT_S = 5.0

    def __init__(self, save: str | None = None):
        self.requested_at: float | None = None
        self.step = 0  # the step in progress, set by the loop
        self.save = save
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        now, name = time.monotonic(), signal.Signals(signum).name
        if self.requested_at is None:
            self.requested_at = now
            then = f", then saving a checkpoint in {self.save}" if self.save else " (no --save: nothing is saved)"
            _say(f"{name} received: finishing step {self.step}{then} and stopping; {name} again, "
                 f"{self.REPEAT_S:g} s or more later, stops at once without {'it' if self.save else 'waiting'}")
        elif now - self.requested_at > self.REPEAT_S:
            _say(f"error: stopped at once by a second {name}, without a checkpoint of step {self.step}")
            runtime.end_child_processes()
            os._exit(1)

    @property
    def requested(self) -> bool:
        """Whether this rank got the signal (the ranks agree on it after each step)."""
        return self.requested_at is not None


#: Set by emapg-train for the ranks it starts: it says what a signal does, for the whole run.
LAUNCHED_ENV = "EMAPG_LAUNCHED"


def _say(line: str) -> None:
    """One line for the run from a signal handler: global rank 0's, unbuffered (the handler may
    interrupt a print), none under emapg-train (which says it)."""
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(LAUNCHED_ENV):
        os.write(2, (line + "\n").encode())


def _raise(error: Exception):
    raise error


def gathered_samples(samples: list) -> list:
    """A step's ``(prompt, response, reward)`` of every DP rank, on global rank 0 (one
    model-parallel rank per DP rank holds them: they are alike across the group)."""
    if ps.get_tensor_model_parallel_rank() or ps.get_pipeline_model_parallel_rank():
        return []
    per_rank = gather_objects_to_first(samples, ps.get_data_parallel_group())
    return [s for samples in per_rank or [] for s in samples]


def run_steps(loop: LoopConfig, ckpt: CheckpointConfig, trainer, logger, start: int,
              record: RunRecord | None = None, log: LogConfig | None = None, evaluate=None) -> int:
    """Steps ``start + 1 ..`` --train-iters, a checkpoint (with ``record``) on the interval, at the
    end and on a signal; ``evaluate(step)`` adds its metrics (held-out Pass@k) to a step's.
    Returns the last step run."""
    stop = StopFlag(ckpt.save)
    iteration, said_zero_variance = start, False
    for iteration in range(start + 1, loop.train_iters + 1):
        stop.step = iteration
        result = trainer.step(iteration)
        metrics = result.metrics
        if evaluate is not None:
            metrics.update(evaluate(iteration))
        logger.log(iteration, metrics)
        if log is not None and log.dumps_rollouts(iteration):
            logger.dump_rollouts(iteration, gathered_samples(result.samples))
        if metrics.get("zero_std_group_frac") == 1.0 and not said_zero_variance:  # once a run
            logger.warn(f"step {iteration}: every prompt's samples got one reward: no advantage, only the "
                        "KL and entropy terms train (zero_std_group_frac, logged each step, says how often)")
            said_zero_variance = True
        if trainer.state.skipped_steps > loop.max_skipped_steps:
            raise agreed(SkippedStepsError(
                f"stopping: {trainer.state.skipped_steps} steps skipped for non-finite loss or gradients "
                f"(--max-skipped-steps {loop.max_skipped_steps})"))
        stopping, log_failed = any_true_each(stop.requested, logger.failure is not None)
        if log_failed:  # only rank 0 writes the logs: every rank stops with its reason
            on_rank0(lambda: _raise(RunError(logger.failure)))
        if ckpt.save and (stopping or ckpt.due(iteration)):
            save(trainer.state, ckpt.save, iteration, record)
        if stopping:
            log0(f"signal received: stopped after step {iteration}")
            return iteration
    ran = iteration > start  # a resume at --train-iters runs nothing: its checkpoint is the latest
    if ran and ckpt.save and not ckpt.due(iteration):
        save(trainer.state, ckpt.save, iteration, record)
    return iteration


