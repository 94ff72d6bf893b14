"""Extreme ratios in the Top-k tails (issue 13): the ``paper`` tail's reference-code clamp of log w
in K5, and the ``unbiased`` tail's finite, exact-while-representable values and gradients at
|log w| = 50, checked against closed forms and 50-digit mpmath references."""

import math

import mpmath
import pytest
import torch

from emapg_megatron.kl import (
    PAPER_K5_LOG_W_CLAMP,
    sampled_kl,
    topk_fdiv_from_gathered,
    topk_kl,
    topk_kl_from_gathered,
)
from emapg_megatron.kl.divergences import log_w_range

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
# Closed forms are evaluated in double precision; fp32 results carry a few ulps (~1e-7) of
# rounding through exp/log1p and the sum with the truncated term.
REL = {torch.float64: 1e-10, torch.float32: 1e-5}
P_Q, R_Q = (0.3, 0.2), (0.25, 0.25)  # policy / anchor mass on q = {two ids}; y is not in q


def _gathered(lw, dtype):
    """Gathered inputs (log pi(q), log pi(y), log ref(q), log ref(y), y in q) with y outside q and
    log w = log ref(y) - log pi(y) exactly ``lw``; both log-probs of y are valid (<= 0)."""
    lp_q = torch.tensor(P_Q, dtype=dtype).log().requires_grad_(True)
    lp_y = torch.tensor(-55.0 if lw > 0 else -0.5, dtype=dtype, requires_grad=True)
    return lp_q, lp_y, torch.tensor(R_Q, dtype=dtype).log(), lp_y.detach() + lw, torch.tensor(False)


def _value_and_grads(fn, lw, dtype, **kw):
    lp_q, lp_y, lr_q, lr_y, in_q = _gathered(lw, dtype)
    out = fn(lp_q, lp_y, lr_q, lr_y, in_q, **kw)
    g_q, g_y = torch.autograd.grad(out, (lp_q, lp_y))
    return out.detach(), g_q, g_y


def _trunc(direction):
    """The truncated KL on q (double precision) and its gradient w.r.t. log pi(q)."""
    pairs = list(zip(P_Q, R_Q))
    if direction == "reverse":
        return sum(p * math.log(p / r) for p, r in pairs), [p * (1 + math.log(p / r)) for p, r in pairs]
    return sum(r * math.log(r / p) for p, r in pairs), [-r for r in R_Q]


def _rel_close(got, want, rel):
    return abs(float(got) - float(want)) <= rel * max(1.0, abs(float(want)))


# -- paper tail: the reference code's K5 ------------------------------------------------------

def _reference_k5(log_prob, ref_log_prob):
    """The reference code's K5 (core_algos.compute_memory_efficient_kl, full_forward tail, and
    kl_penalty_forward('k5')), line for line."""
    logw = ref_log_prob - log_prob  # log(pi_ref/pi)
    logw = torch.clamp(logw, min=-20, max=20)  # numerical stability
    logr = log_prob - log_prob.detach()  # = 0 but with gradient flow
    return logw.detach().exp() * logw + logr


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_paper_forward_tail_is_the_reference_k5_bit_for_bit(dtype):
    """k = 0, so the estimator is the tail alone: same ops as the reference, so equal exactly."""
    lw = torch.linspace(-60, 60, 241, dtype=dtype)
    lp = torch.where(lw > 0, -61.0, -0.5).to(dtype).requires_grad_(True)
    lr = lp.detach() + lw
    empty = torch.empty(241, 0, dtype=dtype)
    ours = topk_kl_from_gathered(empty, lp, empty, lr, torch.zeros(241, dtype=torch.bool),
                                 direction="forward", tail="paper")
    (g_ours,) = torch.autograd.grad(ours.sum(), lp)
    ref = _reference_k5(lp, lr)
    (g_ref,) = torch.autograd.grad(ref.sum(), lp)
    assert torch.equal(ours, ref) and torch.equal(g_ours, g_ref)
    assert PAPER_K5_LOG_W_CLAMP == (-20.0, 20.0)


