"""Sampled (Kf++) and Top-k f-divergences (Appendix H, Table 5) against their exact definitions."""

import math

import pytest
import torch

from emapg_megatron.kl import (
    F_DIVERGENCES,
    divergence_terms,
    exact_kl,
    fdiv_exact,
    sampled_fdiv,
    topk_fdiv,
)
from emapg_megatron.kl.divergences import f_at_zero, f_of_log_t, g_at_zero, g_of_log_w
from emapg_megatron.kl.enumeration import enumerate_expectation

V = 24
TOL = 1e-10

# (divergence, alpha) cases; alpha covers a < 0, 0 < a < 1 and a > 1.
CASES = [(d, None) for d in F_DIVERGENCES if d != "alpha"] + [
    ("alpha", -0.5),
    ("alpha", 0.5),
    ("alpha", 2.0),
    ("reverse_kl", None),
    ("forward_kl", None),
]
CASE_IDS = [d if a is None else f"alpha={a}" for d, a in CASES]


def f_literal(name, t, alpha=None):
    """Table 5's f(t), written naively (Neyman with its correct (t-1)^2/t)."""
    return {
        "pearson_chi2": lambda: (t - 1) ** 2,
        "neyman_chi2": lambda: (t - 1) ** 2 / t,
        "squared_hellinger": lambda: 0.5 * (t.sqrt() - 1) ** 2,
        "jensen_shannon": lambda: 0.5 * (t * t.log() - (t + 1) * torch.log((t + 1) / 2)),
        "total_variation": lambda: 0.5 * (t - 1).abs(),
        "alpha": lambda: (t**alpha - 1 - alpha * (t - 1)) / (alpha * (alpha - 1)),
        "reverse_kl": lambda: t * t.log(),
        "forward_kl": lambda: -t.log(),
    }[name]()


def sampled_literal(name, w, alpha=None):
    """Table 5's last column divided by r (value of r is 1)."""
    return {
        "pearson_chi2": lambda: (1 - w) ** 2 / w,
        "neyman_chi2": lambda: (1 - w) ** 2,
        "squared_hellinger": lambda: 0.5 * (1 - w.sqrt()) ** 2,
        "jensen_shannon": lambda: 0.5 * (-w.log() - (1 + w) * torch.log((1 + w) / (2 * w))),
        "total_variation": lambda: 0.5 * (1 - w).abs(),
        "alpha": lambda: (w ** (1 - alpha) + (alpha - 1) * w - alpha) / (alpha * (alpha - 1)),
        "reverse_kl": lambda: -w.log(),
        "forward_kl": lambda: w * w.log(),
    }[name]()


