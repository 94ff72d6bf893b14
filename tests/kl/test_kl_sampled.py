"""Sampled per-token KL estimators (Table 1, §5.2), checked by exact enumeration over the vocabulary."""

import math

import pytest
import torch

from emapg_megatron.kl import (
    SAMPLED_ESTIMATORS,
    exact_kl,
    importance_weight,
    sampled_kl,
)
from emapg_megatron.kl.enumeration import enumerate_expectation

V = 32
TOL = 1e-10


def _setup(seed=0, off_policy=False):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.3, -1)
    samp = None
    if off_policy:
        samp = torch.log_softmax(z + 0.8 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return z, ref, samp


def _exact(z, ref, direction):
    zz = z.clone().requires_grad_(True)
    val = exact_kl(zz, ref, direction)
    (grad,) = torch.autograd.grad(val, zz)
    return val.detach(), grad


def _enum(z, ref, samp, estimator, iw_clip=None):
    def fn(rows, y):
        lp = torch.log_softmax(rows, -1).gather(-1, y[:, None]).squeeze(-1)
        return sampled_kl(
            lp, ref[y], estimator, sampling_logprob=None if samp is None else samp[y], iw_clip=iw_clip
        )

    mu = None if samp is None else samp.exp()
    return enumerate_expectation(fn, z, mu)


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize(
    "estimator,direction", [("k3++", "reverse"), ("k4", "reverse"), ("k5", "forward")]
)
def test_unbiased_estimators_value_and_gradient(estimator, direction, off_policy):
    z, ref, samp = _setup(1, off_policy)
    e = _enum(z, ref, samp, estimator)
    val, grad = _exact(z, ref, direction)
    assert _close(e.value, val), (e.value, val)
    assert _close(e.grad, grad)


# --- Table 1, row by row ------------------------------------------------------------------------


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
def test_table1_k1_unbiased_value_zero_gradient(off_policy):
    z, ref, samp = _setup(2, off_policy)
    e = _enum(z, ref, samp, "k1")
    val, grad = _exact(z, ref, "reverse")
    assert _close(e.value, val)
    assert _close(e.grad, torch.zeros_like(grad))
    assert grad.abs().max() > 1e-2  # the true gradient is not zero: K1's gradient is wrong


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
def test_table1_k2_biased_value_reverse_gradient(off_policy):
    z, ref, samp = _setup(3, off_policy)
    e = _enum(z, ref, samp, "k2")
    val, grad = _exact(z, ref, "reverse")
    p = torch.softmax(z, -1)
    lp = torch.log_softmax(z, -1)
    half_sq = (p * 0.5 * (lp - ref) ** 2).sum()
    assert _close(e.value, half_sq)  # E[(log w)^2 / 2] ...
    assert (e.value - val).abs() > 1e-3  # ... which is not the KL
    assert _close(e.grad, grad)  # gradient is the reverse-KL gradient


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
def test_table1_k3_value_reverse_gradient_forward(off_policy):
    z, ref, samp = _setup(4, off_policy)
    e = _enum(z, ref, samp, "k3")
    rval, rgrad = _exact(z, ref, "reverse")
    _, fgrad = _exact(z, ref, "forward")
    assert _close(e.value, rval)
    assert _close(e.grad, fgrad)  # K3's gradient is the *forward*-KL gradient
    assert (e.grad - rgrad).abs().max() > 1e-2


def test_table1_k5_is_forward_not_reverse():
    z, ref, samp = _setup(5)
    e = _enum(z, ref, samp, "k5")
    fval, fgrad = _exact(z, ref, "forward")
    rval, _ = _exact(z, ref, "reverse")
    assert _close(e.value, fval) and _close(e.grad, fgrad)
    assert (e.value - rval).abs() > 1e-3


# --- per-sample formulas ---------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", SAMPLED_ESTIMATORS)
def test_values_match_table1_expressions(estimator):
    g = torch.Generator().manual_seed(6)
    lp = -torch.rand(50, generator=g, dtype=torch.float64) * 6
    lr = -torch.rand(50, generator=g, dtype=torch.float64) * 6
    w = torch.exp(lr - lp)
    expected = {
        "k1": -torch.log(w),
        "k2": 0.5 * torch.log(w) ** 2,
        "k3": -torch.log(w) + w - 1,
        "k3++": -torch.log(w) + w - 1,
        "k4": -torch.log(w),
        "k5": w * torch.log(w),
    }[estimator]
    assert _close(sampled_kl(lp, lr, estimator), expected, 1e-12)


@pytest.mark.parametrize(
    "estimator,score_weight",
    [
        ("k1", lambda lw: torch.ones_like(lw)),
        ("k2", lambda lw: -lw),
        ("k3", lambda lw: 1 - lw.exp()),
        ("k3++", lambda lw: -lw),
        ("k4", lambda lw: -lw),
        ("k5", lambda lw: 1 - lw.exp()),
    ],
)
def test_per_sample_gradient_wrt_logprob(estimator, score_weight):
    """d est / d log pi(y): the weight multiplying grad log pi(y) (Appendix E/F)."""
    g = torch.Generator().manual_seed(7)
    lp = (-torch.rand(20, generator=g, dtype=torch.float64) * 5).requires_grad_(True)
    lr = -torch.rand(20, generator=g, dtype=torch.float64) * 5
    (d,) = torch.autograd.grad(sampled_kl(lp, lr, estimator).sum(), lp)
    assert _close(d, score_weight(lr - lp.detach()), 1e-12)


def test_importance_weight_and_clip():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ls = torch.tensor([-2.0, -1.0, -0.5], dtype=torch.float64)
    lr = torch.tensor([-1.5, -1.5, -1.5], dtype=torch.float64)
    s = importance_weight(lp, ls)
    assert not s.requires_grad
    assert _close(s, torch.exp(lp.detach() - ls), 1e-15)
    s_clip = importance_weight(lp, ls, (0.5, 2.0))
    assert _close(s_clip, torch.exp(lp.detach() - ls).clamp(0.5, 2.0), 1e-15)
    est = sampled_kl(lp, lr, "k4", sampling_logprob=ls, iw_clip=(0.5, 2.0))
    assert _close(est, s_clip * (lp.detach() - lr), 1e-15)
    # one-sided clip and on-policy with clip
    assert _close(importance_weight(lp, ls, (None, 1.0)), torch.exp(lp.detach() - ls).clamp(max=1.0), 1e-15)
    assert _close(importance_weight(lp, None, (0.0, 10.0)), torch.ones(3, dtype=torch.float64), 0)
    with pytest.raises(ValueError):
        importance_weight(lp, ls, (2.0, 1.0))


def test_clipped_iw_is_biased_but_runs():
    z, ref, samp = _setup(8, off_policy=True)
    e_clip = _enum(z, ref, samp, "k4", iw_clip=(0.9, 1.1))
    val, _ = _exact(z, ref, "reverse")
    assert math.isfinite(e_clip.value.item())
    assert (e_clip.value - val).abs() > 1e-6


@pytest.mark.parametrize("estimator", SAMPLED_ESTIMATORS)
def test_bf16_inputs_computed_in_fp32(estimator):
    g = torch.Generator().manual_seed(9)
    lp32 = -torch.rand(16, generator=g) * 4
    lr32 = -torch.rand(16, generator=g) * 4
    lp = lp32.bfloat16().requires_grad_(True)
    lr = lr32.bfloat16()
    out = sampled_kl(lp, lr, estimator, sampling_logprob=lr)
    assert out.dtype == torch.float32
    ref_out = sampled_kl(lp.detach().float(), lr.float(), estimator, sampling_logprob=lr.float())
    assert torch.equal(out.detach(), ref_out)
    out.sum().backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()
    # fp64 in -> fp64 out
    assert sampled_kl(lp32.double(), lr32, estimator).dtype == torch.float64


def test_unknown_estimator_rejected():
    with pytest.raises(ValueError, match="k6"):
        sampled_kl(torch.zeros(2), torch.zeros(2), "k6")


def test_shapes_broadcast_batch():
    lp = -torch.rand(3, 5, 7)
    lr = -torch.rand(3, 5, 7)
    for est in SAMPLED_ESTIMATORS:
        assert sampled_kl(lp, lr, est, sampling_logprob=lr).shape == (3, 5, 7)
