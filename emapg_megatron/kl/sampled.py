"""Sampled (O(1) memory) per-token KL estimators: Table 1 and §5.2 of the paper.

Notation: y is the sampled token, ``lp = log pi_theta(y)`` (differentiable), ``lr = log pi_ref(y)``,
``log w = lr - lp``, ``r = pi_theta(y) / sg(pi_theta(y))`` (value 1, gradient grad log pi_theta(y)).

=========  ===============================  ================  ==========================  =========
name       expression                       E[value]          E[grad]                     unbiased
=========  ===============================  ================  ==========================  =========
``k1``     -log w                           KL(pi||ref)       0                           value
``k2``     (log w)^2 / 2                    E[(log w)^2]/2    grad KL(pi||ref)            gradient
``k3``     -log w + w - 1                   KL(pi||ref)       grad KL(ref||pi) (forward)  value
``k3++``   r (-log w + w - 1)               KL(pi||ref)       grad KL(pi||ref)            both
``k4``     r sg(-log w)                     KL(pi||ref)       grad KL(pi||ref)            both
``k5``     sg(w) log w + log r              KL(ref||pi)       grad KL(ref||pi)            both
=========  ===============================  ================  ==========================  =========

Expectations are over y ~ pi_theta. When y ~ pi_sampling instead, pass ``sampling_logprob`` and the
estimate is multiplied by the stop-gradient importance weight ``s = sg(pi_theta(y)/pi_sampling(y))``,
optionally clipped to ``iw_clip = (s_min, s_max)``; unclipped, every row of the table holds
unchanged under y ~ pi_sampling.

``reference_clamps=True`` applies the reference code's clamps (``kl_penalty``), which bias the
estimate wherever they bind: log w to [-20, 20] in ``k3``, ``k3++`` and ``k5``, the K3 value to
[-10, 10] in ``k3`` and ``k3++`` (before the ratio r), and log s to [-20, 20] in the weight.

All functions take ``[...]`` per-token log-probabilities and return ``[...]`` per-token estimates,
computed in fp32 (fp64 if any input is fp64). Nothing here needs the vocabulary, so a vocab-parallel
implementation calls them directly on its gathered ``log pi(y)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import (
    NO_CLAMP,
    REFERENCE_LOG_CLAMP,
    IWClip,
    LogWRange,
    _check_name,
    clamp_log_w,
    compute_dtype,
    importance_weight,
    sg,
    upcast,
)
from .catalog import SAMPLED_ESTIMATOR_DIRECTION, SAMPLED_ESTIMATORS

__all__ = [
    "REFERENCE_CLAMPS",
    "SAMPLED_ESTIMATORS",
    "SAMPLED_ESTIMATOR_DIRECTION",
    "sampled_kl",
    "sampled_kl_unweighted",
]


#: The reference code's clamps of its sampled estimators, ``(log w, value)``: K1, K2, K4 have none.
REFERENCE_CLAMPS = {
    "k3": (REFERENCE_LOG_CLAMP, (-10.0, 10.0)),
    "k3++": (REFERENCE_LOG_CLAMP, (-10.0, 10.0)),
    "k5": (REFERENCE_LOG_CLAMP, NO_CLAMP),
}

def sampled_kl_unweighted(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str,
    log_w_clamp: LogWRange = NO_CLAMP,
    k3_clamp: LogWRange = NO_CLAMP,
) -> torch.Tensor:
    """The Table 1 expression for one sampled token, without the off-policy weight.

    ``logprob`` and ``ref_logprob`` must already share the compute dtype. ``log_w_clamp`` clamps
    log w first (``torch.clamp``: no gradient through w beyond it), ``k3_clamp`` the value of K3
    (in ``k3++`` before the ratio r), as the reference code does (:data:`REFERENCE_CLAMPS`); the
    default is no clamp.
    """
    lp = logprob
    log_w = clamp_log_w(ref_logprob - lp, log_w_clamp)
    if estimator == "k1":
        return -log_w
    if estimator == "k2":
        return 0.5 * log_w * log_w
    if estimator == "k3":
        return clamp_log_w(-log_w + torch.expm1(log_w), k3_clamp)
    r = torch.exp(lp - sg(lp))  # value exactly 1, gradient grad log pi(y)
    if estimator == "k3++":
        return r * clamp_log_w(-log_w + torch.expm1(log_w), k3_clamp)
    if estimator == "k4":
        return r * sg(-log_w)
    if estimator == "k5":
        # log r = lp - sg(lp): value 0, gradient grad log pi(y); it is the baseline of §F.4. Where the
        # reference gives y no mass (w = 0, a -inf logit: a teacher's) w log w is 0, not 0 * -inf.
        w_log_w = torch.where(torch.isneginf(log_w), torch.zeros_like(log_w), sg(torch.exp(log_w)) * log_w)
        return w_log_w + (lp - sg(lp))
    raise ValueError(f"unknown estimator {estimator!r}; expected one of {SAMPLED_ESTIMATORS}")


def sampled_kl(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str,
    *,
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
    reference_clamps: bool = False,
) -> torch.Tensor:
    """Per-token sampled KL estimate ``s * K(y)``.

    Args:
        logprob: ``[...]`` log pi_theta(y) of the sampled token; differentiable.
        ref_logprob: ``[...]`` log pi_ref(y) (treated as a constant).
        estimator: one of :data:`SAMPLED_ESTIMATORS` (``k1``, ``k2``, ``k3``, ``k3++``, ``k4``, ``k5``).
        sampling_logprob: ``[...]`` log pi_sampling(y); ``None`` means on-policy (s = 1).
        iw_clip: ``(s_min, s_max)`` clip of the importance weight; ``None`` = unclipped.
        reference_clamps: the reference code's clamps (module docstring); ``False``: none.

    Returns:
        ``[...]`` estimate in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    _check_name(estimator, SAMPLED_ESTIMATORS, "sampled KL estimator")
    dt = compute_dtype(logprob, ref_logprob, sampling_logprob)
    lp = upcast(logprob, dt)
    lr = upcast(ref_logprob, dt).detach()
    clamps = REFERENCE_CLAMPS.get(estimator, ()) if reference_clamps else ()
    est = sampled_kl_unweighted(lp, lr, estimator, *clamps)
    if sampling_logprob is None and iw_clip is None:
        return est
    s = importance_weight(lp, upcast(sampling_logprob, dt), iw_clip, reference_clamps)
    return s * est
