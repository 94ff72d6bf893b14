"""The --kl-loss-type registry: names, fields, the docs table, and every entry through the
vocab-parallel wiring (kl_from_policy_terms) against the single-device library."""

import math
import pathlib
import re

import pytest
import torch

from emapg_megatron.kl import (
    F_DIVERGENCES,
    KL_DIRECTIONS,
    LOSS_TYPE_NAMES,
    LOSS_TYPES,
    SAMPLED,
    SAMPLED_ESTIMATOR_DIRECTION,
    SAMPLED_ESTIMATORS,
    TOPK_FDIV,
    TOPK_TAILS,
    loss_type,
    sampled_kl,
    topk_fdiv,
    topk_fdiv_type,
    topk_kl,
    uses_topk,
)
from emapg_megatron.parallel import kl_from_policy_terms
from emapg_megatron.parallel.policy_terms import PolicyTerms

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kl_estimators.md"
B, V, K = 6, 16, 4
IW_CLIP = (0.0, 10.0)


def test_names_are_the_cli_formula_and_keys():
    expected = SAMPLED_ESTIMATORS + tuple(f"topk-{d}" for d in KL_DIRECTIONS) + tuple(
        f"topk-{f}" for f in F_DIVERGENCES)
    assert LOSS_TYPE_NAMES == expected
    assert all(t.name == name for name, t in LOSS_TYPES.items())
    assert all(topk_fdiv_type(f) == loss_type(f"topk-{f}") for f in F_DIVERGENCES)