def _setup(seed, off_policy):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    samp = None
    if off_policy:
        samp = torch.log_softmax(z + 0.6 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return z, ref, samp


def _exact(z, ref, name, alpha):
    zz = z.clone().requires_grad_(True)
    val = fdiv_exact(zz, ref, divergence=name, alpha=alpha)
    (grad,) = torch.autograd.grad(val, zz)
    return val.detach(), grad


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_f_and_g_generators_are_consistent(name, alpha):
    lt = torch.linspace(-6, 6, 97, dtype=torch.float64)
    t = lt.exp()
    assert _close(f_of_log_t(name, lt, alpha), f_literal(name, t, alpha), 1e-9)
    assert _close(g_of_log_w(name, lt, alpha), sampled_literal(name, t, alpha), 1e-9)
    # g(w) = w f(1/w)
    assert _close(g_of_log_w(name, lt, alpha), t * f_literal(name, 1 / t, alpha), 1e-9)
    # f(1) = 0
    assert abs(f_of_log_t(name, torch.zeros(1, dtype=torch.float64), alpha).item()) < 1e-15


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_fdiv_exact_matches_definition(name, alpha):
    z, ref, _ = _setup(1, False)
    p = torch.softmax(z, -1)
    expected = (ref.exp() * f_literal(name, p / ref.exp(), alpha)).sum()
    assert _close(fdiv_exact(z, ref, divergence=name, alpha=alpha), expected, 1e-12)
    # gradient vs autograd of the literal definition
    zz = z.clone().requires_grad_(True)
    lit = (ref.exp() * f_literal(name, torch.softmax(zz, -1) / ref.exp(), alpha)).sum()
    (g_lit,) = torch.autograd.grad(lit, zz)
    _, g = _exact(z, ref, name, alpha)
    assert _close(g, g_lit, 1e-12)


def test_kl_rows_agree_with_exact_kl():
    z, ref, _ = _setup(2, False)
    assert _close(fdiv_exact(z, ref, divergence="reverse_kl"), exact_kl(z, ref, "reverse"), 1e-14)
    assert _close(fdiv_exact(z, ref, divergence="forward_kl"), exact_kl(z, ref, "forward"), 1e-14)


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_sampled_values_match_table5(name, alpha):
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(40, generator=g, dtype=torch.float64) * 5
    lr = -torch.rand(40, generator=g, dtype=torch.float64) * 5
    w = torch.exp(lr - lp)
    assert _close(sampled_fdiv(lp, lr, name, alpha=alpha), sampled_literal(name, w, alpha), 1e-10)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_sampled_kfpp_unbiased_value_and_gradient(name, alpha, off_policy):
    z, ref, samp = _setup(4, off_policy)

    def fn(rows, y):
        lp = torch.log_softmax(rows, -1).gather(-1, y[:, None])[:, 0]
        return sampled_fdiv(lp, ref[y], name, alpha=alpha, sampling_logprob=None if samp is None else samp[y])

    e = enumerate_expectation(fn, z, None if samp is None else samp.exp())
    val, grad = _exact(z, ref, name, alpha)
    assert _close(e.value, val) and _close(e.grad, grad)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("k", [0, 1, 5, V])
@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_topk_fdiv_unbiased_value_and_gradient(name, alpha, k, off_policy):
    z, ref, samp = _setup(10 + k, off_policy)
    q = torch.randperm(V, generator=torch.Generator().manual_seed(k))[:k]

    def fn(rows, y):
        n = rows.shape[0]
        return topk_fdiv(rows, y, q.expand(n, k), ref[q].expand(n, k), ref[y], divergence=name, alpha=alpha,
                         sampling_logprob=None if samp is None else samp[y])

    e = enumerate_expectation(fn, z, None if samp is None else samp.exp())
    val, grad = _exact(z, ref, name, alpha)
    assert _close(e.value, val), (e.value.item(), val.item())
    assert _close(e.grad, grad), (e.grad - grad).abs().max().item()


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_topk_fdiv_paper_equals_unbiased_and_none_is_truncated(name, alpha):
    z, ref, samp = _setup(5, True)
    q = torch.tensor([2, 3, 17, 20])
    y = torch.arange(V)
    rows = z.expand(V, V)
    args = (rows, y, q.expand(V, 4), ref[q].expand(V, 4), ref[y])
    kw = dict(divergence=name, alpha=alpha, sampling_logprob=samp[y])
    assert torch.equal(topk_fdiv(*args, tail="paper", **kw), topk_fdiv(*args, tail="unbiased", **kw))
    trunc = (ref[q].exp() * f_literal(name, torch.softmax(z, -1)[q] / ref[q].exp(), alpha)).sum()
    assert _close(topk_fdiv(*args, tail="none", **kw), trunc.expand(V), 1e-12)


def test_topk_fdiv_duplicates_and_names_rejected():
    z = torch.randn(V)
    with pytest.raises(ValueError, match="duplicate"):
        topk_fdiv(z, torch.tensor(0), torch.tensor([1, 1]), torch.zeros(2), torch.zeros(()),
                  divergence="pearson_chi2")
    args = (z, torch.tensor(0), torch.tensor([1]), torch.zeros(1), torch.zeros(()))
    with pytest.raises(ValueError):
        topk_fdiv(*args, divergence="wasserstein")
    with pytest.raises(ValueError):
        topk_fdiv(*args, divergence="alpha")  # alpha missing
    with pytest.raises(ValueError):
        topk_fdiv(*args, divergence="alpha", alpha=1.0)
    with pytest.raises(ValueError):
        topk_fdiv(*args, divergence="pearson_chi2", alpha=0.5)


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_zero_mass_limits(name, alpha):
    """P = 0 < Q gives Q f(0); Q = 0 < P gives P g(0); both zero gives 0; never NaN."""
    lq = torch.tensor([-1.0, -math.inf, -math.inf], dtype=torch.float64)
    lp = torch.tensor([-math.inf, -1.0, -math.inf], dtype=torch.float64, requires_grad=True)
    out = divergence_terms(lp, lq, name, alpha)
    assert out[0].item() == pytest.approx(math.exp(-1) * f_at_zero(name, alpha))
    assert out[1].item() == pytest.approx(math.exp(-1) * g_at_zero(name, alpha))
    assert out[2].item() == 0.0
    # the limits agree with tiny-but-positive mass where they are finite
    tiny = torch.tensor([-60.0], dtype=torch.float64)
    if math.isfinite(f_at_zero(name, alpha)):
        near = divergence_terms(tiny, lq[:1], name, alpha).item()
        assert near == pytest.approx(out[0].item(), rel=1e-6, abs=1e-12)
    if math.isfinite(g_at_zero(name, alpha)):
        near = divergence_terms(lp[1:2].detach(), tiny, name, alpha).item()
        assert near == pytest.approx(out[1].item(), rel=1e-6, abs=1e-12)
    finite = torch.isfinite(out)
    if finite.any():
        (g,) = torch.autograd.grad(out[finite].sum(), lp)
        assert not torch.isnan(g).any()


@pytest.mark.parametrize("name,alpha", CASES, ids=CASE_IDS)
def test_minus_inf_padding_fdiv(name, alpha):
    z, ref, samp = _setup(6, True)
    pad = torch.tensor([V - 2, V - 1])
    z = z.clone()
    z[pad] = -math.inf
    ref = ref.clone()
    ref[pad] = -math.inf
    ref = torch.log_softmax(ref, -1)
    q = torch.tensor([0, 4, V - 1])  # includes a padding id

    def fn(rows, y):
        n = rows.shape[0]
        return topk_fdiv(rows, y, q.expand(n, 3), ref[q].expand(n, 3), ref[y], divergence=name, alpha=alpha)

    e = enumerate_expectation(fn, z)
    val, grad = _exact(z, ref, name, alpha)
    assert torch.isfinite(e.grads).all() and torch.isfinite(grad).all()
    assert _close(e.value, val) and _close(e.grad, grad)


def test_bf16_fdiv_computed_in_fp32():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(3, 40, generator=g).bfloat16().requires_grad_(True)
    ref = torch.log_softmax(torch.randn(3, 40, generator=g), -1).bfloat16()
    q = torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(3)])
    y = torch.tensor([1, 2, 3])
    out = topk_fdiv(z, y, q, ref.gather(-1, q), ref.gather(-1, y[:, None])[:, 0], divergence="jensen_shannon")
    assert out.dtype == torch.float32
    out.sum().backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()
    assert fdiv_exact(z.detach(), ref, divergence="total_variation").dtype == torch.float32
