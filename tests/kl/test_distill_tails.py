"""On-policy distillation tails of the Top-k KL: the anchor is a teacher of a different shape from the
student, and the peers' biased tails (``truncate`` = ``none``, as verl; ``renorm``, as NeMo-RL) are
compared with ``unbiased``. Every claim is proved by exact enumeration over the sampled token in fp64:
the value and the gradient of each tail, and the bias the algebra predicts for the biased ones.

Notation: pi the student, ref the teacher, q the index set, m = pi(q), m_ref = ref(q),
T = sum_{j in q} of the KL terms (reverse: pi log(pi/ref); forward: ref log(ref/pi)), R the same sum
over the complement, so KL = T + R.
"""

import math

import pytest
import torch

from emapg_megatron.kl import (
    ALL_DIVERGENCES,
    TOPK_TAILS,
    exact_kl,
    fdiv_exact,
    topk_fdiv,
    topk_kl,
)
from emapg_megatron.kl.config import KLConfig
from emapg_megatron.kl.enumeration import enumerate_expectation
from emapg_megatron.parallel import PolicyTerms, kl_from_policy_terms

V = 8
TOL = 1e-12
DIRECTIONS = ("reverse", "forward")
#: Teachers unlike the student: near one-hot, mass where the student has little, near uniform.
SHAPES = ("peaked", "opposite", "flat")


