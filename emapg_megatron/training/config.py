"""Configs of the Megatron machinery: the parallel layout, the optimizer and its LR schedule, the
loop, checkpoints and logs. Plain dataclasses (no Megatron import): the CLI checks them first."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch

from emapg_megatron.configurable import above, at_least, between, check_fields, option
from emapg_megatron.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout, the device and the process groups."""

    tensor_model_parallel_size: int = option(1, range=at_least(1))
    """TP degree (vocab-sharded logits)."""
    pipeline_model_parallel_size: int = option(1, range=at_least(1))
    """PP degree."""
    sequence_parallel: bool = option(False)
    """Megatron sequence parallelism: with TP >= 2, shard the norms' and dropout's activations
    along the sequence over the TP group (needs --seq-length divisible by TP)."""
    device: str = option("auto", choices=("auto", "cpu", "cuda"))
    """cpu runs Megatron-Core on the CPU with gloo; auto picks cuda when a GPU is visible."""
    backend: str = option("auto", flag="--distributed-backend", choices=("auto", "gloo", "nccl"))
    """torch.distributed backend; auto = nccl on GPU, gloo on CPU."""
    timeout_minutes: int = option(30, flag="--distributed-timeout-minutes", range=at_least(1))
    """Timeout of every collective, Megatron's groups included: a dead peer ends the run."""

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def validate(self, world_size: int, *, check_devices: bool = True) -> None:
        """The layout against ``world_size`` and the machine (``check_devices=False``: a dry run,
        maybe of a GPU launch on a CPU machine). Model shapes against TP/PP: ModelConfig.validate."""
        check_fields(self)
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        backend = self.resolved_backend()
        if not check_devices and self.device == "cuda" and self.backend == "auto":
            backend = "nccl"  # a dry run on a CPU machine of a GPU launch
        if self.resolved_device() == "cpu" and backend == "nccl":
            raise ConfigError("CPU mode cannot use the nccl backend: use --distributed-backend gloo")
        if check_devices and self.resolved_device() == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but no GPU is visible")
        if world_size % (tp * pp) != 0:
            raise ConfigError(f"world size {world_size} is not TP x PP x DP: TP={tp} x PP={pp} "
                              "does not divide it")
        if self.sequence_parallel and tp < 2:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size >= 2")


