"""Build a run from the command line: inputs first (no process group), then its components.

:func:`prepare` parses and validates every flag and loads what needs no process group (model
shape, tokenizer, task, checked prompts), so bad input stops before any work. After
``runtime.initialize``, :func:`build_trainer` builds the model, optimizer, LR schedule, EMA
anchor, rollout engine and the :class:`~emapg_megatron.trainer.Trainer` that orchestrates them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from transformers import AutoTokenizer

from emapg_megatron import arguments, runtime
from emapg_megatron.anchor import EmaAnchor, StabilityMonitor
from emapg_megatron.checkpoint import load_hf_weights
from emapg_megatron.checkpoint.convert import METADATA, checkpoint_model_config
from emapg_megatron.checkpoint.hf_config import (
    architecture_diffs,
    model_config_from_hf,
    read_hf_config,
)
from emapg_megatron.models.gpt import (
    ModelConfig,
    has_local_attention,
    validate_fp8_shapes,
    validate_precision,
)
from emapg_megatron.parallel.output_heads import output_head
from emapg_megatron.rollout import vllm_engine
from emapg_megatron.rollout.megatron_sampler import MegatronSampler
from emapg_megatron.runtime import ConfigError
from emapg_megatron.tasks import get_task
from emapg_megatron.tasks.synthetic import CharTokenizer, CopyTask
from emapg_megatron.trainer import PolicyPasses, StepConfig, Trainer
from emapg_megatron.training import packing
from emapg_megatron.training.checkpoint_verify import load_verified
from emapg_megatron.training.model_and_optimizer import (
    build_model_and_optimizer,
    unwrap,
)
from emapg_megatron.training.optimizer_step import check_loaded_weights
from emapg_megatron.training.prompt_data import PromptSchedule, load_training_prompts


@dataclass
class RunInputs:
    """What a run needs before its process group: validated flags, model shape, data."""

    args: object
    """The parsed and validated flags."""
    model_cfg: object
    """The architecture (:class:`~emapg_megatron.models.gpt.ModelConfig`)."""
    tokenizer: object
    """Tokenizer of the task's prompts and responses."""
    task: object
    """The RL task: prompts and rewards."""
    prompts: object
    """The checked training prompts (:class:`~emapg_megatron.training.prompt_data.TrainingPrompts`)."""
    configs: arguments.ComponentConfigs
    """Every component's config, built once from the flags."""


def prepare(argv=None) -> RunInputs:
    """Parse, validate and load everything that needs no process group (bad input stops here)."""
    args = arguments.parse_args(argv)
    configs = arguments.component_configs(args)
    arguments.validate(args, world_size_from_env(args), configs)
    model_cfg = model_config(args)
    validate_model(args, configs, model_cfg)
    tokenizer, task = build_tokenizer_and_task(args)
    return RunInputs(args, model_cfg, tokenizer, task, load_prompts(args, tokenizer, task), configs)


def describe(inputs: RunInputs) -> str:
    """The resolved configuration and layout, as --dry-run prints it."""
    args = inputs.args
    return json.dumps({"layout": layout(args, world_size_from_env(args)), "prompts": len(inputs.prompts.rows),
                       "model": inputs.model_cfg.to_dict(), "args": vars(args)}, indent=2, default=str)


def build_trainer(inputs: RunInputs):
    """The run's components on this rank (call after ``runtime.initialize``)."""
    return build_run(inputs.args, inputs.configs, inputs.tokenizer, inputs.task, inputs.model_cfg,
                     inputs.prompts.rows)


def build_tokenizer_and_task(args):
    if args.task == "synthetic-copy":
        return CharTokenizer(), CopyTask(seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.load_hf, local_files_only=True)
    if args.task == "math":
        return tokenizer, get_task("math", chat_template=args.chat_template,
                                   format_bonus=args.math_format_bonus)
    return tokenizer, get_task("search", retriever=args.retriever, chat_template=args.chat_template,
                               max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                               max_obs_tokens=args.max_obs_tokens, topk=args.retriever_topk)


