"""Rollout engines: the protocol, the built-in Megatron sampler, and vLLM (GPU)."""

import importlib.util

import torch

from emapg_megatron.rollout.engine import (
    RolloutBatch,
    RolloutEngine,
    build_rollout_batch,
)

__all__ = ["RolloutBatch", "RolloutEngine", "build_rollout_batch", "load_generation_backend"]


def load_generation_backend(ckpt: str, **generation_kwargs):
    """A text generation backend for ``evaluate --load`` on a Hugging Face directory: vLLM when
    it and a GPU are present, else the built-in Megatron sampler (CPU included)."""
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        from emapg_megatron.rollout.vllm_engine import load_generation_backend as load
    else:
        from emapg_megatron.rollout.megatron_backend import (
            load_megatron_backend as load,
        )
    return load(ckpt, **generation_kwargs)
