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
from emapg_megatron.metrics import MetricsLogger
from emapg_megatron.runtime import ConfigError
from emapg_megatron.training import checkpointing, loop
from emapg_megatron.training.run_lock import lock_save_dir


def run(argv=None) -> int:
    runtime.quiet_expected_warnings()
    inputs = build.prepare(argv)  # every check that needs no process group: nothing runs yet
    args = inputs.args
    if args.dry_run:  # a staged example's --load may not exist yet
        print(build.describe(inputs))
        return 0
    if args.load:
        checkpointing.check_train_iters(args.train_iters, args.load)
    runtime.initialize(arguments.parallel_config(args))
    save_lock = None
    try:
        save_lock = lock_save_dir(args.save) if args.save else None  # one run per --save directory
        trainer = build.build_trainer(inputs)
        start = loop.resume(args, trainer) if args.load else 0
        loop.log0(f"layout {build.layout(args, dist.get_world_size())}; "
                  f"training steps {start + 1}..{args.train_iters}")
        logger = MetricsLogger(args.log_dir, args.train_iters, tensorboard_dir=args.tensorboard_dir,
                               enabled=dist.get_rank() == 0, start_step=start,
                               log_interval=args.log_interval)
        try:
            loop.run_steps(args, trainer, logger, start)
        finally:
            png = logger.close()  # also after a stop on non-finite steps: the curves show it
        if png:
            loop.log0(f"metrics: {os.path.join(args.log_dir, 'metrics.jsonl')}; curves: {png}")
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
    except RuntimeError as e:
        line = runtime.collective_failure(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: it would wait on the dead peer again


if __name__ == "__main__":
    main()
