"""Generator functions of the f-divergences (Appendix H, Table 5) and their stable elementwise terms.

Convention (Appendix H.1): ``D_f(P || Q) = sum_j Q(j) f(t_j)`` with ``t_j = P(j)/Q(j)``, P the policy
pi_theta and Q the anchor pi_ref. The importance-weighted form is ``D_f = E_{j~P}[g_f(w_j)]`` with
``w = Q/P = 1/t`` and ``g_f(w) = w f(1/w)`` (eq. 112-113).

Both f and g are written as functions of *log*-ratios (``f_of_log_t(log t)``,
``g_of_log_w(log w)``), so callers never exponentiate a ratio they do not need.

``divergence_terms(logp, logq, name)`` returns the per-index contribution ``Q f(P/Q)``: it evaluates
``Q f(t)`` where ``t <= 1`` and the identical ``P g(1/t)`` where ``t > 1``, so the ratio that gets
exponentiated never exceeds 1; it returns 0 where both P and Q vanish (masked vocabulary padding),
and the exact limits ``Q f(0)`` / ``P g(0)`` where only one of them vanishes. No NaN leaks into the
value or (via double-``where``) into the gradient.

The KL directions are the two f-divergences ``reverse_kl`` (f = t log t, KL(P||Q)) and
``forward_kl`` (f = -log t, KL(Q||P)).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._common import LogWRange
from .catalog import (  # noqa: F401  (re-exported)
    ALL_DIVERGENCES,
    ALPHA_RANGE,
    F_DIVERGENCES,
    check_divergence,
    f_at_zero,
    g_at_zero,
)

__all__ = [
    "F_DIVERGENCES",
    "ALL_DIVERGENCES",
    "ALPHA_RANGE",
    "check_divergence",
    "f_of_log_t",
    "g_of_log_w",
    "f_at_zero",
    "g_at_zero",
    "divergence_terms",
    "growth_rates",
    "log_w_range",
]

_LOG2 = math.log(2.0)


class _Expm1(torch.autograd.Function):
    """``expm1`` with the gradient ``exp(x)``. torch's own backward uses ``expm1(x) + 1``, which
    rounds to 0 below x ~ -37 (fp64) / -17 (fp32); the tails multiply that gradient by 1/t, so it
    would vanish at extreme ratios."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.expm1(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.exp(x)


_expm1 = _Expm1.apply


def f_of_log_t(name: str, lt: torch.Tensor, alpha: Optional[float] = None) -> torch.Tensor:
    """f(t) evaluated at t = exp(lt), for finite ``lt`` (Table 5, column f(t))."""
    if name == "reverse_kl":  # t log t
        return torch.exp(lt) * lt
    if name == "forward_kl":  # -log t
        return -lt
    if name == "pearson_chi2":  # (t - 1)^2
        return _expm1(lt) ** 2
    if name == "neyman_chi2":  # (t - 1)^2 / t
        return _expm1(lt) ** 2 * torch.exp(-lt)
    if name == "squared_hellinger":  # 1/2 (sqrt t - 1)^2
        return 0.5 * _expm1(0.5 * lt) ** 2
    if name == "jensen_shannon":  # 1/2 (t log t - (t + 1) log((t + 1)/2))
        return 0.5 * (torch.exp(lt) * lt - (torch.exp(lt) + 1.0) * (torch.nn.functional.softplus(lt) - _LOG2))
    if name == "total_variation":  # 1/2 |t - 1|
        return 0.5 * _expm1(lt).abs()
    if name == "alpha":  # (t^a - 1 - a (t - 1)) / (a (a - 1))
        a = float(alpha)
        return (_expm1(a * lt) - a * _expm1(lt)) / (a * (a - 1.0))
    raise ValueError(f"unknown divergence {name!r}")


def g_of_log_w(name: str, lw: torch.Tensor, alpha: Optional[float] = None) -> torch.Tensor:
    """g_f(w) = w f(1/w) evaluated at w = exp(lw), for finite ``lw`` (Table 5, last column / r)."""
    if name == "reverse_kl":  # -log w
        return -lw
    if name == "forward_kl":  # w log w
        return torch.exp(lw) * lw
    if name == "pearson_chi2":  # (1 - w)^2 / w
        return _expm1(lw) ** 2 * torch.exp(-lw)
    if name == "neyman_chi2":  # (1 - w)^2
        return _expm1(lw) ** 2
    if name == "squared_hellinger":  # 1/2 (1 - sqrt w)^2
        return 0.5 * _expm1(0.5 * lw) ** 2
    if name == "jensen_shannon":  # 1/2 [-log w - (1 + w) log((1 + w)/(2w))]
        w = torch.exp(lw)
        return 0.5 * (-lw - (1.0 + w) * (torch.nn.functional.softplus(lw) - _LOG2 - lw))
    if name == "total_variation":  # 1/2 |1 - w|
        return 0.5 * _expm1(lw).abs()
    if name == "alpha":  # (w^(1-a) + (a - 1) w - a) / (a (a - 1))
        a = float(alpha)
        return (_expm1((1.0 - a) * lw) + (a - 1.0) * _expm1(lw)) / (a * (a - 1.0))
    raise ValueError(f"unknown divergence {name!r}")


