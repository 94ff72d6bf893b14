"""Sampled and Top-k f-divergence estimators (Appendix H, Table 5) and their exact references.

``D_f(pi || ref) = sum_j ref(j) f(pi(j)/ref(j))`` for the generators in
:data:`~emapg_megatron.kl.divergences.F_DIVERGENCES`:

=====================  =============================================  ===============================
name                   f(t)                                           sampled Kf++ = r g_f(w)
=====================  =============================================  ===============================
``pearson_chi2``       (t - 1)^2                                      r (1 - w)^2 / w
``neyman_chi2``        (t - 1)^2 / t                                  r (1 - w)^2
``squared_hellinger``  (sqrt t - 1)^2 / 2                             r (1 - sqrt w)^2 / 2
``jensen_shannon``     (t log t - (t + 1) log((t + 1)/2)) / 2         r [-log w - (1+w) log((1+w)/(2w))] / 2
``total_variation``    |t - 1| / 2                                    r |1 - w| / 2
``alpha``              (t^a - 1 - a (t - 1)) / (a (a - 1)), a != 0,1  r (w^(1-a) + (a-1) w - a) / (a (a-1))
=====================  =============================================  ===============================

(``reverse_kl`` and ``forward_kl`` are also accepted: f = t log t and f = -log t.)

Kf++ (eq. 115) ``r g_f(w)``, ``w = ref(y)/pi(y)``, has unbiased value *and* gradient under
y ~ pi_theta, and it carries no baseline, so its masked tail ``1(y not in q) Kf++`` is unbiased in
gradient as well (eq. 125). Hence :func:`topk_fdiv` = exact truncated f-divergence on q + masked
Kf++ tail is unbiased in value and gradient for any fixed q and any 0 <= k <= V, exactly as printed
in Appendix H.3; ``tail="paper"`` is therefore the same estimator as ``"unbiased"`` and accepted for
symmetry with :func:`~emapg_megatron.kl.topk.topk_kl`. ``tail="none"`` (or ``"truncate"``) gives
the truncated term, ``tail="renorm"`` the f-divergence ``sum_{j in q} r^(j) f(p^(j)/r^(j))`` of the
two distributions renormalised over q (``p^ = pi/m``, ``r^ = ref/m_ref``): a divergence between
distributions on q for every f, exact at k = V, biased otherwise, the KL rows' ``renorm`` of
:mod:`~emapg_megatron.kl.topk`.
(Note the KL rows differ from K4/K5: ``divergence="reverse_kl"`` uses ``r (-log w)``, not
``r sg(-log w)``; it is unbiased but has higher variance than the corrected K4 tail.)

Extreme ratios: the Top-k tail is exact while its value fits the compute dtype with e^24 to
spare and clamps log w beyond (:func:`~emapg_megatron.kl.divergences.log_w_range`), so values and
gradients stay finite; :func:`sampled_fdiv` is never clamped. See ``docs/kl_estimators.md``.

Factoring: :func:`topk_fdiv_from_gathered` needs only ``[..., k]`` / ``[...]`` gathered log-probs,
like :func:`~emapg_megatron.kl.topk.topk_kl_from_gathered`.

Note on Table 5 of the paper: its f(t) for Neyman chi^2 is printed as ``(t - 1)^2`` (a typo; it is
``(t - 1)^2 / t``, which is what its sampled column ``r (1 - w)^2`` corresponds to and what
Tables 9/10 list). Squared Hellinger follows Table 5's 1/2 normalisation (Tables 9/10 omit it).
"""

from __future__ import annotations

import math
from functools import partial
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
    upcast,
)
from .divergences import (
    ALL_DIVERGENCES,
    F_DIVERGENCES,
    check_divergence,
    divergence_terms,
    f_of_log_t,
    g_at_zero,
    g_of_log_w,
    log_w_range,
)
from .topk import TOPK_TAILS, gather_topk_inputs, has_sampled_term, on_q_term

__all__ = [
    "F_DIVERGENCES",
    "ALL_DIVERGENCES",
    "fdiv_exact",
    "sampled_fdiv",
    "sampled_fdiv_unweighted",
    "topk_fdiv",
    "topk_fdiv_from_gathered",
]


def sampled_fdiv_unweighted(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    divergence: str,
    alpha: Optional[float] = None,
    log_w_clamp: LogWRange = NO_CLAMP,
) -> torch.Tensor:
    """Kf++ for one sampled token, without the importance weight (same-dtype inputs).

    Evaluated as ``r g_f(w)`` where w <= 1 and as the identical ``sg(w) f(1/w)`` (eq. 116) where
    w > 1, so the ratio inside f or g never exceeds 1 and the gradient, ``f'(1/w) grad log pi(y)``
    either way, has no cancelling terms. ``log_w_clamp`` clamps log w first (``torch.clamp``: no
    gradient through w beyond it); the default is no clamp.
    """
    lp = logprob
    lr = ref_logprob
    ref_zero = lr == -math.inf
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lw = clamp_log_w(torch.where(ref_zero, zero, lr - lp), log_w_clamp)
    small = lw <= 0
    lw_small = torch.where(small, lw, zero)
    lw_big = torch.where(small, zero, lw)
    r = torch.exp(lp - lp.detach())
    # ref(y) = 0 (then lw = 0): the exact limit g_f(0), which may be +inf (reverse KL, Pearson).
    g0 = torch.full_like(lw, g_at_zero(divergence, alpha))
    via_g = r * torch.where(ref_zero, g0, g_of_log_w(divergence, lw_small, alpha))
    via_f = torch.exp(lw_big.detach()) * f_of_log_t(divergence, -lw_big, alpha)
    return torch.where(small, via_g, via_f)


