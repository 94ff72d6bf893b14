"""The fixed anchor of a LoRA run at --ema-eta 1: the base model, with no copy of anything.

With LoRA the base weights are frozen, so they are the same in the policy and in any anchor: the
EMA anchor (``anchor.ema.EmaAnchor``, built on the DDP buffers, which hold only the trainable
adapters) averages and swaps in the adapters alone. At eta = 1 the EMA never moves from the
initial policy, which is the base model exactly (B = 0 at the start): this anchor runs the anchor
pass with every adapter switched off instead of keeping an fp32 copy of the initial adapters.
It has the :class:`~emapg_megatron.anchor.protocol.Anchor` interface (docs/lora.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from emapg_megatron.anchor.swap import _RngState
from emapg_megatron.lora.apply import adapters_off


class BaseModelAnchor:
    """The anchor pass on the policy's own chunks with their adapters off (no state, no update)."""

    def __init__(self, model_chunks: list):
        self.model_chunks = list(model_chunks)

    @contextmanager
    def model(self):
        """The policy's chunks computing the base model, for the anchor pass. The RNG states are
        restored afterwards, as the EMA swap does, so the anchor pass leaves the run's
        randomness untouched."""
        rng = _RngState()
        try:
            with adapters_off(self.model_chunks), torch.no_grad():
                yield self.model_chunks
        finally:
            rng.restore()

    def step(self, iteration: int) -> bool:
        return False  # eta = 1: the fixed reference

    def metrics(self) -> dict:
        return {}

    def named_tensors(self):
        return iter(())

    def sharded_state_dict(self, model_sharded_state_dict: dict | None = None) -> dict:
        return {}

    def check_checkpoint(self, ckpt_dir: str) -> None:
        pass

    def load_state_dict(self, loaded: dict) -> None:
        pass