def growth_rates(name: str, alpha: Optional[float] = None) -> Tuple[float, float]:
    """``(c0, c1)``: Kf++ = r g_f(w) = sg(w) f(1/w) grows like ``e^{c0 |log w|}`` as w -> 0 and
    like ``e^{c1 log w}`` as w -> inf, up to a factor polynomial in log w. 0 = at most polynomial
    in log w (never overflows before log w itself does). The K5 tail grows like the forward-KL row.
    """
    table = {
        "reverse_kl": (0.0, 0.0),  # -log w
        "forward_kl": (0.0, 1.0),  # w log w
        "pearson_chi2": (1.0, 1.0),  # 1/w, w
        "neyman_chi2": (0.0, 2.0),  # 1, w^2
        "squared_hellinger": (0.0, 1.0),  # 1/2, w/2
        "jensen_shannon": (0.0, 1.0),  # log(2)/2, w log(2)/2
        "total_variation": (0.0, 1.0),  # 1/2, w/2
    }
    if name == "alpha":  # w^(1-a) on one side, w/a on the other
        return max(0.0, alpha - 1.0), max(1.0, 1.0 - alpha)
    return table[name]


#: e^24 of the dtype's range kept free above the largest tail value: for the log w factor,
#: 1/(a(a-1)), importance weights and the sum over tokens.
_HEADROOM = 24.0


def log_w_range(name: str, alpha: Optional[float], dtype: torch.dtype) -> LogWRange:
    """``(lo, hi)``: the log w range in which the Kf++ tail of ``name`` and its gradient stay finite
    in ``dtype`` with e^24 to spare, ``(log(finfo.max) - 24) / rate`` per side
    (:func:`growth_rates`); ``None`` for a side that never overflows. For rate 1 that is 64.7 in
    fp32 and 685.8 in fp64.
    """
    room = math.log(torch.finfo(dtype).max) - _HEADROOM
    c0, c1 = growth_rates(name, alpha)
    return (-room / c0 if c0 else None, room / c1 if c1 else None)


def divergence_terms(
    logp: torch.Tensor, logq: torch.Tensor, name: str, alpha: Optional[float] = None
) -> torch.Tensor:
    """Elementwise ``Q f(P/Q)`` from log-probabilities (same shape, any ``[..., n]``).

    Summing over the full vocabulary gives ``D_f(P || Q)``; summing over an index set gives the
    truncated term of the Top-k estimators. Gradients flow into ``logp`` (and ``logq`` if it needs
    them). Zero-mass entries (``-inf`` log-probs) are handled without NaN, see the module docstring.
    """
    p_zero = logp == -math.inf
    q_zero = logq == -math.inf
    finite = ~(p_zero | q_zero)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(finite, logp, zero)
    lq = torch.where(finite, logq, zero)
    lt = lp - lq
    small = finite & (lt <= 0)  # t <= 1: Q f(t)
    big = finite & (lt > 0)  # t > 1: P g(1/t)
    lt_small = torch.where(small, lt, zero)
    lt_big = torch.where(big, lt, zero)
    term_small = torch.exp(lq) * f_of_log_t(name, lt_small, alpha)
    term_big = torch.exp(lp) * g_of_log_w(name, -lt_big, alpha)
    out = torch.where(small, term_small, torch.where(big, term_big, zero))
    # Exact limits where exactly one side has zero mass: Q f(0) is a constant (the true gradient
    # through a zero-mass policy entry is 0); P g(0) keeps its gradient through P.
    only_p_zero = p_zero & ~q_zero
    only_q_zero = q_zero & ~p_zero
    fz = f_at_zero(name, alpha)
    qv = torch.exp(torch.where(only_p_zero, logq, zero)).detach()
    out = torch.where(only_p_zero, qv * fz, out)
    gz = g_at_zero(name, alpha)
    if math.isfinite(gz):
        pv = torch.exp(torch.where(only_q_zero, logp, zero))
        out = torch.where(only_q_zero, pv * gz, out)
    else:
        out = torch.where(only_q_zero, torch.full_like(out, math.inf), out)
    return out
