"""Sequence-level KL (§5.1, eq. 10-12; InstructGPT / WARP): the baseline to token-level Top-k KL.

The sequence log-ratio ``log pi_theta(y|x) / pi_ref(y|x) = sum_n rho_n`` with
``rho_n = log pi_theta(y_n|h_n) - log pi_ref(y_n|h_n)`` is an unbiased estimate of the sequence KL
KL(pi_theta(.|x) || pi_ref(.|x)) under y ~ pi_theta. Used as a reward penalty,
``R'(x, y) = R(x, y) - beta * sg(sum_n rho_n)``, the score-function gradient of R' is the policy
gradient of R minus ``beta * grad KL`` (eq. 11-12), and every token n is charged the whole
sequence's divergence, past tokens included (only the future ones matter in expectation, eq. 15).

Sign convention: the paper's eq. (10) names ``-log(pi/pi_ref)`` the sequence "KL" (the quantity
*added* to the reward); here :func:`sequence_kl` returns ``+sum_n rho_n`` (the KL estimate itself)
and :func:`sequence_kl_penalized_reward` *subtracts* it. The two are the same penalty.
"""

from __future__ import annotations

import torch

from ._common import compute_dtype, upcast

__all__ = ["sequence_kl", "sequence_kl_penalized_reward", "sequence_kl_loss"]


def _masked_log_ratio(logprob, ref_logprob, mask):
    dt = compute_dtype(logprob, ref_logprob)
    lp = upcast(logprob, dt)
    lr = upcast(ref_logprob, dt).detach()
    m = mask.to(torch.bool) if mask.dtype != torch.bool else mask
    zero = torch.zeros((), dtype=dt, device=lp.device)
    # where (not multiply): padded positions may hold -inf / garbage log-probs.
    return torch.where(m, lp, zero), torch.where(m, lp - lr, zero)


def sequence_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_n mask_n (log pi_theta(y_n) - log pi_ref(y_n))`` over the last dim.

    ``logprob``, ``ref_logprob``, ``mask``: ``[..., L]`` (mask bool or 0/1). Returns ``[...]`` in the
    compute dtype; differentiable in ``logprob`` (detach it to use it as a reward penalty, or use
    :func:`sequence_kl_penalized_reward`).
    """
    _, rho = _masked_log_ratio(logprob, ref_logprob, mask)
    return rho.sum(dim=-1)


def sequence_kl_penalized_reward(
    reward: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """The WARP / InstructGPT shaped reward ``R - beta * sg(sequence_kl)``, shape of ``reward``."""
    kl = sequence_kl(logprob, ref_logprob, mask).detach()
    return reward.to(kl.dtype) - beta * kl


def sequence_kl_loss(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence surrogate whose value is the sequence log-ratio and whose gradient is eq. (11):
    ``sg(sum_n rho_n) * grad sum_n log pi_theta(y_n|h_n)`` (K4 applied to the whole sequence).

    Under y ~ pi_theta, ``E[grad sequence_kl_loss] = grad KL(pi_theta(.|x) || pi_ref(.|x))`` (eq. 12).
    """
    lp, rho = _masked_log_ratio(logprob, ref_logprob, mask)
    seq_lp = lp.sum(dim=-1)
    r = torch.exp(seq_lp - seq_lp.detach())
    return r * rho.sum(dim=-1).detach()
