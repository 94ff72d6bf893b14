"""Build a run from its config: inputs first (no process group), then its components.

:func:`prepare` parses and validates every flag and loads what needs no process group (model
shape, tokenizer, task, checked prompts), so bad input stops before any work. After
``runtime.initialize``, :func:`build_trainer` builds the model, optimizer, LR schedule, anchor
(EMA or teacher), rollout engine, rollout collector (fresh or partial rollouts) and the
:class:`~emapg_megatron.trainer.Trainer` that orchestrates them, each from its own config. The
choices between alternatives (which anchor, which engine, which collector) are made here, once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from transformers import AutoTokenizer

from emapg_megatron import arguments, runtime
from emapg_megatron.algo.config import StepConfig
from emapg_megatron.anchor import EmaAnchor, StabilityMonitor
from emapg_megatron.anchor.frozen_base import FrozenBaseAnchor
from emapg_megatron.anchor.teacher import (
    Teacher,
    check_same_tokenizer,
    teacher_model_config,
)
from emapg_megatron.arguments import RunConfig
from emapg_megatron.checkpoint import load_hf_weights
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.checkpoint.convert import (
    METADATA,
    architecture_for,
    check_stored_tensors,
    checkpoint_metadata,
    checkpoint_model_config,
)
from emapg_megatron.checkpoint.hf_config import (
    architecture_diffs,
    model_config_from_hf,
    read_hf_config,
)
from emapg_megatron.checkpoint.hf_io import TOKENIZER_VOCAB_FILES, has_tokenizer
from emapg_megatron.checkpoint.lora_base import BaseRecord
from emapg_megatron.checkpoint.peft_format import init_from_peft
from emapg_megatron.checkpoint.safe_load import load_verified
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.apply import adapters_off
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.config import ModelConfig
from emapg_megatron.models.gpt import has_local_attention, unwrap, validate_precision
from emapg_megatron.parallel.output_heads import output_head
from emapg_megatron.rollout import vllm_engine
from emapg_megatron.rollout.collect import (
    FreshRollouts,
    PartialRollouts,
    SamplingSettings,
    StepShape,
)
from emapg_megatron.rollout.evaluation import HeldOutEvaluation
from emapg_megatron.rollout.expert_group import ExpertGroupEngine
from emapg_megatron.rollout.megatron_sampler import MegatronSampler
from emapg_megatron.rollout.partial import InFlight
from emapg_megatron.run.loop import log0
from emapg_megatron.step.moe import MoERouting
from emapg_megatron.step.passes import PolicyPasses
from emapg_megatron.step.state import TrainState
from emapg_megatron.tasks import get_task
from emapg_megatron.tasks.synthetic import CharTokenizer, CopyTask
from emapg_megatron.trainer import Trainer
from emapg_megatron.training import packing, prompt_cache
from emapg_megatron.training.collectives import on_rank0
from emapg_megatron.training.config import OptimConfig
from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer
from emapg_megatron.training.optimizer_step import check_loaded_weights
from emapg_megatron.training.prompt_data import PromptSchedule, load_training_prompts

#: What --dry-run says of the prompts when --load-hf has no tokenizer to encode them.
NOT_CHECKED = "not checked: --load-hf has no tokenizer"


@dataclass
class RunInputs:
    """What a run needs before its process group: its validated config, model shape, data."""

    config: RunConfig
    """The run's validated config, one per component."""
    model_cfg: ModelConfig
    """The architecture."""
    tokenizer: object
    """Tokenizer of the task's prompts and responses (None: a --dry-run without one)."""
    task: object
    """The RL task: prompts and rewards."""
    prompts: object
    """The checked training prompts (:class:`~emapg_megatron.training.prompt_data.TrainingPrompts`;
    None: a --dry-run without a tokenizer)."""
    eval_rows: list | None = None
    """Held-out rows for --eval-interval (checked like the training prompts), or None."""
    architecture: str | None = None
    """The HF architecture the model is (--load-hf's, else the one the flags build), or None."""
    hf_config: dict | None = None
    """--load-hf's config.json, as read once at start-up."""
    teacher_cfg: ModelConfig | None = None
    """The distillation teacher's architecture (--teacher-load-hf / --teacher-checkpoint), or None."""


