"""The KL anchor's interface: what the trainer, the checkpoint code and the loop ask of it.

Three implementations: :class:`~emapg_megatron.anchor.ema.EmaAnchor` (the fp32 EMA of the
policy's trainable parameters, swapped into the live model for the anchor pass),
:class:`~emapg_megatron.anchor.teacher.Teacher` (a frozen model of its own: distillation) and
:class:`~emapg_megatron.anchor.frozen_base.FrozenBaseAnchor` (the policy with its trainable part
switched off: LoRA at --ema-eta 1). A new anchor (an EMA over experts or adapters) plugs
in by implementing this, without touching the trainer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterator, Protocol

import torch


class Anchor(Protocol):
    def model(self) -> AbstractContextManager[list]:
        """The model chunks the anchor pass runs on, for the ``with`` block's duration."""

    def step(self, iteration: int) -> bool:
        """After trainer step ``iteration``'s optimizer step: update; returns whether it did."""

    def metrics(self) -> dict:
        """Per-step metrics for the log (``ema_lag``, ``teacher_pass_s``)."""

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The state it owns, named for messages: what a save checks is finite first."""

    def sharded_state_dict(self, model_sharded_state_dict: dict | None = None) -> dict:
        """Its part of a checkpoint, sharded like the model (empty: nothing to save)."""

    def check_checkpoint(self, ckpt_dir: str) -> None:
        """Before a load: raise ConfigError (one line) if ``ckpt_dir``'s state cannot be loaded."""

    def load_state_dict(self, loaded: dict) -> None:
        """Take what a load of :meth:`sharded_state_dict` returned."""


class FixedAnchor:
    """The stateless half of :class:`Anchor` for a fixed reference (a frozen teacher, the frozen
    base): no update, nothing owned, nothing to save or load. Subclasses give ``model`` and
    ``metrics``."""

    def step(self, iteration: int) -> bool:
        return False

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def sharded_state_dict(self, model_sharded_state_dict: dict | None = None) -> dict:
        return {}

    def check_checkpoint(self, ckpt_dir: str) -> None:
        pass

    def load_state_dict(self, loaded: dict) -> None:
        pass
