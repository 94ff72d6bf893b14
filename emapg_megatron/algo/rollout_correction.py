"""Rollout–trainer mismatch correction on the policy-gradient term (no Megatron here).

The rollout engine (vLLM, or the built-in sampler in another precision or kernel) samples from
``pi_sampling``, while PPO's ratio is taken against the trainer's recomputed ``pi_old``. The
per-token importance ratio ``rho = pi_old(y) / pi_sampling(y)`` is the off-policy weight that
the policy-gradient estimate is missing. Two corrections multiply the per-token PPO loss by a
detached weight ``w(rho)``:

* ``tis``, truncated importance sampling: ``w = min(rho, C)``. Every token keeps its gradient;
  tokens the engine under-sampled count more, up to ``C``. Lowest variance at a small bias.
* ``mis``, masked importance sampling (IcePop): ``w = rho`` inside ``[C_low, C]`` and ``0``
  outside. Tokens on which the two engines disagree strongly are dropped altogether, because
  their ratio says more about the engine's numerics than about the policy.

``none`` keeps ``w = 1`` (the engine's samples are taken as on-policy). ``rho`` is computed in
float64 from the log-probs so that ``exp`` of a large gap neither overflows nor loses the 1.
"""

from __future__ import annotations

import torch

from emapg_megatron.algo.config import ROLLOUT_IS_MODES


def lower_bound(threshold: float, threshold_lower: float | None) -> float:
    """MIS's lower bound: the given one, else the reciprocal of the upper (symmetric in log rho)."""
    return 1.0 / threshold if threshold_lower is None else threshold_lower


def rollout_is_weights(old_logprob: torch.Tensor, sampling_logprob: torch.Tensor, mode: str,
                       threshold: float, threshold_lower: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights ``w(rho)`` (detached, the log-probs' dtype) and where they corrected.

    The second tensor is 1 where ``tis`` truncated ``rho`` to ``threshold`` or ``mis`` masked the
    token, else 0 (the caller averages it over response tokens).
    """
    rho = (old_logprob.detach().double() - sampling_logprob.detach().double()).exp()
    if mode == "none":
        return torch.ones_like(old_logprob), torch.zeros_like(old_logprob)
    if mode == "tis":
        corrected = rho > threshold
        w = rho.clamp(max=threshold)
    elif mode == "mis":
        corrected = (rho < lower_bound(threshold, threshold_lower)) | (rho > threshold)
        w = torch.where(corrected, torch.zeros_like(rho), rho)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}; choose from {ROLLOUT_IS_MODES}")
    return w.to(old_logprob.dtype), corrected.to(old_logprob.dtype)