def _student_teacher(shape: str, seed: int, off_policy: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    noise = torch.randn(V, generator=g, dtype=torch.float64)
    teacher = {"peaked": 6.0 * noise, "opposite": -1.5 * z + 0.3 * noise, "flat": 0.1 * noise}[shape]
    ref = torch.log_softmax(teacher, -1)
    samp = None
    if off_policy:
        samp = torch.log_softmax(z + 0.8 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return z, ref, samp


def _index_set(k: int, direction: str, z, ref, seed: int):
    """Even seeds: q as in training (top-k of the student for reverse, of the teacher for forward);
    odd seeds: any fixed set."""
    if seed % 2:
        return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:k]
    return (z if direction == "reverse" else ref).topk(k).indices


def _enum(z, ref, samp, q, direction, tail):
    k = q.numel()

    def fn(rows, y):
        n = rows.shape[0]
        return topk_kl(rows, y, q.expand(n, k), ref[q].expand(n, k), ref[y], direction=direction, tail=tail,
                       sampling_logprob=None if samp is None else samp[y])

    return enumerate_expectation(fn, z, None if samp is None else samp.exp())


def _value_and_grad(fn, z):
    """fn(log_softmax(z)) and its gradient w.r.t. the logits, by plain autograd."""
    zz = z.clone().requires_grad_(True)
    val = fn(torch.log_softmax(zz, -1))
    (grad,) = torch.autograd.grad(val, zz)
    return val.detach(), grad


def _kl(z, ref, direction):
    return _value_and_grad(lambda lp: exact_kl(lp, ref, direction), z)


def _terms_sum(lp, ref, idx, direction):
    """sum over idx of the KL terms, written out (independent of the library's kl_terms)."""
    if direction == "reverse":
        return (lp[idx].exp() * (lp[idx] - ref[idx])).sum()
    return (ref[idx].exp() * (ref[idx] - lp[idx])).sum()


def _complement(q):
    keep = torch.ones(V, dtype=torch.bool)
    keep[q] = False
    return keep.nonzero().squeeze(-1)


def _renorm_by_definition(lp, ref, q, direction):
    """KL of p^ = pi/m and r^ = ref/m_ref on q, from the definition."""
    p_hat = lp[q].exp() / lp[q].exp().sum()
    r_hat = ref[q].exp() / ref[q].exp().sum()
    if direction == "reverse":
        return (p_hat * (p_hat.log() - r_hat.log())).sum()
    return (r_hat * (r_hat.log() - p_hat.log())).sum()


def _renorm_by_algebra(lp, ref, q, direction):
    """reverse: T/m - log m + log m_ref; forward: T/m_ref - log m_ref + log m."""
    t = _terms_sum(lp, ref, q, direction)
    log_m, log_m_ref = torch.logsumexp(lp[q], -1), torch.logsumexp(ref[q], -1)
    if direction == "reverse":
        return t / log_m.exp() - log_m + log_m_ref
    return t / log_m_ref.exp() - log_m_ref + log_m


def _close(a, b, tol=TOL):
    """Equal up to ``tol`` relative to the larger of 1 and the reference's magnitude."""
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unbiased_tail_is_exact_for_a_teacher_of_another_shape(direction, shape, off_policy):
    """E[value] = KL(student, teacher) and E[grad] = grad KL, for every k in 0..V and both q rules."""
    for seed in (0, 1):
        z, ref, samp = _student_teacher(shape, 10 * seed + off_policy, off_policy)
        kl, grad = _kl(z, ref, direction)
        assert kl > 0.05  # a real teacher/student gap
        for k in range(V + 1):
            e = _enum(z, ref, samp, _index_set(k, direction, z, ref, seed), direction, "unbiased")
            assert _close(e.value, kl), (k, seed, e.value.item(), kl.item())
            assert _close(e.grad, grad), (k, seed, (e.grad - grad).abs().max().item())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_tail_is_exact_at_k_equal_V(direction, shape):
    """k = V: each tail is the exact KL for every sampled token, value and gradient (no bias left)."""
    z, ref, samp = _student_teacher(shape, 3, off_policy=True)
    kl, grad = _kl(z, ref, direction)
    q = torch.randperm(V, generator=torch.Generator().manual_seed(5))
    for tail in TOPK_TAILS:
        e = _enum(z, ref, samp, q, direction, tail)
        assert _close(e.values, kl.expand(V)), tail
        assert _close(e.grads, grad.expand(V, V)), tail


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_truncate_bias_is_minus_the_omitted_tail_terms(direction, shape):
    """truncate (= none): value T for every y; E[value] - KL = -R and E[grad] - grad KL = -grad R."""
    for seed in (0, 1):
        z, ref, samp = _student_teacher(shape, 20 + seed, off_policy=True)
        kl, grad = _kl(z, ref, direction)
        for k in range(V + 1):
            q = _index_set(k, direction, z, ref, seed)
            e = _enum(z, ref, samp, q, direction, "truncate")
            t, grad_t = _value_and_grad(lambda lp: _terms_sum(lp, ref, q, direction), z)
            r, grad_r = _value_and_grad(lambda lp: _terms_sum(lp, ref, _complement(q), direction), z)
            assert _close(e.values, t.expand_as(e.values))  # deterministic: no sampled term, no weight
            assert _close(e.value, t) and _close(e.grad, grad_t)
            assert _close(e.value - kl, -r), (k, (e.value - kl).item(), -r.item())
            assert _close(e.grad - grad, -grad_r), k
            if k == 3:  # the old name, the same estimator
                e_none = _enum(z, ref, samp, q, direction, "none")
                assert torch.equal(e_none.values, e.values) and torch.equal(e_none.grads, e.grads)
            if 0 < k < V and seed == 1:  # q = the teacher's top-k can leave it almost no tail
                assert (e.grad - grad).abs().max() > 1e-3  # the gradient bias is real


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_renorm_value_and_bias_are_the_algebras(direction, shape):
    """renorm: the value is KL(p^||r^) (reverse) / KL(r^||p^) (forward) for every y, equal to the
    closed form in T, m and m_ref; its bias and gradient bias are that closed form minus the KL.
    Its gradient never reaches a logit outside q."""
    for seed in (0, 1):
        z, ref, samp = _student_teacher(shape, 30 + seed, off_policy=True)
        kl, grad = _kl(z, ref, direction)
        for k in range(1, V + 1):
            q = _index_set(k, direction, z, ref, seed)
            e = _enum(z, ref, samp, q, direction, "renorm")
            defn, grad_defn = _value_and_grad(lambda lp: _renorm_by_definition(lp, ref, q, direction), z)
            alg, grad_alg = _value_and_grad(lambda lp: _renorm_by_algebra(lp, ref, q, direction), z)
            assert _close(defn, alg) and _close(grad_defn, grad_alg)  # the algebra itself
            assert _close(e.values, defn.expand_as(e.values))  # zero variance given q
            assert _close(e.value - kl, alg - kl), (k, (e.value - kl).item(), (alg - kl).item())
            assert _close(e.grad - grad, grad_alg - grad), k
            assert k == V or e.grads[:, _complement(q)].abs().max() <= TOL  # zero up to rounding
            if k == V:
                assert _close(e.value, kl) and _close(e.grad, grad)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_biased_tails_can_miss_a_large_kl(direction):
    """A teacher proportional to the student on q (p^ = r^) but with 50x the student's relative mass
    off q (student: 91% on q, teacher: 17%): renorm reads 0 with zero gradient, truncate is off by
    0.2 (reverse) and 1.9 (forward, where it even goes negative), unbiased is exact."""
    z = torch.tensor([3.0, 2.5, 2.0, 0.0, -0.5, -1.0, 0.5, -2.0], dtype=torch.float64)
    q = torch.tensor([0, 1, 2])
    teacher = z.clone()
    teacher[_complement(q)] += math.log(50.0)
    ref = torch.log_softmax(teacher, -1)
    kl, grad = _kl(z, ref, direction)
    assert kl > 1.3 and grad.abs().max() > 0.1
    renorm = _enum(z, ref, None, q, direction, "renorm")
    assert renorm.values.abs().max() < 1e-14 and renorm.grads.abs().max() < 1e-14
    trunc = _enum(z, ref, None, q, direction, "truncate")
    assert (trunc.value - kl).abs() > (1.8 if direction == "forward" else 0.19)
    assert (trunc.grad - grad).abs().max() > 0.05
    unbiased = _enum(z, ref, None, q, direction, "unbiased")
    assert _close(unbiased.value, kl) and _close(unbiased.grad, grad)


def test_renorm_at_k0_and_without_mass_on_q():
    """k = 0: the empty sum, 0. q on padding only (-inf for both): 0, no NaN in the gradient."""
    z, ref, _ = _student_teacher("peaked", 40)
    y = torch.arange(V)
    for direction in DIRECTIONS:
        rows = z.expand(V, V).clone().requires_grad_(True)
        empty = torch.empty(V, 0, dtype=torch.long)
        out = topk_kl(rows, y, empty, torch.empty(V, 0, dtype=torch.float64), ref[y], direction=direction,
                      tail="renorm")
        (g,) = torch.autograd.grad(out.sum(), rows)
        assert (out == 0).all() and (g == 0).all()
        zp, refp = z.clone(), ref.clone()
        zp[-2:], refp[-2:] = -math.inf, -math.inf
        rows = zp.expand(V, V).clone().requires_grad_(True)
        q = torch.tensor([V - 2, V - 1]).expand(V, 2)
        out = topk_kl(rows, y, q, refp[q], refp[y], direction=direction, tail="renorm")
        (g,) = torch.autograd.grad(out.sum(), rows)
        assert (out == 0).all() and (g == 0).all()


@pytest.mark.parametrize("divergence", ALL_DIVERGENCES)
def test_fdiv_renorm_is_the_divergence_of_the_renormalised_distributions(divergence):
    """D_f(p^||r^) = sum_q r^ f(p^/r^): the exact f-divergence of softmax(z[q]) from ref renormalised on q,
    gradient zero outside q; the full D_f at k = V; the KL rows agree with topk_kl's renorm."""
    alpha = 0.7 if divergence == "alpha" else None
    z, ref, samp = _student_teacher("opposite", 50, off_policy=True)
    y = torch.arange(V)
    kw = dict(divergence=divergence, alpha=alpha, sampling_logprob=samp[y])
    for k in (1, 3, V):
        q = _index_set(k, "forward", z, ref, 1)
        rows = z.expand(V, V).clone().requires_grad_(True)
        out = topk_fdiv(rows, y, q.expand(V, k), ref[q].expand(V, k), ref[y], tail="renorm", **kw)
        (g,) = torch.autograd.grad(out.sum(), rows)
        zq = z[q].clone().requires_grad_(True)
        want = fdiv_exact(zq, torch.log_softmax(ref[q], -1), divergence=divergence, alpha=alpha)
        (gq,) = torch.autograd.grad(want, zq)
        assert _close(out, want.detach().expand(V)), k
        assert _close(g[:, q], gq.expand(V, k)), k
        assert k == V or g[:, _complement(q)].abs().max() <= TOL * gq.abs().max(), k
        if k == V:
            full, _ = _value_and_grad(lambda lp: fdiv_exact(lp, ref, divergence=divergence, alpha=alpha), z)
            assert _close(out, full.expand(V))
        direction = {"reverse_kl": "reverse", "forward_kl": "forward"}.get(divergence)
        if direction is not None:
            kl = topk_kl(z.expand(V, V), y, q.expand(V, k), ref[q].expand(V, k), ref[y], direction=direction,
                         tail="renorm")
            assert _close(out.detach(), kl)


@pytest.mark.parametrize("tail", ["truncate", "renorm"])
def test_new_tails_through_kl_from_policy_terms_and_truncate_is_none(tail):
    """The vocab-parallel wiring (on gathered log-probs) gives the library's values and gradients;
    no importance weight enters; truncate and none are the same numbers, bit for bit."""
    g = torch.Generator().manual_seed(60)
    z = torch.randn(4, V, generator=g, dtype=torch.float64) * 1.5
    ref = torch.log_softmax(-z + 0.3 * torch.randn(4, V, generator=g, dtype=torch.float64), -1)
    samp_y = torch.randn(4, generator=g, dtype=torch.float64) - 2.0
    y = torch.tensor([0, 3, 5, 7])
    q = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(4)])
    ref_q, ref_y = ref.gather(-1, q), ref.gather(-1, y[:, None])[:, 0]

    def wired(kind, name):
        x = z.clone().requires_grad_(True)
        lp = torch.log_softmax(x, -1)
        terms = PolicyTerms(lp.gather(-1, y[:, None])[:, 0], lp.gather(-1, q), None)
        out = kl_from_policy_terms(terms, y, q, ref_q, ref_y, kind=kind, tail=name, sampling_logprob=samp_y,
                                   iw_clip=(0.0, 0.5))
        return out.detach(), torch.autograd.grad(out.sum(), x)[0]

    for kind in ("topk-reverse", "topk-forward", "topk-squared_hellinger"):
        xr = z.clone().requires_grad_(True)
        if kind == "topk-squared_hellinger":
            lib = topk_fdiv(xr, y, q, ref_q, ref_y, divergence="squared_hellinger", tail=tail)
        else:
            lib = topk_kl(xr, y, q, ref_q, ref_y, direction=kind[5:], tail=tail)
        (lib_grad,) = torch.autograd.grad(lib.sum(), xr)
        value, grad = wired(kind, tail)
        assert _close(value, lib.detach()) and _close(grad, lib_grad), kind
        if tail == "truncate":
            value_none, grad_none = wired(kind, "none")
            assert torch.equal(value, value_none) and torch.equal(grad, grad_none), kind


def test_kl_config_accepts_the_distillation_tails():
    for tail in ("truncate", "renorm", "none"):
        for loss in ("topk-reverse", "topk-forward", "topk-jensen_shannon"):
            KLConfig(loss_type=loss, tail=tail).validate()
    assert {"truncate", "renorm"} <= set(TOPK_TAILS)
