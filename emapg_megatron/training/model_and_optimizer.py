"""Wrap this rank's GPTModel in Megatron DDP and build the Megatron optimizer."""

from __future__ import annotations

from dataclasses import replace

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from emapg_megatron.models.config import ModelConfig, MoEOptions, PrecisionConfig
from emapg_megatron.models.gpt import build_for_this_rank
from emapg_megatron.training.config import OptimConfig


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
                              *, sequence_parallel: bool = False, moe: MoEOptions | None = None,
                              lora=None, seed: int = 0):
    """Returns ``([ddp_model], optimizer)`` for this rank's TP/PP/DP position.

    With ``lora`` (an enabled :class:`~emapg_megatron.lora.config.LoRAConfig`) the model takes its
    adapters before DDP wraps it (``lora.apply.apply_lora``, A drawn from ``seed``): the base
    weights are frozen, so DDP gives them no gradient buffer and the optimizer neither state nor
    fp32 main copy; only the adapters train. ``auto`` builds Megatron's local layers then, unless
    FP8 asks for Transformer Engine's: adapters on TE's linears are CPU-tested against stand-ins
    only (docs/lora.md), so TE is chosen explicitly. Load base weights afterwards.

    As in Megatron-LM's training loop, the model config carries Megatron's
    ``finalize_model_grads``, which the pipeline schedule calls after the last backward: the DP
    reduction, the tied-embedding sum over the first and last stage, and the sum over TP of the
    gradients of TP-replicated weights (qk-layernorm, and all norms under sequence parallelism).
    """
    prec = prec or PrecisionConfig()
    if lora is not None and lora.enabled and prec.transformer_impl == "auto" and prec.fp8_format is None:
        prec = replace(prec, transformer_impl="local")  # until TE's adapters have run on a GPU
    model = build_for_this_rank(cfg, prec, sequence_parallel=sequence_parallel, moe=moe)
    if prec.bf16:
        model = Float16Module(model.config, model)  # casts weights and activations to bf16
    if lora is not None and lora.enabled:
        from emapg_megatron.lora.apply import apply_lora

        apply_lora(model, lora, seed=seed)
    model = wrap_ddp(model, use_distributed_optimizer=optim.use_distributed_optimizer)
    model.config.finalize_model_grads_func = finalize_model_grads
    return [model], build_optimizer([model], optim, prec)


def zero_grads(model_chunks, optimizer) -> None:
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