def prepare(argv=None) -> RunInputs:
    """Parse, validate and load everything that needs no process group (bad input stops here)."""
    cfg = arguments.parse_args(argv)
    arguments.validate(cfg, world_size_from_env(cfg.launch))
    if cfg.step.top_p < 1.0:  # a training concern only (evaluation samples what it likes)
        warnings.warn("--top-p < 1: the samples do not come from the policy, so the KL estimators rely on "
                      "their importance weight with the truncated distribution's log-prob (recorded)",
                      stacklevel=2)
    model_cfg, arch, hf_cfg = model_source(cfg)
    arguments.validate_architecture(cfg, model_cfg)
    validate_precision(cfg.precision, cfg.parallel.resolved_device(), hardware=not cfg.launch.dry_run)
    if cfg.model.pretrained_checkpoint:
        check_pretrained_architecture(model_cfg, cfg.model.pretrained_checkpoint)
    tokenizer, task = build_tokenizer_and_task(cfg)
    if cfg.parallel.expert_model_parallel_size > 1 and task.multi_turn:
        raise ConfigError(f"multi-turn tasks (--task {cfg.task.name}) are not supported at "
                          f"--expert-model-parallel-size {cfg.parallel.expert_model_parallel_size} yet "
                          "(the expert group's ranks would run different forwards)")
    if cfg.partial_rollouts.enabled and task.multi_turn:
        raise ConfigError(f"--partial-rollouts does not support multi-turn tasks (--task {cfg.task.name}): "
                          "an episode's environment state cannot be carried between steps")
    teacher_cfg = teacher_architecture(cfg, model_cfg, tokenizer)
    if cfg.checkpoint.load and not cfg.launch.dry_run:  # a staged example's --load may not exist yet
        checkpointing.check_train_iters(cfg.loop.train_iters, cfg.checkpoint.load)
    if tokenizer is None:  # a --dry-run on a stand-in model folder: no prompt can be encoded here
        return RunInputs(cfg, model_cfg, None, task, None, None, arch, hf_cfg, teacher_cfg)
    prompts = load_prompts(cfg, tokenizer, task, cfg.task.data_path)
    return RunInputs(cfg, model_cfg, tokenizer, task, prompts, load_eval_rows(cfg, tokenizer, task),
                     arch, hf_cfg, teacher_cfg)


def teacher_architecture(cfg: RunConfig, model_cfg: ModelConfig, tokenizer) -> ModelConfig | None:
    """The teacher's architecture, checked against the student (None without a teacher)."""
    if not cfg.teacher.path:
        return None
    parallel = cfg.parallel
    teacher_cfg = teacher_model_config(cfg.teacher, model_cfg, tp=parallel.tensor_model_parallel_size,
                                       pp=parallel.pipeline_model_parallel_size,
                                       ep=parallel.expert_model_parallel_size, seq_length=cfg.step.seq_length)
    check_same_tokenizer(cfg.teacher, tokenizer)
    return teacher_cfg


def describe(inputs: RunInputs) -> str:
    """The resolved configuration and layout, as --dry-run=json prints it."""
    cfg = inputs.config
    prompts = len(inputs.prompts.rows) if inputs.prompts is not None else NOT_CHECKED
    return json.dumps({"layout": layout(cfg.parallel, world_size_from_env(cfg.launch)),
                       "prompts": prompts, "model": inputs.model_cfg.to_dict(),
                       "args": cfg.flags()}, indent=2, default=str)


