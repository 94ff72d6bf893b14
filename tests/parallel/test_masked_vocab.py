"""Masked vocabulary entries (issue 28 item 8): logit columns at -inf or at the dtype's lowest finite
value, through the fused policy-terms op with and without entropy, in every backward variant
(recompute / in place, fp64 / fp32 / bf16, with and without a loss mask), at TP 1 (in process) and
TP 2 (one spawned job), against the single-device fp64 autograd reference on the real columns with
the masked ones at -inf. A masked column has p = 0: its gradient is exactly 0 and every output is
finite (the recompute backward with entropy gave 0 * inf = NaN there). The fused LM head, whose
backward is the same recompute, is checked with output rows whose logits are ~ -finfo.max."""

import pytest
import torch
from masked_vocab_workers import (
    DTYPES,
    LM_TAGS,
    MASKED,
    PADDED,
    V,
    lmhead_inputs,
    loss_mask_pattern,
    masked_checks,
    masked_inputs,
    name_of,
    variants,
)

from emapg_megatron.kl import topk_kl
from emapg_megatron.multiprocess import run_distributed

# bf16: one rounding of each gradient entry (and of p, stored in place) against the largest
REL = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 2.0 ** -6}
TPS = [1, pytest.param(2, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(tp):
        if tp not in cache:
            cache[tp] = [masked_checks(None)] if tp == 1 else run_distributed(masked_checks, tp, tp=tp,
                                                                              args=("tp",))
        return cache[tp]

    return get


def entropy_of(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` with the masked terms left out (``0 * -inf`` would be NaN, value and gradient)."""
    return -(lp.exp() * lp.masked_fill(mask, 0.0)).sum(-1)


def reference(tag, fill, ent, masked) -> dict:
    """fp64 autograd on the rounded real logits, masked ids at -inf: the library's Top-k KL,
    log pi(y) and the entropy, weighted as in the ranks' loss."""
    inp = masked_inputs(fill)
    mask = inp["mask"]
    x = inp["logits"][..., :V].to(DTYPES[tag]).double().masked_fill(mask, -float("inf")).requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    logprob = lp.gather(-1, inp["tokens"].unsqueeze(-1)).squeeze(-1)
    kl = topk_kl(x, inp["tokens"], inp["q"], inp["ref_q"], inp["ref_y"], direction="reverse",
                 sampling_logprob=inp["samp_y"])
    entropy = entropy_of(lp, mask)
    w = loss_mask_pattern().double() if masked else torch.ones_like(logprob)
    loss = (w * inp["w_kl"] * kl).sum() + (w * inp["w_lp"] * logprob).sum()
    if ent:
        loss = loss + (w * inp["w_ent"] * entropy).sum()
    loss.backward()
    return dict(kl=kl.detach() * w, logprob=logprob.detach() * w, entropy=entropy.detach() * w, grad=x.grad,
                at_masked=mask.gather(-1, inp["q"]), mask=mask)


def max_err(a, b) -> float:
    a, b = a.double(), b.double()
    return (a - b).abs().max().item()


@pytest.mark.parametrize("tp", TPS)
def test_masked_columns_zero_gradient_and_reference_values(runs, tp):
    ranks = runs(tp)
    for tag, fill, ent, inplace, masked in variants():
        name = name_of(tag, fill, ent, inplace, masked)
        ref = reference(tag, fill, ent, masked)
        out = ranks[0][name]
        grad = torch.cat([r[name]["grad"] for r in ranks], dim=-1)
        assert grad.shape[-1] == PADDED and torch.isfinite(grad).all(), name
        real = grad[..., :V].double()
        assert torch.all(real[ref["mask"]] == 0) and torch.all(grad[..., V:] == 0), name
        scale = max(1.0, ref["grad"].abs().max().item())
        assert max_err(real, ref["grad"]) <= REL[tag] * scale, (name, max_err(real, ref["grad"]))
        keys = ("kl", "logprob") + (("entropy",) if ent else ())
        for key in keys:
            assert torch.isfinite(out[key]).all(), (name, key)
            tol = REL[tag] * max(1.0, ref[key].abs().max().item())
            assert max_err(out[key], ref[key]) <= tol, (name, key, max_err(out[key], ref[key]))
        # log pi at a masked id of q (-inf fill only): -inf, with the gradient 0 checked above
        lp_q = out["logprob_topk"]
        assert torch.all(lp_q[ref["at_masked"]] == -float("inf")), name
        assert torch.isfinite(lp_q[~ref["at_masked"]]).all(), name
        for r in ranks[1:]:  # replicated per-token outputs
            for key in keys:
                assert torch.equal(r[name][key], out[key]), (name, key)


def lmhead_reference(tag, ent) -> dict:
    """fp64 autograd through ``h W^T`` with the masked columns replaced by -inf (no gradient to them)."""
    inp = lmhead_inputs(tag)
    h = inp["hidden"].double().requires_grad_(True)
    w = inp["weight"].double().requires_grad_(True)
    cols = torch.zeros(V, dtype=torch.bool)
    cols[list(MASKED)] = True
    z = (h @ w[:V].t()).masked_fill(cols, -float("inf"))
    lp = torch.log_softmax(z, -1)
    logprob = lp.gather(-1, inp["tokens"].unsqueeze(-1)).squeeze(-1)
    entropy = entropy_of(lp, cols.expand_as(lp))
    loss = (inp["w_lp"] * logprob).sum() + (inp["w_q"] * lp.gather(-1, inp["q"])).sum()
    if ent:
        loss = loss + (inp["w_ent"] * entropy).sum()
    loss.backward()
    return dict(logprob=logprob.detach(), entropy=entropy.detach(), grad_hidden=h.grad, grad_weight=w.grad)


@pytest.mark.parametrize("tp", TPS)
def test_lmhead_output_rows_far_below_every_logit(runs, tp):
    ranks = runs(tp)
    for tag in LM_TAGS:
        for ent in (False, True):
            name = f"lmhead/{tag}/ent{int(ent)}"
            ref = lmhead_reference(tag, ent)
            out = ranks[0][name]
            gw = torch.cat([r[name]["grad_weight"] for r in ranks], dim=0)
            got = dict(logprob=out["logprob"], grad_hidden=out["grad_hidden"], grad_weight=gw)
            if ent:
                got["entropy"] = out["entropy"]
            for key, val in got.items():
                assert torch.isfinite(val).all(), (name, key)
                tol = REL[tag] * max(1.0, ref[key].abs().max().item())
                assert max_err(val, ref[key]) <= tol, (name, key, max_err(val, ref[key]))
            assert torch.all(gw[list(MASKED)] == 0) and torch.all(gw[V:] == 0), name
            for r in ranks[1:]:  # dh summed over the group: the same on every rank
                assert max_err(r[name]["grad_hidden"], out["grad_hidden"]) <= REL[tag], name
