"""Forward-only and forward-backward passes through Megatron's pipeline schedules.

Every pass over the model (sampling, the old-policy and anchor passes, training) goes
through ``get_forward_backward_func()``, so the same code runs at any PP size. A pass takes
a list of micro-batches (dicts of equal-shape tensors; ``tokens`` is ``[mbs, seq]``) and a
function of ``(head_input, micro_batch)`` evaluated on the last pipeline stage: the vocab-sharded
logits ``[mbs, seq, V/TP]``, or with the fused LM head the final hidden states with the output
weight (``HiddenAndWeight``). Each micro-batch's layout (``training.microbatches``) says what the
model is given besides the tokens: nothing for padded rows, the sequence boundaries for a packed one.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from emapg_megatron.models.hidden_output import output_layer_bypassed
from emapg_megatron.models.routing_replay import ROUTES, recording, replaying
from emapg_megatron.parallel.output_heads import HiddenAndWeight
from emapg_megatron.training.microbatches import layout_of
from emapg_megatron.training.packing import rope_at


def positions_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def model_output(model, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, packed_seq_params=None,
                 **model_kwargs) -> torch.Tensor:
    """What this pipeline stage outputs, in the model's compute dtype: the vocab-sharded logits
    on the last stage (the final hidden states while ``models.hidden_output`` bypasses the output
    layer), hidden states on the others.

    Megatron's ``Float16Module`` casts bf16 logits to fp32 unless told not to: a second, twice as
    large copy of the biggest activation. The vocab-parallel ops upcast chunk by chunk instead.
    The keyword arguments carry packed sequences (``PackedRow.model_inputs``); given
    ``position_ids`` without ``packed_seq_params``, RoPE is taken at them (``packing.rope_at``).
    ``model_kwargs`` go to the model as they are (``OutputCapture.model_kwargs``).
    """
    kwargs = {"fp32_output": False} if isinstance(getattr(model, "module", None), Float16Module) else {}
    kwargs.update(model_kwargs)
    if packed_seq_params is not None:
        kwargs["packed_seq_params"] = packed_seq_params
    positions = positions_for(tokens) if position_ids is None else position_ids
    with rope_at(model, position_ids if packed_seq_params is None else None):
        return model(tokens, positions, attention_mask, **kwargs)


def _stage_output(model, mb: dict, **model_kwargs) -> torch.Tensor:
    return model_output(model, mb["tokens"], **layout_of(mb).model_inputs(model, mb), **model_kwargs)


def _output(model, mb: dict, fused_lmhead: bool):
    """(the stage's output tensor, what the last stage's function is given).

    With ``fused_lmhead`` the output layer is bypassed (``models.hidden_output``): the last stage
    hands its functions the final hidden states with the output weight (``HiddenAndWeight``) and
    the logits are formed chunk by chunk by ``parallel.lmhead_terms``. Other stages are unchanged.
    """
    if not fused_lmhead:
        logits = _stage_output(model, mb)
        return logits, lambda output: output
    with output_layer_bypassed(model) as cap:
        hidden = _stage_output(model, mb, **cap.model_kwargs)
    weight = cap.weight
    return hidden, lambda output: output if weight is None else HiddenAndWeight(output, weight)


def _run(model_chunks, microbatches: list[dict], forward_step, *, forward_only: bool,
         collect_non_loss_data: bool):
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
                 compute: Callable[[torch.Tensor, dict], dict], *, fused_lmhead: bool = False,
                 record_routes: torch.dtype | None = None, replay_routes: bool = False) -> list[dict]:
    """``compute(head_input, mb)`` per micro-batch on the last stage (no grad): the logits shard,
    or with ``fused_lmhead`` the ``HiddenAndWeight``. ``record_routes``: also the experts a MoE
    policy's routers chose for each token, as ``ROUTES`` in that dtype (``models.routing_replay``).
    ``replay_routes``: a micro-batch carrying ``ROUTES`` is routed by them (R3's old pass); else
    a forward-only pass routes itself, whatever the batch carries (the anchor pass).

    Returns the list of ``compute`` outputs on the last pipeline stage, ``[]`` elsewhere.
    """

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if record_routes is None:
            with replaying(model, mb.get(ROUTES) if replay_routes else None):
                out, head_input = _output(model, mb, fused_lmhead)
            routes = None
        else:
            with recording(model, *mb["tokens"].shape, record_routes) as recorded:
                out, head_input = _output(model, mb, fused_lmhead)
                routes = recorded()

        def collect(output, non_loss_data=False):
            got = compute(head_input(output), mb)
            return got if routes is None else {**got, ROUTES: routes}

        return out, collect

    with torch.no_grad():
        return _run(model_chunks, microbatches, forward_step, forward_only=True,
                    collect_non_loss_data=True)


def forward_backward(model_chunks, microbatches: list[dict],
                     loss: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]], *,
                     fused_lmhead: bool = False) -> list[dict]:
    """Accumulate gradients of ``loss(head_input, mb) -> (scalar, metrics)`` over micro-batches
    (``head_input``: the logits shard, or with ``fused_lmhead`` the ``HiddenAndWeight``).

    Megatron divides each micro-batch loss by the number of micro-batches and DDP averages
    over data-parallel ranks; ``loss`` must be scaled accordingly by the caller. Returns the
    per-micro-batch metrics dicts on the last stage. A micro-batch carrying ``ROUTES`` (a MoE
    policy under routing replay) is routed by them.
    """

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        with replaying(model, mb.get(ROUTES)):
            out, head_input = _output(model, mb, fused_lmhead)
        return out, lambda output: loss(head_input(output), mb)

    return _run(model_chunks, microbatches, forward_step, forward_only=False,
                collect_non_loss_data=False)