def summarize(inputs: RunInputs) -> str:
    """What the run would do, in a few lines (--dry-run)."""
    cfg, m, step = inputs.config, inputs.model_cfg, inputs.config.step
    world = world_size_from_env(cfg.launch)
    par = layout(cfg.parallel, world)
    anchor = (f"teacher {cfg.teacher.path}" if cfg.teacher.path else
              f"EMA eta {cfg.ema.eta:g} every {cfg.ema.update_period} steps")
    kl = f"{cfg.kl.loss_type}" + (f" k={cfg.kl.k} tail {cfg.kl.tail}" if cfg.kl.uses_topk else "")
    rows = [
        ("layout", f"world {world} = TP {par['tensor_model_parallel_size']} x PP "
                   f"{par['pipeline_model_parallel_size']} x DP {par['data_parallel_size']} "
                   + (f"(experts: EP {par['expert_model_parallel_size']} x expert TP "
                      f"{par['expert_tensor_parallel_size']} x expert DP {par['expert_data_parallel_size']}) "
                      if "expert_model_parallel_size" in par else "")
                   + f"({cfg.parallel.resolved_device()})"),
        ("model", f"{inputs.architecture or 'GPT'}: {m.num_layers} layers, hidden {m.hidden_size}, "
                  f"{m.num_attention_heads} heads ({m.num_query_groups or m.num_attention_heads} query groups), "
                  f"vocab {m.vocab_size}"
                  + (f"; {m.num_experts} experts per MoE layer, top-{m.moe_router_topk}, routing replay "
                     f"{cfg.moe.routing_replay}" if m.is_moe else "")
                  + (f"; dense MLP in layers {m.dense_mlp_layers}" if m.dense_mlp_layers else "")
                  + (f", from {cfg.model.load_hf}" if cfg.model.load_hf else "")
                  + (f"; LoRA rank {cfg.lora.rank} (alpha {cfg.lora.alpha:g}) on "
                     f"{' '.join(cfg.lora.targets())}, base frozen" if cfg.lora.enabled else "")),
        ("task", f"{cfg.task.name}: " + (f"prompts {NOT_CHECKED}" if inputs.prompts is None else
                 f"{len(inputs.prompts.rows)} prompts"
                 + (f" ({len(inputs.prompts.dropped)} too long, dropped)" if inputs.prompts.dropped else ""))),
        ("step", f"{step.rollout_batch_size} prompts x {step.num_samples} samples, at most {step.max_new_tokens} "
                 f"new tokens (--seq-length {step.seq_length}); {step.updates_per_step} update(s) per step"
                 + (", partial rollouts" if cfg.partial_rollouts.enabled else "")),
        ("loss", f"KL {kl}, beta {cfg.loss.kl_coef:g}; anchor: {anchor}"),
        ("run", f"{cfg.loop.train_iters} steps; --save {cfg.checkpoint.save or '(none)'}; "
                f"--log-dir {cfg.log.log_dir}"),
    ]
    lines = [f"  {name:7s}{text}" for name, text in rows]
    return "\n".join(["dry run: every check passed; nothing was started", *lines,
                      "(every resolved setting: --dry-run=json)"])


def build_trainer(inputs: RunInputs) -> Trainer:
    """The run's components on this rank (call after ``runtime.initialize``)."""
    cfg, model_cfg = inputs.config, inputs.model_cfg
    # before any weight is read: a checkpoint this run cannot resume is one line
    resume = None
    if cfg.checkpoint.load:
        resume = checkpointing.iteration_dir(cfg.checkpoint.load,
                                             checkpointing.agreed_latest_iteration(cfg.checkpoint.load))
        checkpointing.check_same_model(resume, cfg.lora.enabled)
    base = lora_base(cfg, resume)
    if resume is not None and cfg.lora.enabled:
        checkpointing.check_lora_base(resume, base)
    chunks, optimizer = build_model_and_optimizer(model_cfg, cfg.optim, cfg.precision,
                                                  sequence_parallel=cfg.parallel.sequence_parallel, moe=cfg.moe,
                                                  lora=cfg.lora, seed=cfg.loop.seed)
    load_initial_weights(chunks, optimizer, cfg, model_cfg, base)
    if cfg.lora.enabled:
        trainable = sum(p.numel() for p in chunks[0].parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in chunks[0].parameters() if not p.requires_grad)
        log0(f"LoRA rank {cfg.lora.rank}: {trainable:,} adapter parameters train, {frozen:,} base "
             "parameters frozen (rank 0)")
    scheduler = lr_scheduler(optimizer, cfg.optim, cfg.loop.train_iters, cfg.step.updates_per_step)
    if cfg.step.sequence_packing:
        warn_packed_attention_cost(chunks[0], model_cfg, cfg.step)
    monitor = StabilityMonitor.from_config(cfg.ema) if cfg.ema.stability_interval else None
    head = output_head(model_cfg.vocab_size, fused=cfg.step.fused_lm_head,
                       sequence_parallel=cfg.parallel.sequence_parallel)
    routing = MoERouting.for_policy(model_cfg, cfg.moe, pipeline=cfg.parallel.pipeline_model_parallel_size,
                                    sequence_parallel=cfg.parallel.sequence_parallel,
                                    packing=cfg.step.sequence_packing)
    engine = build_rollout_engine(cfg, chunks, model_cfg, inputs.tokenizer,
                                  route_dtype=rollout_route_dtype(cfg, routing))
    collector = build_collector(inputs, engine)
    state = TrainState(chunks, optimizer, scheduler, build_anchor(inputs, chunks, optimizer), collector,
                       lora_base=base)
    return Trainer(state=state, collector=collector, engine=engine, task=inputs.task, monitor=monitor,
                   passes=PolicyPasses(cfg.kl, cfg.loss, model_cfg.vocab_size, head), step_cfg=cfg.step,
                   routing=routing)


