"""The trainer's configuration: one :class:`RunConfig` of component configs, its command line and
YAML, and the rules that join components.

The flags are generated from the component configs (``emapg_megatron.configurable``): each field
declares its Megatron-LM flag name, aliases and range next to the code that uses it, and its
docstring is the ``--help`` text. Precedence: built-in defaults < ``--preset`` < ``--config
FILE.yaml`` < the command line. YAML keys are flag names (or aliases) without the dashes, with
``-`` or ``_`` (``kl-coef`` or ``kl_coef``). After :func:`parse_args`, nothing reads flags: each
component gets its own config. :func:`validate` checks everything that needs no process group.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, replace
from importlib import resources

from emapg_megatron import configurable
from emapg_megatron.algo.config import LossConfig, StepConfig
from emapg_megatron.anchor.config import EmaConfig, TeacherConfig
from emapg_megatron.checkpoint.paths import holds_checkpoint
from emapg_megatron.configurable import at_least, option
from emapg_megatron.errors import ConfigError
from emapg_megatron.kl.config import KLConfig
from emapg_megatron.lora.config import LoRAConfig
from emapg_megatron.models.config import (
    ModelConfig,
    ModelOptions,
    MoEOptions,
    PrecisionConfig,
    validate_fp8_shapes,
)
from emapg_megatron.rollout.config import (
    VLLM_MAX_LORA_RANKS,
    PartialRolloutConfig,
    SamplerConfig,
    VLLMConfig,
)
from emapg_megatron.run.config import CheckpointConfig, EvalConfig, LogConfig, LoopConfig
from emapg_megatron.runtime.config import ParallelConfig
from emapg_megatron.tasks.config import TaskConfig
from emapg_megatron.training.config import OptimConfig

PRESETS_PACKAGE = "emapg_megatron.presets"
DRY_RUN_OUTPUTS = ("summary", "json")


@dataclass
class LaunchOptions:
    """How this command runs: a preset, a YAML file, a dry run."""

    preset: str | None = option(None)
    """Named configuration shipped with the package, e.g. tiny-cpu."""
    config: str | None = option(None)
    """YAML file supplying any flag; the command line overrides it."""
    dry_run: str | bool = option(False, choices=DRY_RUN_OUTPUTS, const="summary")
    """Validate everything (flags, data, model, layout) in one process, print what would run,
    then exit: no rank starts. --dry-run prints a short summary, --dry-run=json every resolved
    setting as JSON. Default: off (the run starts)."""
    world_size: int | None = option(None, range=at_least(1))
    """World size to validate a --dry-run against (default: $WORLD_SIZE or 1); a real run launched
    by torchrun with another $WORLD_SIZE is refused."""


@dataclass
class RunConfig:
    """Everything a training run is configured by: one config per component, in step order."""

    launch: LaunchOptions = field(default_factory=LaunchOptions)
    loop: LoopConfig = field(default_factory=LoopConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    moe: MoEOptions = field(default_factory=MoEOptions)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    step: StepConfig = field(default_factory=StepConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    partial_rollouts: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def flags(self) -> dict:
        """``{flag dest: value}`` of every option: what --dry-run prints and a checkpoint records."""
        return configurable.flat(self)

    def vllm_engine_config(self) -> VLLMConfig:
        """vLLM's config with what the run decides: the model directory, seed, TP degree and LoRA."""
        return replace(self.vllm, hf_dir=self.model.load_hf or "", seed=self.loop.seed,
                       lora=self.lora if self.lora.enabled else None).for_trainer(
            self.parallel.tensor_model_parallel_size)


# --- the command line -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = configurable.ArgumentParser(
        prog="emapg-train",
        usage="emapg-train [--nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P | "
              "--standalone]] [--preset NAME] [--config FILE.yaml] [flags]",
        description="EMA Policy Gradient / GRPO on Megatron-Core. emapg-train checks every flag, the "
                    "data and the model in one process, then starts --nproc-per-node ranks with "
                    "torchrun (`torchrun -m emapg_megatron.train FLAGS` works too, without that "
                    "check). The defaults are small (a model that trains on a CPU); a real model "
                    "comes from --load-hf's config.json, and its run sets --seq-length and "
                    "--max-new-tokens for its prompts (the error on a prompt that does not fit names "
                    "the values that do). A first run on a CPU: emapg-train --standalone "
                    "--nproc-per-node 2 --preset tiny-cpu. "
                    "Megatron-LM's names for the same settings are accepted (--grpo-group-size, "
                    "--grpo-kl-beta, ...).",
        formatter_class=configurable.HelpFormatter,
    )
    configurable.add_arguments(parser, RunConfig)
    return parser


