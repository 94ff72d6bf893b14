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

All functions take ``[...]`` per-token log-probabilities and return ``[...]`` per-token estimates,
computed in fp32 (fp64 if any input is fp64). Nothing here needs the vocabulary, so a vocab-parallel
implementation calls them directly on its gathered ``log pi(y)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import (
    NO_CLAMP,
    IWClip,
    LogWRange,
    _check_name,
    clamp_log_w,
    compute_dtype,
    importance_weight,
    sg,
    upcast,
)

__all__ = [
    "SAMPLED_ESTIMATORS",
    "SAMPLED_ESTIMATOR_DIRECTION",
    "sampled_kl",
    "sampled_kl_unweighted",
]

#: Valid ``estimator`` names, in Table 1 order.
SAMPLED_ESTIMATORS = ("k1", "k2", "k3", "k3++", "k4", "k5")

#: The KL direction whose *value* each estimator targets in expectation (``k2`` targets none exactly;
#: its gradient is the reverse-KL gradient, so it is listed as reverse).
SAMPLED_ESTIMATOR_DIRECTION = {
    "k1": "reverse",
    "k2": "reverse",
    "k3": "reverse",
    "k3++": "reverse",
    "k4": "reverse",
    "k5": "forward",
}


def sampled_kl_unweighted(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str, log_w_clamp: LogWRange = NO_CLAMP
) -> torch.Tensor:
    """The Table 1 expression for one sampled token, without the off-policy weight.

    ``logprob`` and ``ref_logprob`` must already share the compute dtype. ``log_w_clamp`` clamps
    log w first (``torch.clamp``: no gradient through w beyond it), as the reference code does
    in its K5 with (-20, 20); the default is no clamp.
    """
    lp = logprob
    log_w = clamp_log_w(ref_logprob - lp, log_w_clamp)
    if estimator == "k1":
        return -log_w
    if estimator == "k2":
        return 0.5 * log_w * log_w
    if estimator == "k3":
        return -log_w + torch.expm1(log_w)
    r = torch.exp(lp - sg(lp))  # value exactly 1, gradient grad log pi(y)
    if estimator == "k3++":
        return r * (-log_w + torch.expm1(log_w))
    if estimator == "k4":
        return r * sg(-log_w)
    if estimator == "k5":
        # log r = lp - sg(lp): value 0, gradient grad log pi(y); it is the baseline of §F.4.
        return sg(torch.exp(log_w)) * log_w + (lp - sg(lp))
    raise ValueError(f"unknown estimator {estimator!r}; expected one of {SAMPLED_ESTIMATORS}")


def sampled_kl(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str,
    *,
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
) -> torch.Tensor:
    """Per-token sampled KL estimate ``s * K(y)``.

    Args:
        logprob: ``[...]`` log pi_theta(y) of the sampled token; differentiable.
        ref_logprob: ``[...]`` log pi_ref(y) (treated as a constant).
        estimator: one of :data:`SAMPLED_ESTIMATORS` (``k1``, ``k2``, ``k3``, ``k3++``, ``k4``, ``k5``).
        sampling_logprob: ``[...]`` log pi_sampling(y); ``None`` means on-policy (s = 1).
        iw_clip: ``(s_min, s_max)`` clip of the importance weight; ``None`` = unclipped.

    Returns:
        ``[...]`` estimate in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    _check_name(estimator, SAMPLED_ESTIMATORS, "sampled KL estimator")
    dt = compute_dtype(logprob, ref_logprob, sampling_logprob)
    lp = upcast(logprob, dt)
    lr = upcast(ref_logprob, dt).detach()
    est = sampled_kl_unweighted(lp, lr, estimator)
    if sampling_logprob is None and iw_clip is None:
        return est
    s = importance_weight(lp, upcast(sampling_logprob, dt), iw_clip)
    return s * est