@pytest.mark.parametrize("lw", [50.0, -50.0, 20.5, 10.0, -10.0, -25.0])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_paper_forward_tail_exact_values(lw, dtype):
    """Value trunc + e^c c with c = clamp(log w, -20, 20); gradient w.r.t. log pi(y): 1 - e^c
    inside the clamp, 1 (the log r baseline alone) outside; no mass correction on q."""
    out, g_q, g_y = _value_and_grads(topk_kl_from_gathered, lw, dtype, direction="forward", tail="paper")
    c = min(max(lw, -20.0), 20.0)
    trunc, g_trunc = _trunc("forward")
    assert _rel_close(out, trunc + math.exp(c) * c, REL[dtype])
    assert _rel_close(g_y, 1.0 - math.exp(c) if c == lw else 1.0, REL[dtype])
    assert all(_rel_close(a, b, REL[dtype]) for a, b in zip(g_q, g_trunc))


@pytest.mark.parametrize("lw", [50.0, -50.0])
def test_paper_reverse_tail_has_no_clamp(lw):
    """The reference's K4 is r sg(-log w) unclamped: value trunc - log w, gradient -log w."""
    out, _, g_y = _value_and_grads(topk_kl_from_gathered, lw, torch.float64, direction="reverse", tail="paper")
    assert _rel_close(out, _trunc("reverse")[0] - lw, 1e-12) and _rel_close(g_y, -lw, 1e-12)


def test_sampled_k5_is_the_paper_formula_without_clamp():
    lp = torch.tensor(-31.0, dtype=torch.float64)
    assert _rel_close(sampled_kl(lp, lp + 30.0, "k5"), 30.0 * math.exp(30.0), 1e-12)


# -- unbiased tail: Top-k KL ------------------------------------------------------------------

@pytest.mark.parametrize("lw", [50.0, -50.0])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_unbiased_topk_kl_tail_exact_at_log_w_50(dtype, direction, lw):
    """K4: value -log w, gradient -log w. K5: value w log w, gradient 1 - w (50 e^50 ~ 2.6e23 fits
    fp32). The mass correction adds -/+ grad m = -/+ pi(q) on q and nothing to the value."""
    out, g_q, g_y = _value_and_grads(topk_kl_from_gathered, lw, dtype, direction=direction, tail="unbiased")
    trunc, g_trunc = _trunc(direction)
    sign = -1.0 if direction == "reverse" else 1.0
    if direction == "reverse":
        value, grad_y = trunc - lw, -lw
    else:
        value, grad_y = trunc + math.exp(lw) * lw, 1.0 - math.exp(lw)
    assert _rel_close(out, value, REL[dtype]) and _rel_close(g_y, grad_y, REL[dtype])
    assert all(_rel_close(a, b + sign * p, REL[dtype]) for a, b, p in zip(g_q, g_trunc, P_Q))