def load_prompts(args, tokenizer, task):
    """The training prompts, checked: readable data, every prompt fits --seq-length."""
    return load_training_prompts(task, args.data_path, tokenizer, seq_length=args.seq_length,
                                 max_new_tokens=args.max_new_tokens, long_prompts=args.long_prompts)


def model_config(args):
    """The architecture: from --load-hf's config.json, else from the flags (no weights read)."""
    if args.load_hf is not None:
        cfg, _ = model_config_from_hf(read_hf_config(args.load_hf),
                                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        return cfg
    return arguments.component_config(
        ModelConfig, args, vocab_size=args.vocab_size or CharTokenizer().vocab_size,
        max_position_embeddings=max(args.max_position_embeddings, args.seq_length),
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        num_query_groups=args.num_query_groups or (1 if args.group_query_attention else None))


def world_size_from_env(args) -> int:
    """--world-size when given (what a --dry-run validates), else $WORLD_SIZE, else 1. A real
    run whose launcher set another $WORLD_SIZE is refused: the flag would validate a layout
    that does not run."""
    env = os.environ.get("WORLD_SIZE")
    if args.world_size is None:
        return int(env or 1)
    if env is not None and not args.dry_run and int(env) != args.world_size:
        raise ConfigError(f"--world-size {args.world_size} but this run has {env} processes "
                          "($WORLD_SIZE): drop --world-size, which is for --dry-run")
    return args.world_size


def check_pretrained_architecture(model_cfg, path: str) -> None:
    """--pretrained-checkpoint must hold the architecture the flags (or --load-hf) build, as
    the model config it stores says. A checkpoint without one (not written here) is not checked
    before the load, which then fails on any shape that differs."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        return
    differ = [f"{name}: checkpoint {stored!r}, run {run!r}"
              for name, stored, run in architecture_diffs(checkpoint_model_config(path), model_cfg)]
    if differ:
        raise ConfigError(f"--pretrained-checkpoint {path} holds another architecture than this run "
                          f"builds ({'; '.join(differ)}): pass the model flags it was made with, or "
                          "--load-hf of the model it came from")


def validate_model(args, configs: arguments.ComponentConfigs, model_cfg) -> None:
    model_cfg.validate(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if arguments.topk_k(args) > model_cfg.vocab_size:
        raise ConfigError(f"--kl-topk-tokens {args.kl_topk_tokens} exceeds the vocabulary "
                          f"({model_cfg.vocab_size}): use at most {model_cfg.vocab_size} (that many is "
                          "the exact KL); the synthetic task's first run is --preset tiny-cpu")
    if args.fp8_format is not None:
        validate_fp8_shapes(model_cfg, args.tensor_model_parallel_size, args.seq_length,
                            args.sequence_parallel)
    validate_precision(configs.precision, configs.parallel.resolved_device(), hardware=not args.dry_run)
    if args.pretrained_checkpoint:
        check_pretrained_architecture(model_cfg, args.pretrained_checkpoint)


def layout(args, world: int) -> dict:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return {"world_size": world, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "data_parallel_size": world // (tp * pp)}


def build_run(args, cfg: arguments.ComponentConfigs, tokenizer, task, model_cfg, rows):
    chunks, optimizer = build_model_and_optimizer(model_cfg, cfg.optim, cfg.precision,
                                                  sequence_parallel=cfg.parallel.sequence_parallel)
    if args.pretrained_checkpoint:
        load_pretrained(chunks, optimizer, args.pretrained_checkpoint)
        check_loaded_weights(chunks, f"--pretrained-checkpoint {args.pretrained_checkpoint}")
    elif args.load_hf:
        load_hf_weights(chunks, model_cfg, args.load_hf, progress=dist.get_rank() == 0)
        optimizer.reload_model_params()
        check_loaded_weights(chunks, f"--load-hf {args.load_hf}")
    rollout = args.rollout_batch_size * args.num_samples_per_prompt
    updates_per_step = args.ppo_epochs * rollout // cfg.step.mini_batch_size
    scheduler = lr_scheduler(optimizer, args, updates_per_step)
    if args.sequence_packing:
        warn_packed_attention_cost(chunks[0], model_cfg, cfg.step)
    anchor = EmaAnchor(chunks, optimizer, cfg.ema)
    sampler = build_rollout_engine(args, chunks, model_cfg, tokenizer)
    passes = PolicyPasses(cfg.kl, cfg.loss, model_cfg.vocab_size,
                          output_head(model_cfg.vocab_size, fused=args.fused_lm_head,
                                      sequence_parallel=args.sequence_parallel))
    monitor = StabilityMonitor.from_config(cfg.ema) if cfg.ema.stability_interval else None
    return Trainer(model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, anchor=anchor,
                   monitor=monitor, sampler=sampler, task=task, tokenizer=tokenizer, passes=passes,
                   step_cfg=cfg.step, data=PromptSchedule(rows, args.seed),
                   rollout_batch_size=args.rollout_batch_size)


def warn_packed_attention_cost(model, model_cfg, step: StepConfig) -> None:
    """Warn once, on a GPU, if packed attention would be slow (TE left with its unfused backend)
    or memory-hungry (the local spec's T x T block mask over a large token budget)."""
    if runtime.hardware() != "cuda":
        return  # CPU runs are small: the local spec's mask is how packing is tested there
    if has_local_attention(model):
        note = packing.local_attention_cost(step.token_budget(step.seq_length), step.micro_batch_size,
                                            step.seq_length)
    else:
        gqa = (model_cfg.num_query_groups or model_cfg.num_attention_heads) < model_cfg.num_attention_heads
        flash = any(importlib.util.find_spec(m) for m in ("flash_attn", "flash_attn_interface"))  # FA2, FA3
        note = packing.slow_thd_attention(_te_cudnn_version(), flash, gqa)
    if note and dist.get_rank() == 0:
        warnings.warn(note, stacklevel=2)


def _te_cudnn_version() -> int | None:
    """The cuDNN that TE runs, as ``major * 10000 + minor * 100 + patch`` (TE's own query; else
    the one PyTorch loaded)."""
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        major, minor, patch = get_cudnn_version()
        return major * 10000 + minor * 100 + patch
    except Exception:  # an older TE without the query, or no TE: PyTorch's cuDNN
        return torch.backends.cudnn.version()


def build_rollout_engine(args, chunks, model_cfg, tokenizer):
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    if args.rollout_engine == "vllm":
        cfg = arguments.vllm_config(args)
        # The trainer's layout decides whether a model-parallel group must share one batch. No
        # sync here: the first generate syncs, after --load / --pretrained-checkpoint have run.
        return vllm_engine.VLLMEngine(cfg, model_cfg, seq_length=args.seq_length, pad_id=pad_id,
                                      model_chunks=chunks, trainer_tp=args.tensor_model_parallel_size,
                                      pipeline_parallel=args.pipeline_model_parallel_size)
    return MegatronSampler(chunks, vocab_size=model_cfg.vocab_size,
                           eos_id=getattr(tokenizer, "eos_token_id", None), pad_id=pad_id,
                           seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                           seed=args.seed, tokenizer=tokenizer, kv_cache=args.rollout_kv_cache,
                           max_requests=args.inference_max_requests,
                           max_forward_tokens=max(args.inference_batch_times_seqlen_threshold, 0) or None)


def lr_scheduler(optimizer, args, updates_per_step: int) -> OptimizerParamScheduler:
    """Megatron's LR/WD schedule. It steps once per optimizer update and a trainer step makes
    ``updates_per_step`` of them (--ppo-epochs x the rollout's PPO mini-batches), so warm-up and
    decay are counted in updates: they span the flags' trainer steps whatever the batching. The
    flags' settings win over a resumed checkpoint's (a run extended with a larger --train-iters
    decays over the new horizon); the checkpoint gives the position in the schedule."""
    warmup = (int(args.lr_warmup_fraction * args.train_iters) if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters)
    total = args.train_iters * updates_per_step
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup * updates_per_step, lr_decay_steps=total,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=total, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)


def load_pretrained(chunks, optimizer, path: str) -> None:
    """Model weights only (e.g. from `emapg-convert hf-to-mcore`), any TP/PP."""
    gpt = unwrap(chunks[0])
    gpt.load_state_dict(load_verified(gpt.sharded_state_dict(), path))  # nothing in it may run
    optimizer.reload_model_params()


