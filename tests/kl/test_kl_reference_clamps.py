"""The reference code's clamps behind ``reference_clamps=True`` (``--kl-reference-clamps``, issue 28
item 8), by exact enumeration at V = 8 with every clamp binding on some token: the sampled
estimators equal the reference's ``kl_penalty`` times its importance weight, the Top-k ``paper``
tail its ``compute_memory_efficient_kl`` (L1 + L2 * iw), values and per-token gradients. With the
clamps off every result is bit-identical to the unclamped formulas."""

import pytest
import torch

from emapg_megatron.kl import SAMPLED_ESTIMATORS, importance_weight, sampled_kl, topk_kl
from emapg_megatron.kl._common import REFERENCE_LOG_CLAMP
from emapg_megatron.kl.enumeration import enumerate_expectation
from emapg_megatron.kl.sampled import REFERENCE_CLAMPS

# Policy, anchor and sampling logits chosen so that each clamp binds: token 1 has log w ~ -29,
# token 4 log w ~ +23 and log s ~ -25, token 3 a K3 value ~ 1e2 (log w ~ 5), token 5 log s ~ +26.
Z = torch.tensor([3.0, 1.0, 0.0, -1.0, -25.0, 2.0, -0.5, 0.5], dtype=torch.float64)
REF = torch.log_softmax(torch.tensor([3.0, -28.0, 0.0, 6.0, 1.0, 2.0, -0.5, 0.5], dtype=torch.float64), -1)
SAMP = torch.log_softmax(torch.tensor([3.0, 1.0, 0.0, -1.0, 0.0, -24.0, -0.5, 0.5], dtype=torch.float64), -1)
Q = torch.tensor([0, 2, 6])  # the binding tokens are in the tail
V = Z.numel()
REL = 1e-12
# the reference's names for ours
REFERENCE_NAME = {"k1": "k1", "k2": "k2", "k3": "k3", "k3++": "k3plusplus", "k4": "k4", "k5": "k5"}


# -- the reference code, line for line (verl core_algos.kl_penalty / compute_memory_efficient_kl
#    and dp_actor's importance weight), on log-probs ---------------------------------------------

def reference_kl_penalty(logprob, ref_logprob, kl_penalty):
    if kl_penalty == "k1":
        return logprob - ref_logprob
    if kl_penalty == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty == "k3":
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    if kl_penalty == "k5":
        logw = ref_logprob - logprob
        logw = torch.clamp(logw, min=-20, max=20)
        logr = logprob - logprob.detach()
        return logw.detach().exp() * logw + logr
    if kl_penalty == "k4":
        pg_ratio = (logprob - logprob.detach()).exp()
        return (logprob - ref_logprob).detach() * pg_ratio
    if kl_penalty == "k3plusplus":
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        kld = torch.clamp(kld, min=-10, max=10)
        pg_ratio = (logprob - logprob.detach()).exp()
        return kld * pg_ratio
    raise NotImplementedError(kl_penalty)


def reference_iw(log_prob, old_log_prob, lo=None, hi=None):
    log_kl_iw = (log_prob - old_log_prob).detach()
    log_kl_iw = torch.clamp(log_kl_iw, min=-20, max=20)
    kl_iw = torch.exp(log_kl_iw)
    if lo is not None or hi is not None:
        kl_iw = torch.clamp(kl_iw, min=lo, max=hi)
    return kl_iw


def reference_topk(actor_log_probs_k, ref_log_probs_k, kl_type, not_in_topk, log_prob, ref_log_prob):
    """compute_memory_efficient_kl with tail sampling, from log-probs: (L1, L2)."""
    if kl_type == "full_forward":
        ref_probs_k = ref_log_probs_k.exp()
        l1 = (ref_probs_k * (ref_log_probs_k - actor_log_probs_k)).sum(dim=-1)
        logw = ref_log_prob - log_prob
        logw = torch.clamp(logw, min=-20, max=20)
        logr = log_prob - log_prob.detach()
        sampled_forward_kl = logw.detach().exp() * logw + logr
        return l1, not_in_topk.to(dtype=sampled_forward_kl.dtype) * sampled_forward_kl
    actor_probs_k = actor_log_probs_k.exp()
    l1 = (actor_probs_k * (actor_log_probs_k - ref_log_probs_k)).sum(dim=-1)
    pg_ratio = (log_prob - log_prob.detach()).exp()
    kl_at_sampled = (log_prob - ref_log_prob).detach() * pg_ratio
    return l1, not_in_topk.to(dtype=kl_at_sampled.dtype) * kl_at_sampled