def sampled_fdiv(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    divergence: str,
    *,
    alpha: Optional[float] = None,
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
) -> torch.Tensor:
    """Per-token sampled f-divergence estimate ``s * Kf++(y)`` (eq. 115-116).

    Arguments as :func:`~emapg_megatron.kl.sampled.sampled_kl`; ``divergence`` in
    :data:`ALL_DIVERGENCES`, ``alpha`` only for ``"alpha"``.
    """
    check_divergence(divergence, alpha)
    dt = compute_dtype(logprob, ref_logprob, sampling_logprob)
    lp = upcast(logprob, dt)
    lr = upcast(ref_logprob, dt).detach()
    est = sampled_fdiv_unweighted(lp, lr, divergence, alpha)
    if sampling_logprob is None and iw_clip is None:
        return est
    return importance_weight(lp, upcast(sampling_logprob, dt), iw_clip) * est


def topk_fdiv_from_gathered(
    logprob_topk: torch.Tensor,
    logprob_token: torch.Tensor,
    ref_logprob_topk: torch.Tensor,
    ref_logprob_token: torch.Tensor,
    token_in_q: torch.Tensor,
    *,
    divergence: str,
    alpha: Optional[float] = None,
    tail: str = "unbiased",
    iw: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Top-k f-divergence from gathered per-token quantities (eq. 120-122); see
    :func:`~emapg_megatron.kl.topk.topk_kl_from_gathered` for the argument conventions."""
    check_divergence(divergence, alpha)
    _check_name(tail, TOPK_TAILS, "Top-k tail")
    terms = partial(divergence_terms, name=divergence, alpha=alpha)
    on_q = on_q_term(terms, logprob_topk, ref_logprob_topk.detach(), tail)
    if not has_sampled_term(tail):
        return on_q
    in_tail = ~token_in_q
    zero = torch.zeros((), dtype=logprob_token.dtype, device=logprob_token.device)
    lp_y = torch.where(in_tail, logprob_token, zero)
    lr_y = torch.where(in_tail, ref_logprob_token.detach(), zero)
    # Exact while the value fits the dtype; saturates beyond (see log_w_range).
    bounds = log_w_range(divergence, alpha, logprob_token.dtype)
    tail_est = sampled_fdiv_unweighted(lp_y, lr_y, divergence, alpha, bounds)
    if iw is not None:
        tail_est = iw * tail_est
    return on_q + torch.where(in_tail, tail_est, zero)


def topk_fdiv(
    logits: torch.Tensor,
    token: torch.Tensor,
    topk_index: torch.Tensor,
    ref_logprob_topk: torch.Tensor,
    ref_logprob_token: torch.Tensor,
    *,
    divergence: str,
    alpha: Optional[float] = None,
    tail: str = "unbiased",
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
) -> torch.Tensor:
    """Per-token Top-k f-divergence estimate: exact ``sum_{j in q} ref(j) f(pi(j)/ref(j))`` plus
    ``s 1(y not in q) Kf++(y)``. Arguments as :func:`~emapg_megatron.kl.topk.topk_kl` (``direction``
    is replaced by ``divergence`` / ``alpha``). Unbiased in value and gradient for any fixed q."""
    check_divergence(divergence, alpha)
    _check_name(tail, TOPK_TAILS, "Top-k tail")
    gathered = gather_topk_inputs(logits, token, topk_index, ref_logprob_topk, ref_logprob_token,
                                  tail=tail, sampling_logprob=sampling_logprob, iw_clip=iw_clip)
    *quantities, iw = gathered
    return topk_fdiv_from_gathered(*quantities, divergence=divergence, alpha=alpha, tail=tail, iw=iw)


def fdiv_exact(
    logits: torch.Tensor,
    ref_logprobs_full: torch.Tensor,
    *,
    divergence: str,
    alpha: Optional[float] = None,
) -> torch.Tensor:
    """Exact per-token ``D_f(pi || ref) = sum_j ref(j) f(pi(j)/ref(j))`` over the full vocabulary.

    ``logits`` ``[..., V]`` (differentiable), ``ref_logprobs_full`` ``[..., V]`` normalised anchor
    log-probs. Indices where both have zero mass contribute 0.
    """
    check_divergence(divergence, alpha)
    dt = compute_dtype(logits, ref_logprobs_full)
    logp = torch.log_softmax(upcast(logits, dt), dim=-1)
    return divergence_terms(logp, upcast(ref_logprobs_full, dt).detach(), divergence, alpha).sum(dim=-1)