def sampling_settings(cfg: RunConfig, task) -> SamplingSettings:
    step = cfg.step
    return SamplingSettings(step.temperature, step.top_p, step.max_new_tokens, tuple(task.stop_strings) or None)


def build_collector(inputs: RunInputs, engine):
    """Fresh rollouts, or --partial-rollouts' pool of prompt groups in flight."""
    cfg, step, partial = inputs.config, inputs.config.step, inputs.config.partial_rollouts
    args = (engine, inputs.task, inputs.tokenizer, PromptSchedule(inputs.prompts.rows, cfg.loop.seed),
            StepShape(step.rollout_batch_size, step.num_samples, step.mini_batch_size),
            sampling_settings(cfg, inputs.task))
    if not partial.enabled:
        return FreshRollouts(*args)
    pool = InFlight(step.num_samples, step.rollout_batch_size, partial.pool_size(step.rollout_batch_size),
                    partial.max_staleness)
    return PartialRollouts(*args, pool)


def build_anchor(inputs: RunInputs, chunks, optimizer):
    """The KL anchor: the distillation teacher when one is given, else the EMA of the policy (with
    LoRA: of its adapters, the only trainable parameters; at --ema-eta 1 the base model itself,
    the adapters switched off, with no copy)."""
    cfg = inputs.config
    if inputs.teacher_cfg is None and cfg.lora.enabled and cfg.ema.eta >= 1.0:  # B = 0 at the start
        return FrozenBaseAnchor(chunks, adapters_off)
    if inputs.teacher_cfg is None:
        return EmaAnchor(chunks, optimizer, cfg.ema)
    t = inputs.teacher_cfg
    # the teacher routes itself: only the policy replays routes (models/routing_replay.py)
    teacher = Teacher.build(cfg.teacher, t, cfg.precision, sequence_parallel=cfg.parallel.sequence_parallel,
                            moe=replace(cfg.moe, routing_replay="none", record_routes=False))
    log0(f"teacher {cfg.teacher.path}: {t.num_layers} layers, hidden {t.hidden_size}, "
         f"{teacher.memory_bytes() / 2**20:.1f} MiB of weights on rank 0")
    return teacher


def evaluation(inputs: RunInputs, trainer: Trainer):
    """``step -> {eval/pass@k: ...}`` on the steps --eval-interval names ({} on the others), or
    None without evaluation."""
    ev, rows = inputs.config.eval, inputs.eval_rows
    if rows is None:
        return None
    held_out = HeldOutEvaluation(trainer.engine, inputs.task, inputs.tokenizer, rows, ev.eval_samples,
                                 sampling_settings(inputs.config, inputs.task))
    return lambda step: held_out(step) if ev.due(step) else {}


def base_source(cfg: RunConfig) -> tuple[str, str] | None:
    """``(flag, folder)`` the model's starting weights come from (--pretrained-checkpoint before
    --load-hf), or None (a random init)."""
    if cfg.model.pretrained_checkpoint:
        return "--pretrained-checkpoint", cfg.model.pretrained_checkpoint
    return ("--load-hf", cfg.model.load_hf) if cfg.model.load_hf else None


