"""Forward-only and forward-backward passes through Megatron's pipeline schedules.

Every pass over the model (sampling, the old-policy and anchor passes, training) goes
through ``get_forward_backward_func()``, so the same code runs at any PP size. A pass takes
a list of micro-batches (dicts of equal-shape tensors; ``tokens`` is ``[mbs, seq]``) and a
function of ``(logits_shard, micro_batch)`` evaluated on the last pipeline stage, where
``logits_shard`` is ``[mbs, seq, V/TP]``.
"""

from __future__ import annotations

from typing import Callable

import torch


def positions_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's vocab-sharded logits in its compute dtype.

    Megatron's ``Float16Module`` casts bf16 logits to fp32 unless told not to: a second, twice as
    large copy of the biggest activation. The vocab-parallel ops upcast chunk by chunk instead.
    """
    from megatron.core.transformer.module import Float16Module

    kwargs = {"fp32_output": False} if isinstance(getattr(model, "module", None), Float16Module) else {}
    return model(tokens, positions_for(tokens), None, **kwargs)


def _run(model_chunks, microbatches: list[dict], forward_step, *, forward_only: bool,
         collect_non_loss_data: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs, seq = microbatches[0]["tokens"].shape
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model_chunks,
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def forward_only(model_chunks, microbatches: list[dict],
                 compute: Callable[[torch.Tensor, dict], dict]) -> list[dict]:
    """``compute(logits_shard, mb)`` per micro-batch on the last stage (no grad).

    Returns the list of ``compute`` outputs on the last pipeline stage, ``[]`` elsewhere.
    """

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = logits_of(model, mb["tokens"])

        def collect(output, non_loss_data=False):
            return compute(output, mb)

        return logits, collect

    with torch.no_grad():
        return _run(model_chunks, microbatches, forward_step, forward_only=True,
                    collect_non_loss_data=True)


def forward_backward(model_chunks, microbatches: list[dict],
                     loss: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]) -> list[dict]:
    """Accumulate gradients of ``loss(logits_shard, mb) -> (scalar, metrics)`` over micro-batches.

    Megatron divides each micro-batch loss by the number of micro-batches and DDP averages
    over data-parallel ranks; ``loss`` must be scaled accordingly by the caller. Returns the
    per-micro-batch metrics dicts on the last stage.
    """

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = logits_of(model, mb["tokens"])
        return logits, lambda output: loss(output, mb)

    return _run(model_chunks, microbatches, forward_step, forward_only=False,
                collect_non_loss_data=False)


def split_microbatches(batch: dict, micro_batch_size: int) -> list[dict]:
    """Split a dict of ``[S, ...]`` tensors (None values kept) into micro-batches."""
    n = next(v for v in batch.values() if v is not None).shape[0]
    return [{k: (v[i:i + micro_batch_size] if v is not None else None) for k, v in batch.items()}
            for i in range(0, n, micro_batch_size)]


def concat_outputs(outputs: list[dict]) -> dict:
    """Concatenate per-micro-batch output dicts along dim 0."""
    if not outputs:
        return {}
    return {k: torch.cat([o[k] for o in outputs], dim=0) for k in outputs[0]}