# -- helpers ---------------------------------------------------------------------------------------

def _lp(rows, y):
    return torch.log_softmax(rows, -1).gather(-1, y[:, None]).squeeze(-1)


def _enum(fn, off_policy):
    return enumerate_expectation(fn, Z, SAMP.exp() if off_policy else None)


def _assert_same(a, b, exact=False):
    """Per-token values and gradients, and their expectations, equal (to rounding)."""
    for x, y in ((a.values, b.values), (a.grads, b.grads), (a.value, b.value), (a.grad, b.grad)):
        if exact:
            assert torch.equal(x, y)
        else:
            assert (x - y).abs().max().item() <= REL * max(1.0, y.abs().max().item()), (x - y).abs().max().item()


# -- sampled estimators -----------------------------------------------------------------------------

@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("estimator", SAMPLED_ESTIMATORS)
def test_sampled_reference_clamps_are_the_reference_formula(estimator, off_policy):
    """Same ops as the reference except K3's ``expm1`` (ours) for ``exp - 1``: bit-for-bit elsewhere."""
    clip = (0.0, 10.0) if off_policy else None

    def ours(rows, y):
        return sampled_kl(_lp(rows, y), REF[y], estimator, sampling_logprob=SAMP[y] if off_policy else None,
                          iw_clip=clip, reference_clamps=True)

    def theirs(rows, y):
        lp = _lp(rows, y)
        kld = reference_kl_penalty(lp, REF[y], REFERENCE_NAME[estimator])
        return kld * reference_iw(lp, SAMP[y], *clip) if off_policy else kld

    _assert_same(_enum(ours, off_policy), _enum(theirs, off_policy), exact=estimator not in ("k3", "k3++"))


@pytest.mark.parametrize("estimator", ["k3", "k3++", "k5"])
def test_every_sampled_clamp_binds_here(estimator):
    """Not vacuous: the clamped and exact estimators differ, in value and gradient, on the tokens
    with |log w| > 20 (k5) or a K3 value > 10 (k3, k3++), and only there."""
    (lw_lo, lw_hi), (_, v_hi) = REFERENCE_CLAMPS[estimator]

    def run(clamps):
        return _enum(lambda rows, y: sampled_kl(_lp(rows, y), REF[y], estimator, reference_clamps=clamps), False)

    exact, clamped = run(False), run(True)
    log_w = REF - torch.log_softmax(Z, -1)
    if estimator == "k5":
        binds = (log_w < lw_lo) | (log_w > lw_hi)
    else:
        binds = (-log_w + torch.expm1(log_w)) > v_hi
    assert binds.any() and not binds.all()
    differs = (exact.values != clamped.values) & (exact.grads != clamped.grads).any(-1)
    assert torch.equal(differs, binds)


def test_importance_weight_reference_clamp():
    """log s clamped to [-20, 20] before exp, then the clip: the reference's weight bit for bit;
    only tokens 4 (log s ~ -25) and 5 (~ +26) change."""
    lp = torch.log_softmax(Z, -1)
    for clip in (None, (0.0, 10.0), (0.5, None)):
        ours = importance_weight(lp, SAMP, clip, reference_clamps=True)
        assert torch.equal(ours, reference_iw(lp, SAMP, *(clip or (None, None))))
    exact = importance_weight(lp, SAMP)
    changed = importance_weight(lp, SAMP, reference_clamps=True) != exact
    assert changed.nonzero().squeeze(-1).tolist() == [4, 5]
    assert REFERENCE_LOG_CLAMP == (-20.0, 20.0)


