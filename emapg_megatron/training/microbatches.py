"""Micro-batches of a training batch: two strategies behind one interface.

:class:`PaddedBatches` cuts the padded ``[S, L]`` batch into fixed-size micro-batches
(``--micro-batch-size``); :class:`~emapg_megatron.training.packing.PackedBatches` packs whole
sequences into token rows under a budget (``--sequence-packing``). Either gives, for one batch, a
plan that ``split``\\ s it into micro-batches, ``merge``\\ s their per-token outputs back to
``[S, L]`` and knows the share of computed token slots that is padding.

Every micro-batch carries its ``layout`` (:func:`layout_of`): what the model is given besides the
tokens (``model_inputs``) and how its per-token values lie per sequence (``per_sequence``). The
passes and the loss ask the layout, never which strategy made it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from emapg_megatron.algo.config import StepConfig
from emapg_megatron.training import packing


class PaddedRows:
    """The layout of a padded micro-batch: one sequence per row, nothing more to tell the model."""

    def model_inputs(self, model, mb: dict) -> dict:
        return {}

    def per_sequence(self, *tensors):
        return tensors


PADDED = PaddedRows()


def layout_of(mb: dict):
    """The micro-batch's layout; one made elsewhere (the sampler, a test) is padded rows."""
    return mb.get("layout", PADDED)


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


def padded_fraction(mask: torch.Tensor) -> float:
    """Share of an unpacked ``[S, L]`` batch's token slots that no loss term needs."""
    return 1.0 - sum(packing.sequence_lengths(mask)) / max(mask.numel(), 1)


@dataclass
class PaddedPlan:
    """Fixed-size micro-batches of one padded batch."""

    micro_batch_size: int
    padding_fraction: float

    def split(self, batch: dict) -> list[dict]:
        return [{**mb, "layout": PADDED} for mb in split_microbatches(batch, self.micro_batch_size)]

    def merge(self, outputs: list[dict], microbatches: list[dict]) -> dict:
        return concat_outputs(outputs)


@dataclass
class PaddedBatches:
    """``--micro-batch-size`` sequences per micro-batch, padded to the batch's width."""

    micro_batch_size: int

    def plan(self, batch: dict) -> PaddedPlan:
        return PaddedPlan(self.micro_batch_size, padded_fraction(batch["mask"]))


def microbatching(step: StepConfig):
    """The strategy ``step`` asks for: packed under its token budget, or padded."""
    if step.sequence_packing:
        return packing.PackedBatches(step.token_budget())
    return PaddedBatches(step.micro_batch_size)
