"""Rollout engines: the protocol, the built-in Megatron sampler, and vLLM (GPU)."""

from emapg_megatron.rollout.engine import RolloutBatch, RolloutEngine, build_rollout_batch

__all__ = ["RolloutBatch", "RolloutEngine", "build_rollout_batch", "load_generation_backend"]


def load_generation_backend(ckpt: str, **generation_kwargs):
    """A text generation backend for ``evaluate --load`` (vLLM on an HF directory; needs a GPU)."""
    from emapg_megatron.rollout.vllm_engine import load_generation_backend as load

    return load(ckpt, **generation_kwargs)
