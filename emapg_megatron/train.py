"""EMA-PG / GRPO training on Megatron-Core.

    torchrun --nproc_per_node N -m emapg_megatron.train [--preset NAME] [--config F.yaml] [flags]

Top to bottom: parse and validate everything, load the prompts (no process group yet; bad input
stops here) -> init distributed and parallel state -> build the trainer -> resume -> the loop
(one RL step per iteration: rollout, rewards, advantages, old/anchor passes, loss, update, EMA;
log, checkpoint, stop on a signal) -> final checkpoint and curves.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from emapg_megatron import arguments, build, runtime
from emapg_megatron.configurable import trajectory_dests
from emapg_megatron.errors import CollectiveError, ConfigError, RunError, agreed
from emapg_megatron.run import loop
from emapg_megatron.run.metrics import MetricsLogger
from emapg_megatron.run.outputs import clear_earlier_run
from emapg_megatron.run.run_lock import lock_outputs
from emapg_megatron.training import prompt_cache
from emapg_megatron.training.collectives import on_rank0


def run(argv=None) -> int:
    runtime.quiet_expected_warnings()
    inputs = build.prepare(argv)  # every check that needs no process group: nothing runs yet
    cfg = inputs.config
    if cfg.launch.dry_run:  # a staged example's --load may not exist yet
        print(build.describe(inputs) if cfg.launch.dry_run == "json" else build.summarize(inputs))
        return 0
    load, save, log = cfg.checkpoint.load, cfg.checkpoint.save, cfg.log
    runtime.initialize(cfg.parallel, cfg.loop.seed)
    prompt_cache.release()  # every rank has read the node's prompts: its process group exists
    locks, trainer = [], None
    try:
        locks = lock_outputs(save, log.log_dir)  # one run per --save and per --log-dir
        on_rank0(lambda: arguments.validate_fresh_outputs(cfg))  # again, now that no other run can write them
        if cfg.checkpoint.overwrite and not load:
            cleared = on_rank0(lambda: clear_earlier_run(cfg.checkpoint, log))
            if cleared:
                loop.log0(f"--overwrite: deleted {cleared} of an earlier run")
        trainer = build.build_trainer(inputs)
        record = loop.RunRecord(cfg.flags(), build.model_metadata(inputs),
                                trajectory=trajectory_dests(type(cfg)))
        start = loop.resume(load, trainer.state, record) if load else 0
        loop.log0(f"layout {build.layout(cfg.parallel, dist.get_world_size())}; "
                  f"training steps {start + 1}..{cfg.loop.train_iters}")
        logger = MetricsLogger(log.log_dir, cfg.loop.train_iters, tensorboard_dir=log.tensorboard_dir,
                               enabled=dist.get_rank() == 0, start_step=start,
                               log_interval=log.log_interval, wandb_project=log.wandb_project,
                               wandb_name=log.wandb_exp_name, run_config=cfg.flags())
        try:
            loop.run_steps(cfg.loop, cfg.checkpoint, trainer, logger, start, record, log,
                           build.evaluation(inputs, trainer))
        finally:
            png = logger.close()  # also after a stop on non-finite steps: the curves show it
        if png:
            loop.log0(f"metrics: {log.metrics_path}; curves: {png}")
    finally:
        close = getattr(getattr(trainer, "engine", None), "close", None)
        if close is not None:  # vLLM's LoRA adapter folders
            close()
        for lock in locks:
            lock.release()
        runtime.destroy()
    return 0


def main(argv=None) -> None:
    sys.exit(run_checked(lambda: run(argv)))


def run_checked(fn) -> int:
    """``fn()``'s exit code, its errors reported in one line: bad input exits 2, a run that
    failed after it started 1, Ctrl-C before the steps 130. An error every rank raised alike is
    said by rank 0 only."""
    try:
        return fn() or 0
    except ConfigError as e:
        return _report(e, 2)
    except RunError as e:
        return _report(e, 1)
    except KeyboardInterrupt:
        return _report(agreed(RunError("interrupted before training started")), 130)
    except RuntimeError as e:
        failure = CollectiveError(line) if (line := runtime.collective_failure(e)) else None
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr, flush=True)
        runtime.end_child_processes()
        os._exit(1)  # no teardown: it would wait on the dead peer again


def _report(error: Exception, code: int) -> int:
    if not getattr(error, "agreed", False) or int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    main()
