"""Top-k KL (Algorithms 1/2): the three tails, checked by exact enumeration over the vocabulary."""

import math

import pytest
import torch

from emapg_megatron.kl import (
    TOPK_TAILS,
    exact_kl,
    sampled_kl,
    topk_kl,
    topk_kl_from_gathered,
)
from emapg_megatron.kl.enumeration import enumerate_expectation

V = 24
TOL = 1e-10
SAMPLED_TAIL = {"reverse": "k4", "forward": "k5"}


def _setup(seed, off_policy):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    samp = None
    if off_policy:
        samp = torch.log_softmax(z + 0.7 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return z, ref, samp


def _index_set(k, seed):
    return torch.randperm(V, generator=torch.Generator().manual_seed(100 + seed))[:k]


def _enum(z, ref, samp, q, direction, tail, iw_clip=None):
    k = q.numel()

    def fn(rows, y):
        n = rows.shape[0]
        return topk_kl(
            rows,
            y,
            q.expand(n, k),
            ref[q].expand(n, k),
            ref[y],
            direction=direction,
            tail=tail,
            sampling_logprob=None if samp is None else samp[y],
            iw_clip=iw_clip,
        )

    return enumerate_expectation(fn, z, None if samp is None else samp.exp())


def _exact(z, ref, direction):
    zz = z.clone().requires_grad_(True)
    val = exact_kl(zz, ref, direction)
    (grad,) = torch.autograd.grad(val, zz)
    return val.detach(), grad


def _mass_grad(z, q):
    zz = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(torch.softmax(zz, -1)[q].sum(), zz)
    return g


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("k", [0, 1, 5, V])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_unbiased_tail_exact_value_and_gradient(direction, k, off_policy):
    z, ref, samp = _setup(k + 7 * off_policy, off_policy)
    q = _index_set(k, k)
    e = _enum(z, ref, samp, q, direction, "unbiased")
    val, grad = _exact(z, ref, direction)
    assert _close(e.value, val), (e.value.item(), val.item())
    assert _close(e.grad, grad), (e.grad - grad).abs().max().item()


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("k", [0, 1, 5, V])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_paper_tail_has_exactly_the_mass_gradient_bias(direction, k, off_policy):
    """As printed: unbiased value; E[grad] = grad KL + grad m (reverse), grad KL - grad m (forward)."""
    z, ref, samp = _setup(50 + k, off_policy)
    q = _index_set(k, k + 1)
    e = _enum(z, ref, samp, q, direction, "paper")
    val, grad = _exact(z, ref, direction)
    gm = _mass_grad(z, q)
    sign = 1.0 if direction == "reverse" else -1.0
    assert _close(e.value, val)
    assert _close(e.grad, grad + sign * gm), (e.grad - grad - sign * gm).abs().max().item()
    if 0 < k < V:
        assert gm.abs().max() > 1e-3  # the bias is real, not a rounding artefact
        assert (e.grad - grad).abs().max() > 1e-3


@pytest.mark.parametrize("k", [1, 5, V])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_none_tail_is_the_truncated_kl(direction, k):
    z, ref, samp = _setup(70 + k, True)
    q = _index_set(k, k + 2)
    e = _enum(z, ref, samp, q, direction, "none")
    zz = z.clone().requires_grad_(True)
    lp = torch.log_softmax(zz, -1)
    if direction == "reverse":
        trunc = (lp.exp()[q] * (lp[q] - ref[q])).sum()
    else:
        trunc = (ref[q].exp() * (ref[q] - lp[q])).sum()
    (gt,) = torch.autograd.grad(trunc, zz)
    assert _close(e.values, trunc.detach().expand_as(e.values))  # deterministic, no IW
    assert _close(e.grad, gt)
    val, grad = _exact(z, ref, direction)
    if k == V:
        assert _close(e.value, val) and _close(e.grad, grad)
    else:
        assert (e.value - val).abs() > 1e-6  # biased value


@pytest.mark.parametrize("tail", ["unbiased", "paper"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_k0_reduces_to_sampled_estimator_per_sample(direction, tail):
    z, ref, samp = _setup(11, True)
    y = torch.arange(V)
    rows = z.expand(V, V).clone().requires_grad_(True)
    empty = torch.empty(V, 0, dtype=torch.long)
    clip = (0.0, 2.0)
    a = topk_kl(rows, y, empty, torch.empty(V, 0, dtype=torch.float64), ref[y],
                direction=direction, tail=tail, sampling_logprob=samp[y], iw_clip=clip)
    (ga,) = torch.autograd.grad(a.sum(), rows)
    rows2 = rows.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(rows2, -1).gather(-1, y[:, None]).squeeze(-1)
    b = sampled_kl(lp, ref[y], SAMPLED_TAIL[direction], sampling_logprob=samp[y], iw_clip=clip)
    (gb,) = torch.autograd.grad(b.sum(), rows2)
    assert _close(a, b, 1e-13) and _close(ga, gb, 1e-13)


@pytest.mark.parametrize("tail", TOPK_TAILS)
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_kV_is_exact_kl_per_sample(direction, tail):
    z, ref, samp = _setup(12, True)
    q = _index_set(V, 3)
    y = torch.arange(V)
    rows = z.expand(V, V).clone().requires_grad_(True)
    a = topk_kl(rows, y, q.expand(V, V), ref[q].expand(V, V), ref[y], direction=direction,
                tail=tail, sampling_logprob=samp[y])
    (ga,) = torch.autograd.grad(a.sum(), rows)
    val, grad = _exact(z, ref, direction)
    assert _close(a, val.expand(V), 1e-12)
    assert _close(ga, grad.expand(V, V), 1e-12)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_q_as_actual_topk_of_sampling_or_anchor(direction):
    """The construction used in training: q = top-k of pi_old (reverse) or of pi_ref (forward)."""
    z, ref, samp = _setup(13, True)
    src = samp if direction == "reverse" else ref
    q = src.topk(6).indices
    e = _enum(z, ref, samp, q, direction, "unbiased")
    val, grad = _exact(z, ref, direction)
    assert _close(e.value, val) and _close(e.grad, grad)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_token_inside_and_outside_q(direction):
    z, ref, samp = _setup(14, True)
    q = torch.tensor([3, 7, 11])
    lp = torch.log_softmax(z, -1)
    if direction == "reverse":
        trunc = (lp.exp()[q] * (lp[q] - ref[q])).sum()
    else:
        trunc = (ref[q].exp() * (ref[q] - lp[q])).sum()
    y = torch.tensor([7, 4])  # inside, outside
    for tail in ("unbiased", "paper"):
        out = topk_kl(z.expand(2, V), y, q.expand(2, 3), ref[q].expand(2, 3), ref[y],
                      direction=direction, tail=tail, sampling_logprob=samp[y])
        assert _close(out[0], trunc, 1e-13)  # inside q: no tail term at all
        s = torch.exp(lp[4] - samp[4])
        tail_val = (lp[4] - ref[4]) if direction == "reverse" else torch.exp(ref[4] - lp[4]) * (ref[4] - lp[4])
        assert _close(out[1], trunc + s * tail_val, 1e-13)
    # inside q the sampled token gets no tail gradient: gradient equals the truncated gradient
    zz = z.clone().requires_grad_(True)
    out = topk_kl(zz[None], y[:1], q[None], ref[q][None], ref[y[:1]], direction=direction, tail="paper")
    (g_in,) = torch.autograd.grad(out.sum(), zz)
    zz2 = z.clone().requires_grad_(True)
    t2 = topk_kl(zz2[None], y[:1], q[None], ref[q][None], ref[y[:1]], direction=direction, tail="none")
    (g_tr,) = torch.autograd.grad(t2.sum(), zz2)
    assert _close(g_in, g_tr, 1e-14)


def test_duplicate_indices_rejected():
    z = torch.randn(2, V)
    q = torch.tensor([[1, 2, 3], [4, 5, 4]])
    with pytest.raises(ValueError, match="duplicate"):
        topk_kl(z, torch.tensor([0, 0]), q, torch.zeros(2, 3), torch.zeros(2), direction="reverse")


def test_bad_names_rejected():
    z = torch.randn(V)
    args = (z, torch.tensor(0), torch.tensor([1]), torch.zeros(1), torch.zeros(()))
    with pytest.raises(ValueError):
        topk_kl(*args, direction="sideways")
    with pytest.raises(ValueError):
        topk_kl(*args, direction="reverse", tail="k4")


@pytest.mark.parametrize("q_has_padding", [False, True])
@pytest.mark.parametrize("tail", TOPK_TAILS)
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_minus_inf_logits_padding(direction, tail, q_has_padding):
    """Masked vocabulary padding: -inf policy logits and -inf anchor log-probs on the same ids."""
    z, ref, samp = _setup(15, True)
    pad = torch.tensor([V - 3, V - 2, V - 1])
    z = z.clone()
    z[pad] = -math.inf
    ref = ref.clone()
    ref[pad] = -math.inf
    ref = torch.log_softmax(ref, -1)
    samp = samp.clone()
    samp[pad] = -math.inf
    samp = torch.log_softmax(samp, -1)
    q = torch.tensor([0, 5, 9] + ([V - 2] if q_has_padding else []))
    e = _enum(z, ref, samp, q, direction, tail)
    assert torch.isfinite(e.values).all() and torch.isfinite(e.grads).all()
    assert (e.grads[:, pad] == 0).all()
    val, grad = _exact(z, ref, direction)
    assert torch.isfinite(val) and torch.isfinite(grad).all()
    if tail == "unbiased":
        assert _close(e.value, val) and _close(e.grad, grad)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_bf16_inputs_computed_in_fp32(direction):
    g = torch.Generator().manual_seed(16)
    z = (torch.randn(4, 6, 64, generator=g) * 2).bfloat16()
    ref = torch.log_softmax(torch.randn(4, 6, 64, generator=g), -1).bfloat16()
    q = torch.randn(4, 6, 64, generator=g).topk(8).indices
    y = torch.randint(0, 64, (4, 6), generator=g)
    samp = torch.log_softmax(torch.randn(4, 6, 64, generator=g), -1).gather(-1, y[..., None])[..., 0]
    zl = z.clone().requires_grad_(True)
    args = (y, q, ref.gather(-1, q), ref.gather(-1, y[..., None])[..., 0])
    out = topk_kl(zl, *args, direction=direction, sampling_logprob=samp.bfloat16(), iw_clip=(0, 10))
    assert out.shape == (4, 6) and out.dtype == torch.float32
    expect = topk_kl(z.float(), y, q, args[2].float(), args[3].float(), direction=direction,
                     sampling_logprob=samp.bfloat16().float(), iw_clip=(0, 10))
    assert torch.equal(out.detach(), expect)
    out.sum().backward()
    assert zl.grad.dtype == torch.bfloat16 and torch.isfinite(zl.grad.float()).all()
    # fp64 inputs stay fp64
    assert topk_kl(z.double(), *args, direction=direction).dtype == torch.float64


def test_from_gathered_matches_wrapper():
    """The vocab-free core gives the same numbers as the [.., V] wrapper."""
    z, ref, samp = _setup(17, True)
    q = _index_set(5, 4)
    y = torch.arange(V)
    zz = z.expand(V, V)
    lp = torch.log_softmax(zz, -1)
    for direction in ("reverse", "forward"):
        for tail in TOPK_TAILS:
            s = torch.exp(lp.gather(-1, y[:, None])[:, 0] - samp[y]) if tail != "none" else None
            a = topk_kl_from_gathered(lp[:, q], lp.gather(-1, y[:, None])[:, 0], ref[q].expand(V, 5), ref[y],
                                      (y[:, None] == q).any(-1), direction=direction, tail=tail, iw=s)
            b = topk_kl(zz, y, q.expand(V, 5), ref[q].expand(V, 5), ref[y], direction=direction, tail=tail,
                        sampling_logprob=samp[y])
            assert _close(a, b, 1e-14)