def preset_path(name: str) -> str:
    path = resources.files(PRESETS_PACKAGE) / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir()
                           if p.name.endswith(".yaml"))
        raise ConfigError(f"unknown --preset {name!r}; available: {', '.join(available)}")
    return str(path)


def parse_args(argv=None) -> RunConfig:
    """The run's config from ``argv``: defaults < --preset (the command line's, else the YAML's
    ``preset:``) < --config < the command line."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    yaml = configurable.yaml_defaults(parser, first.config, "--config file", ("config",)) if first.config else {}
    preset = first.preset or yaml.pop("preset", None)
    if preset:
        parser.set_defaults(**configurable.yaml_defaults(parser, preset_path(preset), "preset", ("preset", "config")))
    parser.set_defaults(**yaml)
    return configurable.build(RunConfig, vars(parser.parse_args(argv)))


# --- the rules ------------------------------------------------------------------------------
def validate(cfg: RunConfig, world_size: int) -> None:
    """Every check that needs no process group and no model: each component's own, then the
    rules that join components. Raises ConfigError with one line.

    A ``--dry-run`` skips only what needs the target machine (a GPU, writable output paths).
    """
    dry = cfg.launch.dry_run
    configurable.check_fields(cfg.launch)
    cfg.loop.validate()
    cfg.step.validate()
    cfg.parallel.validate(world_size, check_devices=not dry)
    cfg.model.validate()
    cfg.moe.validate()
    cfg.precision.validate()
    cfg.optim.validate()
    cfg.checkpoint.validate()
    cfg.log.validate()
    cfg.eval.validate()
    _check(not cfg.eval.eval_interval or cfg.task.built_in or cfg.eval.eval_data_path is not None,
           f"--eval-interval needs --eval-data-path (held-out prompts of --task {cfg.task.name})")
    cfg.task.validate(cfg.model.load_hf)
    cfg.sampler.validate()
    cfg.partial_rollouts.validate()
    cfg.vllm.check_settings(trainer_tp=cfg.parallel.tensor_model_parallel_size)
    cfg.loss.validate()
    cfg.kl.validate()
    cfg.ema.validate(cfg.optim.use_distributed_optimizer)
    cfg.teacher.validate()
    cfg.lora.validate()
    _validate_lora(cfg)
    _validate_partial_rollouts(cfg, world_size)  # before the engines' rules: it names what to drop
    _validate_teacher(cfg)
    _validate_schedule(cfg)
    _validate_batches(cfg, world_size)
    _validate_engines(cfg)
    configurable.check_paths(cfg, outputs=not dry)
    if not dry:  # a dry run's paths may be another machine's
        validate_fresh_outputs(cfg)


def _validate_teacher(cfg: RunConfig) -> None:
    """A teacher replaces the EMA anchor: the EMA's flags cannot apply, and the teacher must be used."""
    teacher = cfg.teacher
    if not teacher.path:
        _check(cfg.step.task_reward, "--no-task-reward is for distillation: it needs a teacher "
                                     "(--teacher-load-hf or --teacher-checkpoint)")
        return
    for f in configurable.option_fields(EmaConfig):
        _check(getattr(cfg.ema, f.name) == f.default,
               f"{configurable.flag_of(f)} cannot apply with {teacher.flag}: the teacher replaces the "
               "EMA anchor (the EMA is not kept)")
    _check(cfg.loss.kl_coef > 0 or cfg.step.kl_in_reward_coef > 0,
           f"{teacher.flag} needs --kl-coef > 0 (the KL to the teacher in the loss) or "
           "--kl-in-reward-coef > 0 (its sampled log-ratio in the reward)")