@dataclass
class OptimConfig:
    """Megatron's Adam optimizer (``get_megatron_optimizer``) and its LR schedule
    (``OptimizerParamScheduler``)."""

    lr: float = option(1e-6, range=at_least(0))
    """Peak learning rate."""
    min_lr: float = option(0.0, range=at_least(0))
    """Final learning rate of the decay."""
    lr_decay_style: str = option("constant", choices=("constant", "linear", "cosine"))
    """Learning-rate schedule after warm-up."""
    lr_warmup_iters: int = option(0, range=at_least(0))
    """Linear warm-up steps."""
    lr_warmup_fraction: float | None = option(None, range=between(0, 1, high_open=True))
    """Warm-up as a fraction of --train-iters, in [0, 1) (instead of --lr-warmup-iters)."""
    weight_decay: float = option(0.01, range=at_least(0))
    """AdamW weight decay."""
    adam_beta1: float = option(0.9, range=between(0, 1, high_open=True))
    """Adam beta1."""
    adam_beta2: float = option(0.999, range=between(0, 1, high_open=True))
    """Adam beta2."""
    adam_eps: float = option(1e-8, range=above(0))
    """Adam epsilon."""
    clip_grad: float = option(1.0, range=at_least(0))
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = option(False)
    """Shard optimizer state and fp32 main params across data-parallel ranks."""

    def warmup_iters(self, train_iters: int) -> int:
        """Warm-up in trainer steps: --lr-warmup-fraction of --train-iters, else --lr-warmup-iters."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * train_iters)
        return self.lr_warmup_iters

    def validate(self) -> None:
        """The optimizer's flags, checked once (raises ConfigError with one line)."""
        finite = all(math.isfinite(v) for v in (self.lr, self.min_lr, self.weight_decay, self.adam_eps,
                                                self.clip_grad))
        checks = [
            (finite, "--lr, --min-lr, --weight-decay, --adam-eps and --clip-grad must be finite"),
            (0.0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr <= --lr (got {self.min_lr}, {self.lr})"),
            (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0,
             f"--adam-beta1 and --adam-beta2 must be in [0, 1) (got {self.adam_beta1}, {self.adam_beta2})"),
            (self.lr_warmup_fraction is None or self.lr_warmup_iters == 0,
             "give --lr-warmup-iters or --lr-warmup-fraction, not both"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        check_fields(self)


@dataclass
class LoopConfig:
    """The run: how many steps, its seed, when to give up."""

    seed: int = option(1234, range=at_least(0))
    """Random seed for weights, data order and sampling."""
    train_iters: int = option(100, range=at_least(1))
    """Total trainer steps; a run resumed with --load continues up to this total."""
    max_skipped_steps: int = option(10, range=at_least(0))
    """The run stops when more than this many steps (counted across resumes) were skipped for a
    NaN/inf loss or gradient."""

    def validate(self) -> None:
        check_fields(self)


@dataclass
class EvalConfig:
    """Periodic evaluation on held-out prompts during training."""

    eval_interval: int = option(0, range=at_least(0))
    """Every N steps, sample --eval-samples responses to each held-out prompt and log Pass@k
    (eval/pass@1, eval/pass@2, ..., eval/pass@N) with the step's metrics; 0: off."""
    eval_data_path: str | None = option(None, path="exists")
    """Held-out prompts (parquet/jsonl, the task's columns); the built-in task uses its own rows."""
    eval_samples: int = option(4, range=at_least(1))
    """Responses per held-out prompt (the n of Pass@k)."""
    eval_max_prompts: int = option(64, range=at_least(1))
    """Evaluate at most this many prompts of the file (its first ones)."""

    def due(self, step: int) -> bool:
        return bool(self.eval_interval) and step % self.eval_interval == 0

    def validate(self) -> None:
        check_fields(self)


@dataclass
class CheckpointConfig:
    """Where checkpoints are written and read."""

    save: str | None = option(None, path="output")
    """Checkpoint directory to write."""
    load: str | None = option(None, path="dir")
    """Checkpoint directory to resume from."""
    save_interval: int = option(0, range=at_least(0))
    """Save every N steps (0: only at the end)."""
    overwrite: bool = option(False)
    """Start a fresh run (no --load) where an earlier one left its checkpoints (--save) or metrics
    (--log-dir): those are deleted first. Without it, such a start is refused."""

    def due(self, iteration: int) -> bool:
        """Whether step ``iteration`` saves on the interval."""
        return bool(self.save and self.save_interval and iteration % self.save_interval == 0)

    def validate(self) -> None:
        check_fields(self)


METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
ROLLOUTS_FILE = "rollouts.jsonl"


@dataclass
class LogConfig:
    """Metrics, curves, TensorBoard, W&B and rollout dumps."""

    log_dir: str = option("runs/emapg", path="output")
    """metrics.jsonl, curves.png and TensorBoard go here."""
    tensorboard_dir: str | None = option(None, path="output")
    """TensorBoard directory (default: LOG_DIR/tensorboard)."""
    log_interval: int = option(1, range=at_least(1))
    """Print a progress line every N steps."""
    rollout_dump_interval: int = option(0, range=at_least(0))
    """Every N steps, append the step's prompts, responses and rewards (every sequence, all DP
    ranks) to LOG_DIR/rollouts.jsonl, one JSON object per line; 0: off."""
    wandb_project: str | None = option(None)
    """Log the metrics to this Weights & Biases project as well (pip install
    'emapg-megatron[wandb]'; WANDB_MODE=offline keeps the run on disk under LOG_DIR)."""
    wandb_exp_name: str | None = option(None)
    """The W&B run's name (default: W&B's)."""

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.log_dir, METRICS_FILE)

    @property
    def tensorboard_root(self) -> str:
        """Where each run's TensorBoard folder goes (--tensorboard-dir, else LOG_DIR/tensorboard)."""
        return self.tensorboard_dir or os.path.join(self.log_dir, "tensorboard")

    def earlier_run_files(self) -> list[str]:
        """What a run writes here that --overwrite deletes: the metrics, the curves, the default
        TensorBoard folder (a --tensorboard-dir given may be shared and is kept)."""
        own_tb = [] if self.tensorboard_dir else [self.tensorboard_root]
        paths = [self.metrics_path, os.path.join(self.log_dir, CURVES_FILE),
                 os.path.join(self.log_dir, ROLLOUTS_FILE), *own_tb]
        return [p for p in paths if os.path.exists(p)]

    def dumps_rollouts(self, step: int) -> bool:
        return bool(self.rollout_dump_interval) and step % self.rollout_dump_interval == 0

    def validate(self) -> None:
        check_fields(self)
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project needs wandb, which is not installed: "
                              "pip install 'emapg-megatron[wandb]'")