# -- Top-k KL --------------------------------------------------------------------------------------

def _topk(direction, tail, off_policy, clamps):
    def fn(rows, y):
        n = rows.shape[0]
        return topk_kl(rows, y, Q.expand(n, -1), REF[Q].expand(n, -1), REF[y], direction=direction, tail=tail,
                       sampling_logprob=SAMP[y] if off_policy else None, reference_clamps=clamps)

    return _enum(fn, off_policy)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on", "off"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_paper_tail_with_reference_clamps_is_the_reference(direction, off_policy):
    def theirs(rows, y):
        lp_all = torch.log_softmax(rows, -1)
        n = rows.shape[0]
        lp = lp_all.gather(-1, y[:, None]).squeeze(-1)
        not_in = ~(Q.expand(n, -1) == y[:, None]).any(-1)
        l1, l2 = reference_topk(lp_all[:, Q], REF[Q].expand(n, -1), f"full_{direction}", not_in, lp, REF[y])
        return l1 + l2 * reference_iw(lp, SAMP[y]) if off_policy else l1 + l2

    _assert_same(_topk(direction, "paper", off_policy, True), _enum(theirs, off_policy))


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_unbiased_tail_with_reference_clamps_is_paper_plus_the_mass_correction(direction):
    """The clamps and the mass correction are independent: same values, gradients apart by
    -/+ grad m per token (reverse / forward)."""
    unbiased, paper = _topk(direction, "unbiased", True, True), _topk(direction, "paper", True, True)
    zz = Z.clone().requires_grad_(True)
    (gm,) = torch.autograd.grad(torch.softmax(zz, -1)[Q].sum(), zz)
    sign = -1.0 if direction == "reverse" else 1.0
    assert (unbiased.values - paper.values).abs().max().item() <= REL * paper.values.abs().max().item()
    assert (unbiased.grads - paper.grads - sign * gm).abs().max().item() <= REL * paper.grads.abs().max().item()


# -- clamps off: bit-identical ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_clamps_off_bit_identical_to_the_unclamped_formulas(dtype):
    lp = torch.log_softmax(Z, -1).to(dtype).requires_grad_(True)
    lr, ls = REF.to(dtype), SAMP.to(dtype)
    log_w = lr - lp
    r = torch.exp(lp - lp.detach())
    table = {
        "k1": -log_w, "k2": 0.5 * log_w * log_w, "k3": -log_w + torch.expm1(log_w),
        "k3++": r * (-log_w + torch.expm1(log_w)), "k4": r * (-log_w).detach(),
        "k5": torch.exp(log_w).detach() * log_w + (lp - lp.detach()),
    }
    s = torch.exp(lp.detach() - ls).clamp(0.0, 10.0)
    for est, want in table.items():
        for kw, weight in (({}, 1.0), (dict(sampling_logprob=ls, iw_clip=(0.0, 10.0)), s)):
            got = [sampled_kl(lp, lr, est, **kw), sampled_kl(lp, lr, est, reference_clamps=False, **kw)]
            want_w = want if kw == {} else weight * want
            (g_want,) = torch.autograd.grad(want_w.sum(), lp, retain_graph=True)
            for out in got:
                (g,) = torch.autograd.grad(out.sum(), lp)
                assert torch.equal(out, want_w) and torch.equal(g, g_want), est


@pytest.mark.parametrize("tail", ["unbiased", "paper", "none"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_clamps_off_bit_identical_to_the_default(direction, tail):
    a = _topk(direction, tail, True, False)

    def default(rows, y):
        n = rows.shape[0]
        return topk_kl(rows, y, Q.expand(n, -1), REF[Q].expand(n, -1), REF[y], direction=direction, tail=tail,
                       sampling_logprob=SAMP[y])

    _assert_same(a, _enum(default, True), exact=True)
    if tail == "unbiased" and direction == "forward":  # the clamp is not a no-op here
        assert not torch.equal(a.values, _topk(direction, tail, True, True).values)