def lora_base(cfg: RunConfig, resume: str | None = None) -> BaseRecord | None:
    """A LoRA run's base, when it comes from files: each weight file hashed once, on global rank 0
    (its checkpoints then hold the adapters alone and record it: checkpoint/lora_base.py). None
    without LoRA, for a random base (saved with the adapters), for a run that neither saves nor
    resumes (nothing would record or check the hash), and when the checkpoint it resumes
    (``resume``) holds its base weights: they are read from it, and so are its later checkpoints'."""
    source = base_source(cfg) if cfg.lora.enabled else None
    if source is None or not (cfg.checkpoint.save or resume):
        return None
    if resume is not None and checkpointing.holds_base_weights(resume):
        log0(f"--load {resume} holds the LoRA base weights with the adapters: the base is read from it, "
             f"not from {' '.join(source)}, and the run's checkpoints keep holding it")
        return None
    start = time.monotonic()
    record = on_rank0(lambda: BaseRecord.of(*source))
    log0(f"LoRA base {record.describe()}: {len(record.files)} weight file(s) hashed in "
         f"{time.monotonic() - start:.1f} s; checkpoints hold the adapters and name this base")
    return record


def load_initial_weights(chunks, optimizer, cfg: RunConfig, model_cfg: ModelConfig,
                         base: BaseRecord | None = None) -> None:
    """--pretrained-checkpoint's or --load-hf's weights (else the random init stays). With --load,
    only a LoRA run's base from files (``base``: its checkpoint holds the adapters alone); any
    other checkpoint replaces every weight (reading them first would only cost time)."""
    path, hf = cfg.model.pretrained_checkpoint, cfg.model.load_hf
    if cfg.checkpoint.load and base is None:
        return
    if path:
        load_pretrained(chunks, optimizer, path)
        check_loaded_weights(chunks, f"--pretrained-checkpoint {path}")
    elif hf:
        load_hf_weights(chunks, model_cfg, hf, progress=dist.get_rank() == 0)
        optimizer.reload_model_params()
        check_loaded_weights(chunks, f"--load-hf {hf}")
    if cfg.lora.peft_init and not cfg.checkpoint.load:  # the adapters to continue from, on the base just loaded
        init_from_peft(chunks, cfg.lora, model_cfg, seed=cfg.loop.seed)
        optimizer.reload_model_params()


def build_tokenizer_and_task(cfg: RunConfig):
    """The tokenizer (--load-hf's) and the task, on the config its flags built. A --load-hf folder
    without a tokenizer is refused (transformers would build one that encodes every prompt to
    nothing); under --dry-run, where it may stand in for the target machine's model (config.json
    only), the tokenizer is None and the prompts are not checked."""
    task = cfg.task
    if task.built_in:
        return CharTokenizer(), CopyTask(seed=cfg.loop.seed, reward=task.copy.reward)
    built = get_task(task.name, config=task.task_config())
    if not has_tokenizer(cfg.model.load_hf):
        if cfg.launch.dry_run:
            return None, built
        raise ConfigError(f"--load-hf {cfg.model.load_hf} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_VOCAB_FILES)}): the prompts cannot be encoded; copy the "
                          "model's tokenizer files there")
    return AutoTokenizer.from_pretrained(cfg.model.load_hf, local_files_only=True), built


def load_prompts(cfg: RunConfig, tokenizer, task, path: str | None):
    """The prompts of ``path`` (training or held-out), checked: readable data, every prompt fits
    --seq-length. Loaded and tokenised by one process of a node, shared with the others."""
    def load():
        return load_training_prompts(task, path, tokenizer, seq_length=cfg.step.seq_length,
                                     max_new_tokens=cfg.step.max_new_tokens,
                                     long_prompts=cfg.task.long_prompts, fields=cfg.task.fields() or None)
    if task.builtin_rows() is not None:  # nothing to share: made in no time, and no lock file left
        return load()
    return prompt_cache.once_per_node(prompt_cache.key(cfg.flags(), path, cfg.model.load_hf), load)


