"""Offset invariance (issue 13): adding a constant c to every logit changes no probability, so the
error of every log-prob, entropy and logit gradient against an fp64 reference on the SAME rounded
inputs must not grow with c. Forming log p as z_y - (max + log sum) in fp32 does: the rounding of
the absolute lse (ulp(1e4) / 2 ~ 5e-4) lands in every output. Here err(c = 1e4) <= 2 err(c = 0),
fp32 and bf16 inputs, TP = 1 in process and TP = 2 in one spawned job. (bf16 spacing at 1e4 is 64,
so its rounded logits are not those of offset 0: each offset has its own reference.)"""

import pytest
import torch
from parallel_workers import (
    PREC_DTYPES,
    PREC_PADDED,
    PREC_SMALL_V,
    PREC_V,
    precision_checks,
    precision_inputs,
)

from emapg_megatron.multiprocess import run_distributed

OUTPUTS = ("topk", "at_q", "at_token") + tuple(
    f"terms{i}/{key}" for i in (0, 1) for key in ("logprob", "logprob_topk", "entropy", "grad"))

TPS = [1, pytest.param(2, marks=pytest.mark.slow)]  # TP 2: one spawned job for every case


@pytest.fixture(scope="module")
def runs():
    """``runs(tp)``: every rank's results, computed once per TP size (TP 1 in process)."""
    cache = {}

    def get(tp):
        if tp not in cache:
            cache[tp] = ([precision_checks(None)] if tp == 1
                         else run_distributed(precision_checks, tp, tp=tp, args=("tp",)))
        return cache[tp]

    return get


def reference(tag, offset):
    """fp64 log-softmax, entropy and gradient of the fused op's loss on the rounded inputs."""
    inp = precision_inputs(offset, tag)
    x = inp["logits"][:, :PREC_V].double().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    ent = -(lp.exp() * lp).sum(-1)
    at_token = lp.gather(-1, inp["tokens"].unsqueeze(-1)).squeeze(-1)
    at_q = lp.gather(-1, inp["q"])
    w = {n: inp[n].float().double() for n in ("w_lp", "w_q", "w_ent")}  # the fp32 weights the ranks use
    ((w["w_lp"] * at_token).sum() + (w["w_q"] * at_q).sum() + (w["w_ent"] * ent).sum()).backward()
    return dict(lp=lp.detach(), entropy=ent.detach(), at_token=at_token.detach(), at_q=at_q.detach(),
                grad=x.grad)


def errors(ranks, tag, offset):
    """Max abs error of each output, and the largest reference magnitude it is compared with."""
    out = ranks[0][f"{tag}/{offset:g}"]
    ref = reference(tag, offset)
    ref_topk = ref["lp"].gather(-1, out["topk_ids"])
    # ties in the rounded inputs may order equal logits differently: compare values, not ids
    assert torch.equal(ref_topk, ref["lp"].topk(out["topk_ids"].shape[-1], dim=-1).values), (tag, offset)
    pairs = {"topk": (out["topk"], ref_topk), "at_q": (out["at_q"], ref["at_q"]),
             "at_token": (out["at_token"], ref["at_token"])}
    for i in (0, 1):
        t = out[f"terms{i}"]
        pairs[f"terms{i}/logprob"] = (t["logprob"], ref["at_token"])
        pairs[f"terms{i}/logprob_topk"] = (t["logprob_topk"], ref["at_q"])
        pairs[f"terms{i}/entropy"] = (t["entropy"], ref["entropy"])
        grad = torch.cat([r[f"{tag}/{offset:g}"][f"terms{i}"]["grad"] for r in ranks], dim=-1)
        assert grad.shape[-1] == PREC_PADDED and torch.all(grad[:, PREC_V:] == 0)  # padding: no gradient
        pairs[f"terms{i}/grad"] = (grad[:, :PREC_V], ref["grad"])
    return {k: ((a.double() - b).abs().max().item(), b.abs().max().item(), a.dtype) for k, (a, b) in pairs.items()}


def floor(scale, dtype):
    """A result stored in ``dtype`` cannot beat half an ulp of its size (2^-24 relative in fp32, 2^-8
    in bf16): allow four of those, so that a lucky err(0) well below any rounding decides nothing.
    (bf16 logits give bf16 gradients: their error is that rounding at both offsets; the fp32 case
    checks the gradient maths strictly.)"""
    return 4 * torch.finfo(dtype).eps / 2 * scale


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("tag", list(PREC_DTYPES))
def test_error_does_not_grow_with_logit_offset(runs, tp, tag):
    ranks = runs(tp)
    for r in ranks[1:]:  # replicated outputs
        for key in ("topk", "at_q", "at_token"):
            assert torch.equal(r[f"{tag}/{1e4:g}"][key], ranks[0][f"{tag}/{1e4:g}"][key])
    e0, e1 = errors(ranks, tag, 0.0), errors(ranks, tag, 1e4)
    bad = {}
    for key in OUTPUTS:
        (err0, scale0, dt), (err1, scale1, _) = e0[key], e1[key]
        bound = 2 * max(err0, floor(max(scale0, scale1), dt))
        if err1 > bound:
            bad[key] = (err0, err1, bound)
    assert not bad, bad


@pytest.mark.parametrize("tp", TPS)
def test_rank_with_only_padding_far_below_zero(runs, tp):
    """Logits ~ -1e4 and, at TP 2, a last rank without a real column: finite and fp32-accurate."""
    inp = precision_inputs(-1e4, "fp32")
    x = inp["logits"][:, :PREC_SMALL_V].double().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    logprob = lp.gather(-1, (inp["tokens"] % PREC_SMALL_V).unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    ((inp["w_lp"].float().double() * logprob).sum() + (inp["w_ent"].float().double() * ent).sum()).backward()
    out = [r["small_vocab"] for r in runs(tp)]
    grad = torch.cat([o["grad"] for o in out], dim=-1)
    assert torch.all(grad[:, PREC_SMALL_V:] == 0)
    for got, want in ((out[0]["logprob"], logprob), (out[0]["entropy"], ent), (grad[:, :PREC_SMALL_V], x.grad)):
        assert (got.double() - want).abs().max().item() <= 1e-5  # fp32 level (NaN fails too)
