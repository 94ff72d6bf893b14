"""The EMA anchor of EMA-PG: θ_ema ← η·θ_ema + (1−η)·θ every T_ema steps (paper §3-4, Algorithm 3).

* :class:`EmaConfig` (``config.py``), :class:`EmaAnchor` (``ema.py``): fp32 EMA sharded like the policy
  (optionally over DP and/or in host memory), updated in place from the optimizer's fp32 main params.
* ``anchor.swapped_in()`` (``swap.py``): reference forward passes on the live model.
* ``anchor.sharded_state_dict()`` / ``load_state_dict()`` (``checkpoint.py``): reshardable checkpoints.
* :class:`StabilityMonitor` (``stability.py``): the α·β·λ_max < 1 + η check of Lemma 4.2.

See docs/anchor.md.
"""

import importlib

from emapg_megatron.anchor.config import EmaConfig

# The rest imports Megatron: loaded on first use, so the config layer stays light.
_LAZY = {"EmaAnchor": "ema", "StabilityEstimate": "stability", "StabilityMonitor": "stability",
         "sequence_grad_sq_norms": "stability"}

__all__ = ["EmaAnchor", "EmaConfig", "StabilityEstimate", "StabilityMonitor", "sequence_grad_sq_norms"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
