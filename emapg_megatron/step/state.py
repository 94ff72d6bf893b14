"""What a checkpoint keeps of a run: the model, the optimizer, the LR schedule, the anchor, the
count of skipped steps and the rollout collector's own state (partial rollouts' pool).

``run.loop`` saves and resumes it; the trainer updates it; each component says what it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.checkpoint.lora_base import BaseRecord
from emapg_megatron.lora.config import is_adapter_name
from emapg_megatron.models.gpt import unwrap


@dataclass
class TrainState:
    model_chunks: list
    optimizer: object
    scheduler: object
    anchor: object
    """An :class:`~emapg_megatron.anchor.protocol.Anchor`."""
    collector: object = None
    """A :class:`~emapg_megatron.rollout.collect.Collector`, or None (its state is then not kept)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or gradient, counted across resumes."""
    lora_base: BaseRecord | None = None
    """A LoRA run's frozen base, when its weights come from files (--load-hf,
    --pretrained-checkpoint): its checkpoints then hold the adapters alone, not the base, and
    record this. None: the checkpoints hold every weight."""

    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model, optimizer and anchor, sharded for Megatron's dist_checkpointing."""
        model_sd = unwrap(self.model_chunks[0]).sharded_state_dict()
        if self.lora_base is not None:  # the base is the recorded files': the adapters only
            model_sd = {key: entry for key, entry in model_sd.items() if is_adapter_name(key)}
        optim_sd = checkpointing.optimizer_sharded_state_dict(self.optimizer, model_sd, is_loading=is_loading)
        return {"model": model_sd, "optimizer": optim_sd, "ema": self.anchor.sharded_state_dict(model_sd)}

    def common_state_dict(self) -> dict:
        """The replicated state: LR schedule, the skipped-step count and the collector's state
        (the same on every rank)."""
        collector = self.collector.state_dict() if self.collector is not None else {}
        base = {checkpointing.LORA_BASE_KEY: self.lora_base.to_dict()} if self.lora_base is not None else {}
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps, **collector, **base}

    def prepare_to_load(self, path: str) -> None:
        """Check the checkpoint's model (LoRA or not, its base) and anchor state (one clear line
        each) and create the optimizer state."""
        lora = any(is_adapter_name(name) for chunk in self.model_chunks for name, _ in chunk.named_parameters())
        checkpointing.check_same_model(path, lora)
        if lora:
            checkpointing.check_lora_base(path, self.lora_base)
        self.anchor.check_checkpoint(path)
        checkpointing.materialize_optimizer_state(self.model_chunks, self.optimizer)

    def load_state_dict(self, loaded: dict) -> None:
        """Take what ``checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        # an adapters-only checkpoint (lora_base) leaves the base loaded from its files as it is
        unwrap(self.model_chunks[0]).load_state_dict(loaded["model"], strict=self.lora_base is None)
        with torch.no_grad():  # fp32 DistOpt main params are views of the (grad-requiring) weights
            self.optimizer.load_state_dict(loaded["optimizer"])
        checkpointing.restore_adam_steps(self.optimizer, loaded["optimizer"])
        self.anchor.load_state_dict(loaded["ema"])
        self.scheduler.load_state_dict(loaded["common"]["scheduler"])
        self.skipped_steps = loaded["common"]["skipped_steps"]
        if self.collector is not None:
            self.collector.load_state_dict(loaded["common"])

    def resume_note(self) -> str:
        """What a resume brought back besides weights and optimizer (for its log line)."""
        return self.collector.resume_note() if self.collector is not None else ""
