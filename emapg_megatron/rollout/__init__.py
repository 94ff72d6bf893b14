"""Rollout engines: the protocol, the built-in Megatron sampler, and vLLM (GPU)."""

from emapg_megatron.rollout.engine import RolloutBatch, RolloutEngine, build_rollout_batch

__all__ = ["RolloutBatch", "RolloutEngine", "build_rollout_batch"]
