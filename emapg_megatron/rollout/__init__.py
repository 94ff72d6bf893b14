"""Rollouts: collection (fresh or partial, ``collect.py``), the engine protocol (``engine.py``),
the built-in Megatron sampler and its decode paths, and vLLM (GPU). The configs (``config.py``)
import no torch; the rest is loaded on first use of one of its names."""

import importlib
import importlib.util

_LAZY = {"RolloutBatch": "engine", "RolloutEngine": "engine", "build_rollout_batch": "engine"}

__all__ = ["RolloutBatch", "RolloutEngine", "build_rollout_batch", "load_generation_backend"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_generation_backend(ckpt: str, **generation_kwargs):
    """A text generation backend for ``evaluate --load`` on a Hugging Face directory: vLLM when
    it and a GPU are present, else the built-in Megatron sampler (CPU included)."""
    import torch

    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        from emapg_megatron.rollout.vllm_engine import load_generation_backend as load
    else:
        from emapg_megatron.rollout.megatron_backend import (
            load_megatron_backend as load,
        )
    return load(ckpt, **generation_kwargs)
