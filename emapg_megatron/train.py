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

from emapg_megatron import build, runtime
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.errors import CollectiveError, ConfigError, RunError
from emapg_megatron.metrics import MetricsLogger
from emapg_megatron.training import loop
from emapg_megatron.training.run_lock import lock_save_dir


def run(argv=None) -> int:
    runtime.quiet_expected_warnings()
    inputs = build.prepare(argv)  # every check that needs no process group: nothing runs yet
    cfg = inputs.config
    if cfg.launch.dry_run:  # a staged example's --load may not exist yet
        print(build.describe(inputs))
        return 0
    load, save, log = cfg.checkpoint.load, cfg.checkpoint.save, cfg.log
    if load:
        checkpointing.check_train_iters(cfg.loop.train_iters, load)
    runtime.initialize(cfg.parallel, cfg.loop.seed)
    save_lock = None
    try:
        save_lock = lock_save_dir(save) if save else None  # one run per --save directory
        trainer = build.build_trainer(inputs)
        start = loop.resume(load, trainer, cfg.flags()) if load else 0
        loop.log0(f"layout {build.layout(cfg.parallel, dist.get_world_size())}; "
                  f"training steps {start + 1}..{cfg.loop.train_iters}")
        logger = MetricsLogger(log.log_dir, cfg.loop.train_iters, tensorboard_dir=log.tensorboard_dir,
                               enabled=dist.get_rank() == 0, start_step=start,
                               log_interval=log.log_interval)
        try:
            loop.run_steps(cfg.loop, cfg.checkpoint, trainer, logger, start, cfg.flags())
        finally:
            png = logger.close()  # also after a stop on non-finite steps: the curves show it
        if png:
            loop.log0(f"metrics: {os.path.join(log.log_dir, 'metrics.jsonl')}; curves: {png}")
    finally:
        if save_lock is not None:
            save_lock.release()
        runtime.destroy()
    return 0


def main(argv=None) -> None:
    try:
        sys.exit(run(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as e:
        failure = CollectiveError(line) if (line := runtime.collective_failure(e)) else None
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: it would wait on the dead peer again


if __name__ == "__main__":
    main()
