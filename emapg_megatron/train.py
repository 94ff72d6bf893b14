"""EMA-PG / GRPO training on Megatron-Core.

    torchrun --nproc_per_node N -m emapg_megatron.train [--preset NAME] [--config F.yaml] [flags]

Top to bottom: parse and validate (no process group yet) -> init distributed + parallel
state -> build model, optimizer, LR schedule, EMA anchor, sampler -> resume -> loop over
steps (log, checkpoint, stop on signal) -> final checkpoint and curves.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from emapg_megatron import arguments, runtime
from emapg_megatron.runtime import ConfigError


# --- tokenizer, task and model shape (no process group needed) -------------------------
def build_tokenizer_and_task(args):
    if args.task == "synthetic-copy":
        from emapg_megatron.tasks.synthetic import CharTokenizer, CopyTask

        return CharTokenizer(), CopyTask(seed=args.seed)
    from transformers import AutoTokenizer

    from emapg_megatron.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(args.load_hf, local_files_only=True)
    if args.task == "math":
        return tokenizer, get_task("math", chat_template=args.chat_template,
                                   format_bonus=args.math_format_bonus)
    return tokenizer, get_task("search", retriever=args.retriever, chat_template=args.chat_template,
                               max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                               max_obs_tokens=args.max_obs_tokens, topk=args.retriever_topk)


def load_prompts(args, tokenizer, task):
    """The training prompts, checked: readable data, every prompt fits --seq-length."""
    from emapg_megatron.training.prompt_data import load_training_prompts

    return load_training_prompts(task, args.data_path, tokenizer, seq_length=args.seq_length,
                                 max_new_tokens=args.max_new_tokens, long_prompts=args.long_prompts)


def model_config(args):
    """The architecture: from --load-hf's config.json, else from the flags (no weights read)."""
    from emapg_megatron.models.gpt import ModelConfig

    if args.load_hf is not None:
        from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config

        cfg, _ = model_config_from_hf(read_hf_config(args.load_hf),
                                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        return cfg
    from emapg_megatron.tasks.synthetic import CharTokenizer

    return ModelConfig(
        vocab_size=args.vocab_size or CharTokenizer().vocab_size,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        max_position_embeddings=max(args.max_position_embeddings, args.seq_length),
        rotary_base=args.rotary_base,
        norm_epsilon=args.norm_epsilon,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        init_method_std=args.init_method_std,
    )


def precision_config(args):
    from emapg_megatron.models.gpt import PrecisionConfig

    return PrecisionConfig(bf16=args.bf16, fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe,
                           transformer_impl=args.transformer_impl)


def world_size_from_env(args) -> int:
    return int(os.environ.get("WORLD_SIZE", args.world_size or 1))


def validate_model(args, model_cfg) -> None:
    from emapg_megatron.models.gpt import validate_fp8_shapes, validate_precision

    model_cfg.validate(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if arguments.topk_k(args) > model_cfg.vocab_size:
        raise ConfigError(f"--kl-topk-tokens {args.kl_topk_tokens} exceeds the vocabulary "
                          f"({model_cfg.vocab_size})")
    if args.fp8_format is not None:
        validate_fp8_shapes(model_cfg, args.tensor_model_parallel_size, args.seq_length,
                            args.sequence_parallel)
    if not args.dry_run:
        validate_precision(precision_config(args), arguments.parallel_config(args).resolved_device())


def layout(args, world: int) -> dict:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return {"world_size": world, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "data_parallel_size": world // (tp * pp)}


# --- building the run ----------------------------------------------------------------
def build_run(args, tokenizer, task, model_cfg, rows):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from emapg_megatron.algo.policy_loss import LossConfig
    from emapg_megatron.anchor import EmaAnchor, EmaConfig, StabilityMonitor
    from emapg_megatron.trainer import KLConfig, PolicyPasses, StepConfig, Trainer
    from emapg_megatron.training.model_and_optimizer import OptimConfig, build_model_and_optimizer
    from emapg_megatron.training.optimizer_step import check_loaded_weights
    from emapg_megatron.training.prompt_data import PromptSchedule

    optim = OptimConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer)
    chunks, optimizer = build_model_and_optimizer(model_cfg, optim, precision_config(args),
                                                  sequence_parallel=args.sequence_parallel)
    if args.pretrained_checkpoint:
        load_pretrained(chunks, optimizer, args.pretrained_checkpoint)
        check_loaded_weights(chunks, f"--pretrained-checkpoint {args.pretrained_checkpoint}")
    elif args.load_hf:
        from emapg_megatron.checkpoint import load_hf_weights

        load_hf_weights(chunks, model_cfg, args.load_hf, progress=dist.get_rank() == 0)
        optimizer.reload_model_params()
        check_loaded_weights(chunks, f"--load-hf {args.load_hf}")
    warmup = (int(args.lr_warmup_fraction * args.train_iters) if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")
    ema_cfg = EmaConfig(eta=args.ema_eta, update_period=args.ema_update_period,
                        shard_over_dp=args.ema_shard_over_dp, cpu_offload=args.ema_cpu_offload,
                        stability_interval=args.ema_stability_interval)
    anchor = EmaAnchor(chunks, optimizer, ema_cfg)
    sampler = build_rollout_engine(args, chunks, model_cfg, tokenizer)
    kl = KLConfig(args.kl_loss_type, args.kl_topk_tokens, args.kl_tail,
                  tuple(args.kl_iw_clip) if args.kl_iw_clip else None, alpha=args.kl_alpha)
    loss = LossConfig(args.clip_eps_low, args.clip_eps_high, args.kl_coef, args.entropy_coef,
                      args.loss_agg_mode)
    step_cfg = StepConfig(
        num_samples=args.num_samples_per_prompt, micro_batch_size=args.micro_batch_size,
        mini_batch_size=args.global_batch_size or args.rollout_batch_size * args.num_samples_per_prompt,
        ppo_epochs=args.ppo_epochs, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, advantage_norm=args.advantage_norm,
        advantage_eps=args.advantage_eps, kl_in_reward_coef=args.kl_in_reward_coef)
    monitor = StabilityMonitor.from_config(ema_cfg) if args.ema_stability_interval else None
    return Trainer(model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, anchor=anchor,
                   monitor=monitor,
                   sampler=sampler, task=task, tokenizer=tokenizer,
                   passes=PolicyPasses(kl, loss, model_cfg.vocab_size), step_cfg=step_cfg,
                   data=PromptSchedule(rows, args.seed), rollout_batch_size=args.rollout_batch_size)


def build_rollout_engine(args, chunks, model_cfg, tokenizer):
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    if args.rollout_engine == "vllm":
        from emapg_megatron.rollout.vllm_engine import VLLMEngine

        cfg = arguments.vllm_config(args)
        # The trainer's layout decides whether a model-parallel group must share one batch. No
        # sync here: the first generate syncs, after --load / --pretrained-checkpoint have run.
        return VLLMEngine(cfg, model_cfg, seq_length=args.seq_length, pad_id=pad_id,
                          model_chunks=chunks, trainer_tp=args.tensor_model_parallel_size,
                          pipeline_parallel=args.pipeline_model_parallel_size)
    from emapg_megatron.rollout.megatron_sampler import MegatronSampler

    return MegatronSampler(chunks, vocab_size=model_cfg.vocab_size,
                           eos_id=getattr(tokenizer, "eos_token_id", None), pad_id=pad_id,
                           seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                           seed=args.seed, tokenizer=tokenizer)


def load_pretrained(chunks, optimizer, path: str) -> None:
    """Model weights only (e.g. from `emapg-convert hf-to-mcore`), any TP/PP."""
    from emapg_megatron.training.checkpoint_verify import load_verified
    from emapg_megatron.training.model_and_optimizer import unwrap

    gpt = unwrap(chunks[0])
    gpt.load_state_dict(load_verified(gpt.sharded_state_dict(), path))  # nothing in it may run
    optimizer.reload_model_params()


# --- checkpoint state --------------------------------------------------------------------
def sharded_training_state(trainer, *, is_loading: bool = False) -> dict:
    from emapg_megatron.training.checkpointing import optimizer_sharded_state_dict
    from emapg_megatron.training.model_and_optimizer import unwrap

    model_sd = unwrap(trainer.model_chunks[0]).sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer_sharded_state_dict(trainer.optimizer, model_sd, is_loading=is_loading),
        "ema": trainer.anchor.sharded_state_dict(model_sd),
    }


def save_checkpoint(args, trainer, iteration: int) -> None:
    from emapg_megatron.training import checkpointing
    from emapg_megatron.training.optimizer_step import check_weights

    check_weights(trainer.model_chunks, f"before saving step {iteration}")
    checkpointing.check_finite_before_save(trainer.model_chunks, trainer.anchor, iteration)

    common = {"iteration": iteration, "scheduler": trainer.scheduler.state_dict(),
              "skipped_steps": trainer.skipped_steps, "args": json.dumps(vars(args), default=str)}
    path = checkpointing.save(args.save, iteration, sharded_training_state(trainer), common)
    log0(f"saved checkpoint {path}")


def resume(args, trainer) -> int:
    from emapg_megatron.training import checkpointing
    from emapg_megatron.training.model_and_optimizer import unwrap

    path = checkpointing.iteration_dir(args.load, checkpointing.latest_iteration(args.load))
    trainer.anchor.check_checkpoint(path)  # one clear line for a mismatching EMA
    checkpointing.materialize_optimizer_state(trainer.model_chunks, trainer.optimizer)
    iteration, loaded = checkpointing.load(args.load, sharded_training_state(trainer, is_loading=True))
    unwrap(trainer.model_chunks[0]).load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 DistOpt main params are views of the (grad-requiring) weights
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    checkpointing.restore_adam_steps(trainer.optimizer, loaded["optimizer"])
    trainer.anchor.load_state_dict(loaded["ema"])
    common = loaded["common"]
    trainer.scheduler.load_state_dict(common["scheduler"])
    trainer.skipped_steps = common["skipped_steps"]
    log0(f"resumed from {args.load} at step {iteration}")
    return iteration


# --- the loop ------------------------------------------------------------------------------
def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step.

    If the ranks cannot agree within ``grace_s`` (a peer died and this rank waits in a
    collective), the process exits with one line instead of blocking; a second signal exits at once.
    """

    def __init__(self, grace_s: float = 120.0):
        self.requested = False
        self.grace_s = grace_s
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGALRM, self._give_up)

    def _handle(self, signum, frame):
        if self.requested:
            self._give_up(signum, frame)
        self.requested = True
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    @staticmethod
    def _give_up(signum, frame):
        print(f"error: stopped by signal {signal.Signals(signum).name} without a checkpoint: the ranks "
              "did not reach the end of the step in time (a peer may have died)", file=sys.stderr,
              flush=True)
        os._exit(1)

    def agreed(self) -> bool:
        from emapg_megatron.training.collectives import any_true

        return any_true(self.requested)

    def done(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def train(args, trainer, logger, start: int) -> int:
    stop = StopFlag()
    iteration = start
    for iteration in range(start + 1, args.train_iters + 1):
        metrics = trainer.step(iteration)
        logger.log(iteration, metrics)
        if trainer.skipped_steps > args.max_skipped_steps:
            raise ConfigError(f"stopping: {trainer.skipped_steps} steps skipped for non-finite "
                              f"loss or gradients (--max-skipped-steps {args.max_skipped_steps})")
        stopping = stop.agreed()
        if args.save and (stopping or (args.save_interval and iteration % args.save_interval == 0)):
            save_checkpoint(args, trainer, iteration)
        if stopping:
            stop.done()
            log0(f"signal received: stopped after step {iteration}")
            return iteration
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save_checkpoint(args, trainer, iteration)
    return iteration


def prepare(argv=None):
    """Parse and validate everything that needs no process group: ``(args, model_cfg)``."""
    args = arguments.parse_args(argv)
    arguments.validate(args, world_size_from_env(args))  # before loading anything
    model_cfg = model_config(args)
    validate_model(args, model_cfg)
    return args, model_cfg


def run(argv=None) -> int:
    from emapg_megatron.metrics import MetricsLogger

    runtime.quiet_expected_warnings()
    args, model_cfg = prepare(argv)
    tokenizer, task = build_tokenizer_and_task(args)
    prompts = load_prompts(args, tokenizer, task)  # bad data stops here, before any work
    if args.dry_run:  # a staged example's --load may not exist yet
        print(json.dumps({"layout": layout(args, world_size_from_env(args)), "prompts": len(prompts.rows),
                          "model": model_cfg.to_dict(), "args": vars(args)}, indent=2, default=str))
        return 0
    if args.load:
        from emapg_megatron.training.checkpointing import check_train_iters

        check_train_iters(args.train_iters, args.load)
    runtime.initialize(arguments.parallel_config(args))
    save_lock = None
    try:
        if args.save:  # one run per --save directory (rank 0 holds it; all ranks agree)
            from emapg_megatron.training.run_lock import lock_save_dir

            save_lock = lock_save_dir(args.save)
        trainer = build_run(args, tokenizer, task, model_cfg, prompts.rows)
        start = resume(args, trainer) if args.load else 0
        log0(f"layout {layout(args, dist.get_world_size())}; training steps {start + 1}..{args.train_iters}")
        logger = MetricsLogger(args.log_dir, args.train_iters, tensorboard_dir=args.tensorboard_dir,
                               enabled=dist.get_rank() == 0, start_step=start,
                               log_interval=args.log_interval)
        train(args, trainer, logger, start)
        png = logger.close()
        if png:
            log0(f"metrics: {os.path.join(args.log_dir, 'metrics.jsonl')}; curves: {png}")
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
