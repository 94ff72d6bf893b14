"""GPTModel's final hidden states and output weight instead of its logits (for :mod:`emapg_megatron.parallel.lmhead_terms`).

The hook, in megatron-core 0.16.1 (``models/gpt/gpt_model.py``): ``GPTModel._postprocess`` ends, on
the last pipeline stage and without MTP, with::

    output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=...)
    if labels is None:
        return logits.transpose(0, 1).contiguous()  # [s b h] => [b s h]

``hidden_states`` are the decoder's output after its final norm (``TransformerBlock.final_layernorm``),
``[S, B, H]`` (``[S/TP, B, H]`` under sequence parallelism: ``output_layer`` all-gathers them itself);
``output_weight`` is the word-embedding weight when tied (``None``: the layer's own ``weight``).
That call is the one seam where the hidden states meet the output weight, and it is the seam
Megatron's own fused linear cross-entropy uses: 0.16.1 has no such path (``cross_entropy_loss_fusion``
fuses only the softmax of materialised logits), later Megatron-LM makes ``output_layer`` a
``LinearCrossEntropyModule`` (a ColumnParallelLinear subclass) that, called with
``output_cross_entropy_loss=True, labels=...``, returns the loss from ``(hidden_states, weight)``
without forming the logits.

:func:`output_layer_bypassed` does the same for any loss. From Megatron-Core 0.19 on,
``GPTModel.forward`` takes an ``output_processor`` that is called at that seam with the hidden states
and the output weight instead of the output layer; the capture is that processor (pass
``OutputCapture.model_kwargs`` to the forward) and the model is not touched. On 0.16, for the duration
of a ``with`` block the output layer's ``forward`` is replaced by one that records the weight and hands
back the hidden states (as a transposed view, so GPTModel's own ``transpose(0, 1).contiguous()``
returns the hidden states themselves: no copy, Megatron's ``[S, B, H]`` layout). Either way nothing
else of the model changes; the weight is the parameter itself, so its gradient reaches DDP's hooks,
and tied weights stay tied.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from emapg_megatron import mcore_compat
from emapg_megatron.models.gpt import unwrap

__all__ = ["OutputCapture", "output_layer_bypassed"]


class OutputCapture:
    """What the bypassed output layer was given on the last forward: ``weight`` (``None`` before the
    first forward and off the last stage). ``model_kwargs``: what the model's forward must be given
    (Megatron-Core's ``output_processor`` where it takes one)."""

    weight: Optional[torch.Tensor] = None

    def __init__(self):
        self.model_kwargs: dict = {}

    def process(self, hidden_states, output_layer, output_weight=None, **unused):
        """GPTModel's ``output_processor``: the hidden states, as the output layer would get them."""
        self.weight = output_layer.weight if output_weight is None else output_weight
        return hidden_states


@contextlib.contextmanager
def output_layer_bypassed(model) -> Iterator[OutputCapture]:
    """Within the block, ``model(...)`` returns the final hidden states ``[S, B, H]`` (``[S/TP, B, H]``
    under sequence parallelism) instead of logits when given the yielded :class:`OutputCapture`'s
    ``model_kwargs``; the capture holds the weight.

    ``model``: a GPTModel, possibly inside DDP / Float16Module (call it with ``fp32_output=False``,
    else Float16Module upcasts the hidden states). A no-op off the last pipeline stage.
    """
    gpt = unwrap(model)
    cap = OutputCapture()
    if not gpt.post_process:
        yield cap
        return
    if getattr(gpt.config, "mtp_num_layers", None):
        raise NotImplementedError("output_layer_bypassed: multi-token prediction calls the output layer "
                                  "for its own logits; not supported")
    if mcore_compat.HAS_OUTPUT_PROCESSOR:
        cap.model_kwargs = {"output_processor": cap.process}
        yield cap
        return
    layer = gpt.output_layer
    previous = layer.__dict__.get("forward")  # an instance override (another hook) to restore

    def capture(input_, weight=None, runtime_gather_output=None, **unused):
        cap.weight = layer.weight if weight is None else weight
        return input_.transpose(0, 1), None  # GPTModel transposes back: the hidden states themselves

    layer.forward = capture
    try:
        yield cap
    finally:
        if previous is None:
            del layer.forward
        else:
            layer.forward = previous
