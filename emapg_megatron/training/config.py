"""Config of the Megatron machinery's optimizer and its LR schedule. A plain dataclass (no Megatron
import): the CLI checks it first."""

from __future__ import annotations

import math
from dataclasses import dataclass

from emapg_megatron.configurable import above, at_least, between, check_fields, option
from emapg_megatron.errors import ConfigError


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