@pytest.mark.parametrize("lw", [50.0, -50.0, 1000.0, -1000.0])
@pytest.mark.parametrize("tail", ["unbiased", "paper"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_topk_kl_finite_through_the_logits(dtype, direction, tail, lw):
    """End to end from [V] logits: never inf or NaN, in values or logit gradients, at any ratio."""
    z = torch.zeros(8, dtype=dtype)
    z[0] = -lw - 5.0 if lw > 0 else 5.0  # y = 0 is improbable / dominant under the policy
    z = z.requires_grad_(True)
    q = torch.tensor([1, 2])
    ref_y = torch.log_softmax(z.detach(), -1)[0] + lw  # a valid log-prob (<= 0)
    out = topk_kl(z, torch.tensor(0), q, torch.tensor(R_Q, dtype=dtype).log(), ref_y, direction=direction, tail=tail)
    (g,) = torch.autograd.grad(out, z)
    assert torch.isfinite(out) and torch.isfinite(g).all() and g.abs().sum() > 0


# -- unbiased tail: Top-k f-divergences --------------------------------------------------------

MP_F = {
    "pearson_chi2": lambda t, a: (t - 1) ** 2,
    "neyman_chi2": lambda t, a: (t - 1) ** 2 / t,
    "squared_hellinger": lambda t, a: (mpmath.sqrt(t) - 1) ** 2 / 2,
    "jensen_shannon": lambda t, a: (t * mpmath.log(t) - (t + 1) * mpmath.log((t + 1) / 2)) / 2,
    "total_variation": lambda t, a: abs(t - 1) / 2,
    "alpha": lambda t, a: (t**a - 1 - a * (t - 1)) / (a * (a - 1)),
    "reverse_kl": lambda t, a: t * mpmath.log(t),
    "forward_kl": lambda t, a: -mpmath.log(t),
}
# every generator; alpha on both sides of 1/2 and 1, and steep enough (|1 - alpha| = 2) to
# saturate at |log w| = 50 in fp32
FDIV_CASES = [(f, None) for f in MP_F if f != "alpha"] + [("alpha", a) for a in (-1.0, 0.5, 2.0, 3.0)]


def _mp_tail(name, alpha, lw):
    """(Kf++ value g_f(w) = w f(1/w), its gradient f'(1/w) w.r.t. log pi(y)), to 50 digits."""
    with mpmath.workdps(50):
        f = lambda lt: MP_F[name](mpmath.exp(lt), mpmath.mpf(alpha) if alpha is not None else None)  # noqa: E731
        lt = mpmath.mpf(-lw)
        return float(mpmath.exp(lw) * f(lt)), float(mpmath.diff(f, lt) / mpmath.exp(lt))


@pytest.mark.parametrize("lw", [50.0, -50.0])
@pytest.mark.parametrize("name,alpha", FDIV_CASES, ids=[f if a is None else f"alpha={a}" for f, a in FDIV_CASES])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_unbiased_topk_fdiv_tail_at_log_w_50(dtype, name, alpha, lw):
    """Finite everywhere; exact (value g_f(w), gradient f'(1/w)) inside log_w_range; beyond it the
    value at the bound, with gradient g_f(bound) on the w <= 1 side and 0 on the w > 1 side."""
    out, g_q, g_y = _value_and_grads(topk_fdiv_from_gathered, lw, dtype, divergence=name, alpha=alpha)
    assert torch.isfinite(out) and torch.isfinite(g_y) and torch.isfinite(g_q).all()
    lo, hi = log_w_range(name, alpha, dtype)
    c = min(max(lw, -math.inf if lo is None else lo), math.inf if hi is None else hi)
    value, grad = _mp_tail(name, alpha, c)
    if c != lw:
        grad = value if c < 0 else 0.0
    with mpmath.workdps(50):
        trunc = float(sum(r * MP_F[name](mpmath.mpf(p) / r, alpha) for p, r in zip(P_Q, R_Q)))
    assert _rel_close(out, trunc + value, REL[dtype]), (float(out), trunc + value)
    assert _rel_close(g_y, grad, REL[dtype]), (float(g_y), grad)


def _inside(name, alpha, lw, dtype):
    lo, hi = log_w_range(name, alpha, dtype)
    return (lo is None or lo <= lw) and (hi is None or lw <= hi)


def test_saturation_at_log_w_50_is_what_the_docs_say():
    """Only Neyman chi^2 and alpha with |1 - alpha| > 1.29 saturate at |log w| = 50, and only in fp32."""
    cases = [(f, a, lw) for f, a in FDIV_CASES for lw in (50.0, -50.0)]
    assert all(_inside(*c, torch.float64) for c in cases)
    outside = {c for c in cases if not _inside(*c, torch.float32)}
    assert outside == {("neyman_chi2", None, 50.0), ("alpha", -1.0, 50.0), ("alpha", 3.0, -50.0)}
