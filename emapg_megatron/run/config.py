"""Configs of the run's shell: how many steps, evaluation, checkpoints and logs. Plain dataclasses
(no torch, no Megatron): the CLI checks them first."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from emapg_megatron.configurable import at_least, check_fields, option
from emapg_megatron.errors import ConfigError


@dataclass
class LoopConfig:
    """The run: how many steps, its seed, when to give up."""

    seed: int = option(1234, range=at_least(0), trajectory=True)
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