def _validate_lora(cfg: RunConfig) -> None:
    """What LoRA (--lora-rank > 0) does not support yet, each refused in one line (docs/lora.md)."""
    if cfg.lora.peft_init:
        from emapg_megatron.checkpoint.peft_format import rank_needed, read_peft_config

        folder, peft = cfg.lora.peft_init, read_peft_config(cfg.lora.peft_init)
        scale = peft.alpha / peft.rank  # peft's update scale, which the run must keep

        def fits(rank: int) -> bool:
            return cfg.lora.rank >= rank and math.isclose(cfg.lora.alpha / cfg.lora.rank, scale, rel_tol=1e-9)

        _check(fits(peft.rank), f"--lora-peft-init {folder} is rank {peft.rank}, alpha {peft.alpha:g}: give "
               f"--lora-rank {peft.rank} --lora-alpha {peft.alpha:g} (or a larger rank with alpha / rank "
               f"{scale:g})")
        _check(cfg.teacher.path or cfg.ema.eta < 1.0,
               "--lora-peft-init with --ema-eta 1: that anchor is the base model without adapters, "
               "which is the start only when B = 0; use --ema-eta below 1 (the EMA starts from the "
               "adapter)")
        needed = rank_needed(folder)  # more than peft's r where a fused layer's projections have their own A
        _check(fits(needed), f"--lora-peft-init {folder} gives the projections of a fused layer their own "
               f"lora_A (rank {peft.rank} each): stacked, they load as one adapter of rank {needed} per "
               f"layer; give --lora-rank {needed} --lora-alpha {needed * scale:g} (alpha / rank {scale:g}, "
               "as peft's)")
    if not cfg.lora.enabled:
        return
    rank = f"--lora-rank {cfg.lora.rank}"
    _check(cfg.sampler.engine != "vllm" or cfg.lora.rank <= VLLM_MAX_LORA_RANKS[-1],
           f"{rank} is above vLLM's largest max_lora_rank ({VLLM_MAX_LORA_RANKS[-1]}): use the "
           "built-in sampler or a lower rank")


def _validate_schedule(cfg: RunConfig) -> None:
    """The learning-rate schedule against the run's length, as Megatron's scheduler asserts it."""
    warmup, total = cfg.optim.lr_warmup_iters, cfg.loop.train_iters
    _check(warmup < total, f"--lr-warmup-iters {warmup} must be below --train-iters {total}")


def _validate_batches(cfg: RunConfig, world_size: int) -> None:
    step, tp = cfg.step, cfg.parallel.tensor_model_parallel_size
    dp = cfg.parallel.data_parallel_size(world_size)
    gbs = step.mini_batch_size
    _check(step.rollout_batch_size % dp == 0,
           f"--rollout-batch-size {step.rollout_batch_size} is not divisible by the data-parallel size {dp}")
    _check(gbs % (step.num_samples * dp) == 0,
           f"--global-batch-size {gbs} must hold whole prompt groups split evenly over data-parallel "
           f"ranks: a multiple of --num-samples-per-prompt {step.num_samples} x DP {dp}")
    _check(gbs % (step.micro_batch_size * dp) == 0,
           f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
           f"{step.micro_batch_size} x data-parallel size {dp}")
    _check(not cfg.parallel.sequence_parallel or step.seq_length % tp == 0,
           f"--sequence-parallel needs --seq-length {step.seq_length} divisible by "
           f"--tensor-model-parallel-size {tp}")


def _validate_engines(cfg: RunConfig) -> None:
    vllm = cfg.sampler.engine == "vllm"
    _check(not vllm or cfg.model.load_hf is not None,
           "--rollout-engine vllm needs --load-hf (vLLM reads the tokenizer and config from it)")
    _check(not vllm or cfg.parallel.device != "cpu",
           "--rollout-engine vllm needs a GPU: drop --device cpu, or sample with the built-in "
           "--rollout-engine megatron")
    _check(cfg.loss.rollout_is == "none" or (cfg.step.temperature == 1.0 and cfg.step.top_p == 1.0),
           "--rollout-is compares the engine's log-probs with the trainer's, which are taken at "
           "temperature 1 without top-p: it needs --temperature 1 --top-p 1")


def _validate_partial_rollouts(cfg: RunConfig, world_size: int) -> None:
    """What --partial-rollouts does not support yet, each refused in one line (it is off by
    default; docs/partial_rollouts.md)."""
    if not cfg.partial_rollouts.enabled:
        return
    why = partial_rollouts_refusal(cfg, world_size)
    _check(why is None, f"--partial-rollouts {why}")


def partial_rollouts_refusal(cfg: RunConfig, world_size: int) -> str | None:
    """Why the run's other flags rule out --partial-rollouts (None when they do not)."""
    sampler, dp = cfg.sampler, cfg.parallel.data_parallel_size(world_size)
    rules = (
        (sampler.engine != "megatron", "needs the built-in sampler (--rollout-engine megatron): it "
                                       "continues sequences through its KV cache"),
        (not sampler.kv_cache, "needs the KV-cached sampler (drop --no-rollout-kv-cache)"),
        (cfg.parallel.sequence_parallel, "does not support --sequence-parallel (no KV-cached sampling "
                                         "under it)"),
        (dp > 1 and sampler.fixed_shape is False,
         f"at data-parallel size {dp} needs the fixed-shape decode step (drop "
         "--no-inference-fixed-shape-decode): only its ranks can agree after each step when to stop"),
        (cfg.task.name == "search", "does not support multi-turn tasks (--task search): an "
                                    "episode's environment state cannot be carried between steps"),
    )
    return next((why for refused, why in rules if refused), None)


