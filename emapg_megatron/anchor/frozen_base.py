"""A fixed anchor with no copy: the policy's own chunks with their trainable part switched off.

When only part of the model trains (LoRA: adapters on a frozen base, docs/lora.md), that frozen
base is the same in the policy and in any anchor, and at ``--ema-eta 1`` (the fixed reference of
GRPO) the anchor is the starting policy. If the trainable part starts as a no-op (LoRA's B = 0),
the starting policy *is* the frozen base: the anchor pass runs with that part switched off, and
nothing is copied or averaged. The caller says how to switch it off (a context manager over the
chunks, e.g. ``lora.apply.adapters_off``), so this module knows nothing of what it is. An
:class:`~emapg_megatron.anchor.protocol.Anchor`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager

import torch

from emapg_megatron.anchor.protocol import FixedAnchor
from emapg_megatron.anchor.swap import _RngState


class FrozenBaseAnchor(FixedAnchor):
    """The anchor pass on ``model_chunks`` inside ``switched_off(model_chunks)`` (no state, no
    update)."""

    def __init__(self, model_chunks: list, switched_off: Callable[[list], AbstractContextManager]):
        self.model_chunks = list(model_chunks)
        self.switched_off = switched_off

    @contextmanager
    def model(self):
        """The chunks computing the frozen base, for the anchor pass. The RNG states are restored
        afterwards, as the EMA swap does, so the anchor pass leaves the run's randomness as it
        was."""
        rng = _RngState()
        try:
            with self.switched_off(self.model_chunks), torch.no_grad():
                yield self.model_chunks
        finally:
            rng.restore()

    def metrics(self) -> dict:
        return {}