def load_eval_rows(cfg: RunConfig, tokenizer, task) -> list | None:
    """--eval-interval's held-out rows (the first --eval-max-prompts), checked as the training
    prompts are; at least one per data-parallel rank."""
    ev = cfg.eval
    if not ev.eval_interval:
        return None
    rows = load_prompts(cfg, tokenizer, task, ev.eval_data_path).rows[:ev.eval_max_prompts]
    dp = cfg.parallel.data_parallel_size(world_size_from_env(cfg.launch))
    if len(rows) < dp:
        raise ConfigError(f"--eval-data-path has {len(rows)} usable prompts: evaluation needs at least "
                          f"one per data-parallel rank ({dp})")
    return rows


def model_source(cfg: RunConfig) -> tuple[ModelConfig, str | None, dict | None]:
    """(the architecture, its HF name, --load-hf's config.json): from that config.json, else
    from the flags (no weights read)."""
    if cfg.model.load_hf is not None:
        hf_cfg = read_hf_config(cfg.model.load_hf)
        divisible_by = cfg.model.make_vocab_size_divisible_by
        model_cfg, arch = model_config_from_hf(hf_cfg, make_vocab_size_divisible_by=divisible_by)
        return model_cfg, arch, hf_cfg
    model_cfg = cfg.model.architecture(cfg.step.seq_length)
    return model_cfg, architecture_for(model_cfg), None


def model_config(cfg: RunConfig) -> ModelConfig:
    """The architecture alone (:func:`model_source`)."""
    return model_source(cfg)[0]