def _docs_rows():
    """``{name: [family, direction, q from, alpha]}`` from the registry table in the docs."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([^`]+)`", cells[0]) if len(cells) == 5 else None
        if m and (m.group(1) in LOSS_TYPES or m.group(1).startswith("topk-")):
            rows[m.group(1)] = cells[1:]
    return rows


def test_docs_table_says_what_the_registry_says():
    rows = _docs_rows()
    assert tuple(rows) == LOSS_TYPE_NAMES
    for name, (family, direction, q_from, alpha) in rows.items():
        t = loss_type(name)
        assert family == t.family and alpha == ("yes" if t.needs_alpha else "no"), name
        if not t.needs_alpha:
            assert direction == t.direction(), name
            assert q_from == (t.q_source() or "-"), name


def test_fields_and_q_source():
    for name in SAMPLED_ESTIMATORS:
        t = loss_type(name)
        assert t.family == SAMPLED and t.q_source() is None
        assert t.direction() == SAMPLED_ESTIMATOR_DIRECTION[name]
    assert loss_type("topk-reverse").q_source() == "old"  # Alg. 1: top-k of pi_old
    assert loss_type("topk-forward").q_source() == "anchor"  # Alg. 2: the anchor's own top-k
    # the f-divergence rule reproduces the paper's two KL choices on the KL generators
    for d in KL_DIRECTIONS:
        assert topk_fdiv_type(f"{d}_kl").direction() == loss_type(f"topk-{d}").direction() == d
    assert loss_type("topk-pearson_chi2").q_source() == "old"
    for f in ("neyman_chi2", "squared_hellinger", "jensen_shannon", "total_variation"):
        assert loss_type(f"topk-{f}").q_source() == "anchor", f
    alpha = loss_type("topk-alpha")
    assert alpha.family == TOPK_FDIV and alpha.needs_alpha
    # alpha -> 0 is the forward KL, alpha -> 1 the reverse KL; alpha = 1/2 is symmetric
    assert [alpha.q_source(a) for a in (-1.0, 0.01, 0.5, 0.51, 0.99, 3.0)] == [
        "anchor", "anchor", "anchor", "old", "old", "old"]


def test_uses_topk():
    assert not uses_topk("k3", 32)
    assert not uses_topk("topk-reverse", 0)
    assert all(uses_topk(n, 1) for n in LOSS_TYPE_NAMES if loss_type(n).family != SAMPLED)


def test_unknown_names_and_bad_alpha_are_clear_errors():
    for bad in ("k6", "pearson_chi2", "topk-kl", ""):
        with pytest.raises(ValueError, match=r"unknown KL kind .*'topk-reverse'.*'topk-alpha'"):
            loss_type(bad)
    with pytest.raises(ValueError, match=r"'topk-alpha' needs alpha .*except 0 and 1"):
        loss_type("topk-alpha").kwargs()
    for a in (0.0, 1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="except 0 and 1"):
            loss_type("topk-alpha").q_source(a)
    with pytest.raises(ValueError, match="only used by the alpha-divergence"):
        loss_type("topk-pearson_chi2").kwargs(0.5)


def _inputs(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g, dtype=dtype)
    old = torch.log_softmax(logits + 0.3 * torch.randn(B, V, generator=g, dtype=dtype), -1)
    anchor = torch.log_softmax(logits + 0.5 * torch.randn(B, V, generator=g, dtype=dtype), -1)
    tokens = torch.multinomial(old.exp(), 1, generator=g)[:, 0]
    return logits, old, anchor, tokens


def _library(name, alpha, logits, tokens, q, anchor, samp_y, tail, iw_clip=IW_CLIP):
    """The single-device estimator on the full logits, picked by hand (independent of the registry)."""
    ref_y = anchor.gather(-1, tokens[:, None])[:, 0]
    kw = dict(sampling_logprob=samp_y, iw_clip=iw_clip)
    if name in SAMPLED_ESTIMATORS:
        lp_y = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        return sampled_kl(lp_y, ref_y, name, **kw)
    if name in ("topk-reverse", "topk-forward"):
        return topk_kl(logits, tokens, q, anchor.gather(-1, q), ref_y, direction=name[5:], tail=tail, **kw)
    return topk_fdiv(logits, tokens, q, anchor.gather(-1, q), ref_y, divergence=name[5:], alpha=alpha, tail=tail,
                     **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tail", TOPK_TAILS)
@pytest.mark.parametrize("name", LOSS_TYPE_NAMES)
def test_every_loss_type_runs_through_kl_from_policy_terms(name, tail, dtype):
    """Finite values, gradients that reach the logits, and the library's result, with q taken
    where the registry says (the six topk-<f> names raised 'unknown KL kind' before the registry)."""
    t = loss_type(name)
    alpha = 0.7 if t.needs_alpha else None
    logits, old, anchor, tokens = _inputs(LOSS_TYPE_NAMES.index(name), dtype)
    source = {"old": old, "anchor": anchor}.get(t.q_source(alpha))
    q = None if source is None else source.topk(K, dim=-1).indices
    samp_y = old.gather(-1, tokens[:, None])[:, 0]

    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    terms = PolicyTerms(lp.gather(-1, tokens[:, None])[:, 0], None if q is None else lp.gather(-1, q), None)
    kl = kl_from_policy_terms(terms, tokens, q, None if q is None else anchor.gather(-1, q),
                              anchor.gather(-1, tokens[:, None])[:, 0], kind=name, tail=tail,
                              sampling_logprob=samp_y, iw_clip=IW_CLIP, alpha=alpha)
    (grad,) = torch.autograd.grad(kl.sum(), x)
    assert kl.shape == (B,) and kl.dtype == dtype
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all() and grad.abs().sum() > 0

    xr = logits.clone().requires_grad_(True)
    ref = _library(name, alpha, xr, tokens, q, anchor, samp_y, tail)
    (grad_ref,) = torch.autograd.grad(ref.sum(), xr)
    # same maths on the same gathered log-probs: equal up to the rounding of a few ops
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(kl, ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad, grad_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", [n for n in LOSS_TYPE_NAMES if loss_type(n).family != SAMPLED])
def test_k0_without_index_set_is_the_sampled_tail(name):
    """q absent (topk_index, logprob_topk, ref_logprob_topk all None) is k = 0, as uses_topk says."""
    t = loss_type(name)
    alpha = 2.0 if t.needs_alpha else None
    logits, old, anchor, tokens = _inputs(3, torch.float64)
    lp_y = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    ref_y = anchor.gather(-1, tokens[:, None])[:, 0]
    kl = kl_from_policy_terms(PolicyTerms(lp_y, None, None), tokens, None, None, ref_y, kind=name, alpha=alpha)
    empty = tokens.new_zeros(B, 0)
    ref = _library(name, alpha, logits, tokens, empty, anchor, None, "unbiased", iw_clip=None)
    torch.testing.assert_close(kl, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs topk_index"):
        kl_from_policy_terms(PolicyTerms(lp_y, None, None), tokens, None, ref_y[:, None], ref_y, kind=name,
                             alpha=alpha)


def test_kl_from_policy_terms_checks_alpha():
    logits, _, anchor, tokens = _inputs(0, torch.float64)
    lp_y = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    terms = PolicyTerms(lp_y, None, None)
    ref_y = anchor.gather(-1, tokens[:, None])[:, 0]
    with pytest.raises(ValueError, match="needs alpha"):
        kl_from_policy_terms(terms, tokens, None, None, ref_y, kind="topk-alpha")
    with pytest.raises(ValueError, match="only used by the alpha-divergence"):
        kl_from_policy_terms(terms, tokens, None, None, ref_y, kind="k3", alpha=0.5)
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_from_policy_terms(terms, tokens, None, None, ref_y, kind="topk-chi2")



def test_the_topk_source_can_be_forced_either_way():
    """--kl-topk-source: auto follows Algorithms 1/2; policy / anchor force whose top-k ids are q
    (NeMo-RL takes the teacher's, the anchor's, for every direction)."""
    from emapg_megatron.kl.config import KLConfig
    from emapg_megatron.step.passes import TopkPlan

    assert KLConfig("topk-reverse").q_source == "old" and KLConfig("topk-forward").q_source == "anchor"
    assert KLConfig("topk-reverse", topk_source="anchor").q_source == "anchor"
    assert KLConfig("topk-forward", topk_source="policy").q_source == "old"
    assert KLConfig("k3", topk_source="anchor").q_source is None  # a sampled estimator has no q
    plan = TopkPlan.of(KLConfig("topk-reverse", k=8, topk_source="anchor"))
    assert (plan.k_in("old"), plan.k_in("anchor")) == (0, 8)