def validate_fresh_outputs(cfg: RunConfig) -> None:
    """A new run never silently replaces an earlier one's checkpoints or metrics (checked again
    once the run holds the locks of its output folders: two runs started together both pass it
    before either has written)."""
    ckpt, log_dir = cfg.checkpoint, cfg.log.log_dir
    if ckpt.overwrite:
        return
    resumes_it = ckpt.load is not None and os.path.realpath(ckpt.load) == os.path.realpath(ckpt.save or "")
    _check(not holds_checkpoint(ckpt.save) or resumes_it,
           f"--save {ckpt.save} holds the checkpoints of an earlier run: pass --load {ckpt.save} to "
           "resume it, another --save, or --overwrite to delete them and start over")
    metrics = cfg.log.metrics_path
    # (a run that saved there to resume from was refused above, with --load in its message)
    _check(ckpt.load is not None or not os.path.isfile(metrics) or os.path.getsize(metrics) == 0,
           f"--log-dir {log_dir} holds the metrics of an earlier run: pass another --log-dir, or "
           "--overwrite to delete them and start over")


def validate_architecture(cfg: RunConfig, model_cfg: ModelConfig) -> None:
    """The rules that join the resolved architecture (flags or --load-hf's config.json) with the
    layout, the KL estimator and FP8."""
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    ep = cfg.parallel.expert_model_parallel_size
    model_cfg.check_entries("the model")  # the bounds a config.json is held to, before any sizing
    model_cfg.validate(tp, pp, ep)
    _check(not (cfg.lora.enabled and model_cfg.is_moe),
           f"--lora-rank {cfg.lora.rank} does not support mixture-of-experts models yet: this one has "
           f"{model_cfg.num_experts} experts per layer")
    if model_cfg.is_moe:
        per_stage = model_cfg.num_layers // pp
        for stage in range(pp):
            layers = range(stage * per_stage, (stage + 1) * per_stage)
            _check(any(model_cfg.is_moe_layer(i) for i in layers),
                   f"--pipeline-model-parallel-size {pp} gives stage {stage} only dense-MLP layers "
                   f"({layers.start}-{layers.stop - 1}): every stage of a MoE model needs a MoE layer "
                   "(its expert groups' collectives span the stages); use fewer stages")
        _check(tp == 1 or cfg.parallel.sequence_parallel,
               f"Megatron's MoE layers train at --tensor-model-parallel-size {tp} only with "
               "--sequence-parallel: add it (or use expert parallelism instead of TP)")
    if cfg.moe.routing_replay != "none":
        _check(model_cfg.is_moe, f"--moe-routing-replay {cfg.moe.routing_replay} needs a mixture-of-experts "
                                 "model: this one is dense")
        for flag, on in (("--pipeline-model-parallel-size > 1", pp > 1),
                         ("--sequence-packing", cfg.step.sequence_packing)):
            _check(not on, f"--moe-routing-replay {cfg.moe.routing_replay} does not support {flag} yet "
                           "(the recorded routes are laid out per padded sequence, on every stage)")
    if ep > 1:  # the expert group's ranks must run the same forwards (rollout/expert_group.py)
        for flag, on in (("--partial-rollouts", cfg.partial_rollouts.enabled),
                         ("--sequence-packing", cfg.step.sequence_packing)):
            _check(not on, f"{flag} is not supported at --expert-model-parallel-size {ep} yet "
                           "(the expert group's ranks would run different forwards)")
    if cfg.moe.grouped_gemm and model_cfg.is_moe and (cfg.parallel.device == "cpu" or (
            not cfg.launch.dry_run and cfg.parallel.resolved_device() == "cpu")):
        raise ConfigError("--moe-grouped-gemm runs on a GPU (Transformer Engine's grouped GEMM): "
                          "drop it in CPU mode")
    k, vocab = cfg.kl.topk_tokens, model_cfg.vocab_size
    _check(k <= vocab, f"--kl-topk-tokens {cfg.kl.k} exceeds the vocabulary ({vocab}): use at most "
                       f"{vocab} (that many is the exact KL); the synthetic task's first run is --preset tiny-cpu")
    if cfg.precision.fp8_format is not None:
        validate_fp8_shapes(model_cfg, tp, cfg.step.seq_length, cfg.parallel.sequence_parallel,
                            etp=cfg.parallel.expert_tensor_size)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