def model_metadata(inputs: RunInputs) -> dict | None:
    """What the converter needs to export the run's checkpoints to HF (``METADATA``): the
    architecture, dtype and layout; with --load-hf, its config.json and where its tokenizer is.
    None for a model no HF architecture computes alike."""
    cfg, hf_dir = inputs.config, inputs.config.model.load_hf
    if inputs.architecture is None:
        return None
    dtype = "bf16" if cfg.precision.bf16 else "fp32"
    meta = checkpoint_metadata(inputs.model_cfg, inputs.architecture, dtype,
                               tp=cfg.parallel.tensor_model_parallel_size,
                               pp=cfg.parallel.pipeline_model_parallel_size, hf_config=inputs.hf_config)
    if cfg.lora.enabled:  # its consumers other than --load refuse it (checkpoint.convert.checked_checkpoint)
        meta["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "target_modules": list(cfg.lora.targets())}
    return {**meta, "hf_dir": os.path.abspath(hf_dir) if hf_dir else None}


def world_size_from_env(launch) -> int:
    """--world-size when given (what a --dry-run validates), else $WORLD_SIZE, else 1. A real
    run whose launcher set another $WORLD_SIZE is refused: the flag would validate a layout
    that does not run."""
    env = os.environ.get("WORLD_SIZE")
    if launch.world_size is None:
        return int(env or 1)
    if env is not None and not launch.dry_run and int(env) != launch.world_size:
        raise ConfigError(f"--world-size {launch.world_size} but this run has {env} processes "
                          "($WORLD_SIZE): drop --world-size, which is for --dry-run")
    return launch.world_size


def check_pretrained_architecture(model_cfg, path: str) -> None:
    """--pretrained-checkpoint must hold the architecture the flags (or --load-hf) build: as the
    model config it stores says (itself checked against its tensors), else as its tensors' shapes
    say (a checkpoint not written here)."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        check_stored_tensors(path, model_cfg, "this run's model (the model flags or --load-hf)")
        return
    differ = [f"{name}: checkpoint {stored!r}, run {run!r}"
              for name, stored, run in architecture_diffs(checkpoint_model_config(path), model_cfg)]
    if differ:
        raise ConfigError(f"--pretrained-checkpoint {path} holds another architecture than this run "
                          f"builds ({'; '.join(differ)}): pass the model flags it was made with, or "
                          "--load-hf of the model it came from")


def layout(parallel, world: int) -> dict:
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    out = {"world_size": world, "tensor_model_parallel_size": tp,
           "pipeline_model_parallel_size": pp, "data_parallel_size": parallel.data_parallel_size(world)}
    if parallel.expert_model_parallel_size > 1 or parallel.expert_tensor_parallel_size:
        out.update(expert_model_parallel_size=parallel.expert_model_parallel_size,
                   expert_tensor_parallel_size=parallel.expert_tensor_size,
                   expert_data_parallel_size=parallel.expert_data_parallel_size(world))
    return out


def warn_packed_attention_cost(model, model_cfg, step: StepConfig) -> None:
    """Warn once, on a GPU, if packed attention would be slow (TE left with its unfused backend)
    or memory-hungry (the local spec's T x T block mask over a large token budget)."""
    if runtime.hardware() != "cuda":
        return  # CPU runs are small: the local spec's mask is how packing is tested there
    if has_local_attention(model):
        note = packing.local_attention_cost(step.token_budget(), step.micro_batch_size, step.seq_length)
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


def rollout_route_dtype(cfg: RunConfig, routing: MoERouting | None):
    """The dtype the rollout engine returns a MoE policy's routes in, or None. The built-in
    sampler records them wherever the trainer can lay them per sequence (R3, and the agreement
    metric under none and r2); vLLM only under R3: elsewhere its route buffer and an option a vLLM
    build may lack would buy a metric alone."""
    if routing is None or (cfg.sampler.engine == "vllm" and cfg.moe.routing_replay != "r3"):
        return None
    return routing.record_dtype


def build_rollout_engine(cfg: RunConfig, chunks, model_cfg: ModelConfig, tokenizer, route_dtype=None):
    """vLLM or the built-in sampler, either returning a MoE policy's routes in ``route_dtype``
    (R3; None: no routes)."""
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    parallel, step = cfg.parallel, cfg.step
    if cfg.sampler.engine == "vllm":
        # The trainer's layout decides whether a model-parallel group must share one batch. No
        # sync here: the first generate syncs, after --load / --pretrained-checkpoint have run.
        return vllm_engine.VLLMEngine(cfg.vllm_engine_config(), model_cfg, seq_length=step.seq_length,
                                      pad_id=pad_id, model_chunks=chunks,
                                      trainer_tp=parallel.tensor_model_parallel_size,
                                      pipeline_parallel=parallel.pipeline_model_parallel_size,
                                      route_dtype=route_dtype)
    sampler = MegatronSampler(chunks, cfg.sampler.resolved(cfg.partial_rollouts.enabled),
                              vocab_size=model_cfg.vocab_size, eos_id=getattr(tokenizer, "eos_token_id", None),
                              pad_id=pad_id, seq_length=step.seq_length, micro_batch_size=step.micro_batch_size,
                              seed=cfg.loop.seed, tokenizer=tokenizer, route_dtype=route_dtype)
    if parallel.expert_model_parallel_size > 1:  # the group's ranks must run the same forwards
        return ExpertGroupEngine(sampler, ps.get_expert_model_parallel_group())
    return sampler


def lr_scheduler(optimizer, optim: OptimConfig, train_iters: int,
                 updates_per_step: int) -> OptimizerParamScheduler:
    """Megatron's LR/WD schedule. It steps once per optimizer update and a trainer step makes
    ``updates_per_step`` of them (--ppo-epochs x the rollout's PPO mini-batches), so warm-up and
    decay are counted in updates: they span the flags' trainer steps whatever the batching. The
    flags' settings win over a resumed checkpoint's (a run extended with a larger --train-iters
    decays over the new horizon); the checkpoint gives the position in the schedule."""
    warmup = optim.warmup_iters(train_iters)
    total = train_iters * updates_per_step
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warmup * updates_per_step, lr_decay_steps=total,
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=total, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)


def load_pretrained(chunks, optimizer, path: str) -> None:
    """Model weights only (e.g. from `emapg-convert hf-to-mcore`), any TP/PP. LoRA's adapters
    (``<linear>.lora.A`` / ``.lora.B``) are not in such a checkpoint: they keep their init."""
    gpt = unwrap(chunks[0])
    every = gpt.sharded_state_dict()
    base = {k: v for k, v in every.items() if not is_adapter_name(k)}
    missing, _ = gpt.load_state_dict(load_verified(base, path), strict=len(base) == len(every))  # nothing in it may run
    if any(not is_adapter_name(k) for k in missing):
        raise ConfigError(f"--pretrained-checkpoint {path} lacks {', '.join(k for k in missing if not is_adapter_name(k))}")
    optimizer.reload_model_params()


