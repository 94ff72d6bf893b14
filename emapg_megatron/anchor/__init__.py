"""The EMA anchor of EMA-PG: θ_ema ← η·θ_ema + (1−η)·θ every T_ema steps (paper §3-4, Algorithm 3).

* :class:`EmaConfig`, :class:`EmaAnchor` (``ema.py``): fp32 EMA sharded like the policy
  (optionally over DP and/or in host memory), updated in place from the optimizer's fp32 main params.
* ``anchor.swapped_in()`` (``swap.py``): reference forward passes on the live model.
* ``anchor.sharded_state_dict()`` / ``load_state_dict()`` (``checkpoint.py``): reshardable checkpoints.
* :class:`StabilityMonitor` (``stability.py``): the α·β·λ_max < 1 + η check of Lemma 4.2.

See docs/anchor.md.
"""

from emapg_megatron.anchor.ema import EmaAnchor, EmaConfig
from emapg_megatron.anchor.stability import (
    StabilityEstimate,
    StabilityMonitor,
    sequence_grad_sq_norms,
)

__all__ = ["EmaAnchor", "EmaConfig", "StabilityEstimate", "StabilityMonitor", "sequence_grad_sq_norms"]
