"""Wrap this rank's GPTModel in Megatron DDP and build the Megatron optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from emapg_megatron.models.gpt import ModelConfig, PrecisionConfig, build_for_this_rank
from emapg_megatron.runtime import ConfigError


@dataclass
class OptimConfig:
    """Megatron's Adam optimizer (``get_megatron_optimizer``)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and fp32 main params across data-parallel ranks."""

    def validate(self) -> None:
        """The optimizer's flags, checked once (raises ConfigError with one line)."""
        finite = all(math.isfinite(v) for v in (self.lr, self.min_lr, self.weight_decay, self.adam_eps,
                                                self.clip_grad))
        checks = [
            (finite, "--lr, --min-lr, --weight-decay, --adam-eps and --clip-grad must be finite"),
            (0.0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr <= --lr (got {self.min_lr}, {self.lr})"),
            (self.weight_decay >= 0.0, f"--weight-decay must be >= 0 (got {self.weight_decay})"),
            (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0,
             f"--adam-beta1 and --adam-beta2 must be in [0, 1) (got {self.adam_beta1}, {self.adam_beta2})"),
            (self.adam_eps > 0.0, f"--adam-eps must be > 0 (got {self.adam_eps})"),
            (self.clip_grad >= 0.0, f"--clip-grad must be >= 0 (got {self.clip_grad})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def wrap_ddp(model, *, use_distributed_optimizer: bool):
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(model_chunks: list, optim: OptimConfig, prec: PrecisionConfig):
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=prec.bf16,
        params_dtype=prec.params_dtype(),
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_model_and_optimizer(cfg: ModelConfig, optim: OptimConfig, prec: PrecisionConfig | None = None,
                              *, sequence_parallel: bool = False):
    """Returns ``([ddp_model], optimizer)`` for this rank's TP/PP/DP position.

    As in Megatron-LM's training loop, the model config carries Megatron's
    ``finalize_model_grads``, which the pipeline schedule calls after the last backward: the DP
    reduction, the tied-embedding sum over the first and last stage, and the sum over TP of the
    gradients of TP-replicated weights (qk-layernorm, and all norms under sequence parallelism).
    """
    prec = prec or PrecisionConfig()
    model = build_for_this_rank(cfg, prec, sequence_parallel=sequence_parallel)
    if prec.bf16:
        model = Float16Module(model.config, model)  # casts weights and activations to bf16
    model = wrap_ddp(model, use_distributed_optimizer=optim.use_distributed_optimizer)
    model.config.finalize_model_grads_func = finalize_model_grads
    return [model], build_optimizer([model], optim, prec)


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def zero_grads(model_chunks, optimizer) -> None:
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


@torch.no_grad()
def global_param_name(gpt_model, name: str) -> str:
    """Rename local ``decoder.layers.i.`` to the global layer index (PP-stage independent)."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    global_index = gpt_model.decoder.layers[int(local)].layer_number - 1
    return f"{prefix}{global_index}.{rest}"
