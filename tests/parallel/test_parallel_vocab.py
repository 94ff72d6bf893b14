"""Vocab-parallel primitives and the fused policy-terms op at TP 1, 2, 4 (gloo) against the
single-device KL library on the gathered logits, values and logit gradients; Megatron CE; top-k;
chunking; loss masks; collective counts; a tiny GPTModel under forward_backward_func at PP 2 / TP 2."""

import pytest
import torch
from megatron_workers import assert_pp2_matches
from parallel_workers import (
    ALPHA,
    IW_CLIP,
    KS,
    LEAD,
    PADDED,
    SMALL_V,
    V,
    combos,
    gpt_policy_run,
    loss_mask_pattern,
    make_inputs,
    small_vocab_inputs,
    tp_job,
    vocab_parallel_checks,
)

from emapg_megatron.kl import SAMPLED_ESTIMATORS, sampled_kl, topk_fdiv, topk_kl
from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.parallel import TOPK_KL_KINDS

pytestmark = pytest.mark.slow

TOL = {"fp64": 1e-10, "fp32": 1e-5}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("policy_ckpt"))
    (tp1,) = run_distributed(tp_job, 1, args=(ckpt, True))
    return {
        1: [tp1],
        2: run_distributed(tp_job, 2, tp=2, args=(ckpt, False)),
        4: run_distributed(vocab_parallel_checks, 4, tp=4, args=("world",)),
        "pp2": run_distributed(gpt_policy_run, 2, pp=2, args=(ckpt, False)),
    }


def reference(inp, kind, tail, off_policy, with_entropy, weight=None, vocab_size=V):
    """The single-device library on the gathered logits (padding dropped), in fp64."""
    x = inp["logits"][..., :vocab_size].double().clone().requires_grad_(True)
    d = {n: (t.double() if t.is_floating_point() else t) for n, t in inp.items()}
    samp = d["samp_y"] if off_policy else None
    clip = IW_CLIP if off_policy else None
    lp = torch.log_softmax(x, -1)
    logprob = lp.gather(-1, d["tokens"].unsqueeze(-1)).squeeze(-1)
    if kind in SAMPLED_ESTIMATORS:
        kl = sampled_kl(logprob, d["ref_y"], kind, sampling_logprob=samp, iw_clip=clip)
    elif kind in TOPK_KL_KINDS:
        kl = topk_kl(x, d["tokens"], d["q"], d["ref_q"], d["ref_y"], direction=TOPK_KL_KINDS[kind],
                     tail=tail, sampling_logprob=samp, iw_clip=clip)
    else:
        kl = topk_fdiv(x, d["tokens"], d["q"], d["ref_q"], d["ref_y"], divergence=kind,
                       alpha=ALPHA if kind == "alpha" else None, tail=tail, sampling_logprob=samp, iw_clip=clip)
    entropy = -(lp.exp() * lp).sum(-1)
    w = torch.ones(LEAD, dtype=torch.float64) if weight is None else weight.double()
    loss = (w * d["w_kl"] * kl).sum() + (w * d["w_lp"] * logprob).sum()
    if with_entropy:
        loss = loss + (w * d["w_ent"] * entropy).sum()
    loss.backward()
    return dict(kl=kl.detach(), logprob=logprob.detach(), logprob_topk=lp.gather(-1, d["q"]).detach(),
                entropy=entropy.detach(), grad=x.grad)


def gathered_grad(ranks, name):
    return torch.cat([r[name]["grad"] for r in ranks], dim=-1)


def max_err(a, b):
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    return torch.where(both_inf, torch.zeros_like(a), (a - b).abs()).max().item() if a.numel() else 0.0


def check_against_reference(ranks, name, ref, tol, with_entropy=True, vocab_size=V):
    out = ranks[0][name]
    for r in ranks[1:]:  # per-token outputs are replicated on every rank
        for key in ("kl", "logprob", "logprob_topk"):
            assert torch.equal(r[name][key], out[key]), (name, key)
    for key in ("kl", "logprob", "logprob_topk") + (("entropy",) if with_entropy else ()):
        assert max_err(out[key], ref[key]) <= tol, (name, key, max_err(out[key], ref[key]))
    grad = gathered_grad(ranks, name)
    assert grad.shape == LEAD + (PADDED,)
    real = grad[..., :vocab_size]
    assert max_err(real, ref["grad"]) <= tol, (name, max_err(real, ref["grad"]))
    assert torch.all(grad[..., vocab_size:] == 0), name  # padding columns: zero probability, zero gradient


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tag", ["fp64", "fp32"])
def test_every_estimator_matches_single_device_library(runs, tp, tag):
    ranks = runs[tp]
    assert ranks[0]["tp"] == tp
    for name, kind, tail, k, off, ent in combos():
        inp = make_inputs(k, DTYPES[tag])
        ref = reference(inp, kind, tail, off, ent)
        check_against_reference(ranks, f"{tag}/{name}", ref, TOL[tag], with_entropy=ent)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_inplace_save_probs_backward_matches(runs, tp):
    ranks = runs[tp]
    for k in KS:
        ref = reference(make_inputs(k), "topk-forward", "unbiased", True, True)
        check_against_reference(ranks, f"inplace/fp64/k{k}", ref, TOL["fp64"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_gradient_within_one_bf16_rounding(runs, tp):
    """bf16 logits: fp32 maths per chunk, gradient written in bf16. The save-probs variant stores p in
    bf16, yet the confident token's gradient (g - G p with p ~ 1 - 1e-4: cancellation) stays at the
    fp32 level: its column is corrected from the exact log-prob (bf16 p alone would be ~1e3 x off)."""
    ranks = runs[tp]
    inp = make_inputs(5, seed=7)
    inp["logits"][..., 3] += 12.0
    inp["tokens"][...] = 3
    inp["logits"] = inp["logits"].to(torch.bfloat16)
    scale = (inp["w_kl"].abs() + inp["w_lp"].abs() + inp["w_ent"].abs()).unsqueeze(-1)  # upstream |g|
    for inplace in (False, True):
        for ent in (False, True):
            name = f"bf16/inplace{inplace}/ent{ent}"
            ref = reference(inp, "topk-reverse", "unbiased", False, ent)
            out = ranks[0][name]
            assert max_err(out["logprob"], ref["logprob"]) <= 1e-5
            grad = gathered_grad(ranks, name)
            assert grad.dtype == torch.bfloat16
            err = (grad[..., :V].double() - ref["grad"]).abs()
            # one bf16 rounding of the value plus fp32 noise of the upstream gradient
            tol = 2 ** -8 * ref["grad"].abs() + 2 ** -20 * scale
            if inplace and ent:
                # p itself stored in bf16: -p (G + g_H (log p + H)) can cancel between its two parts,
                # so each part's bf16 error counts (picked columns are still exact)
                logp = torch.log_softmax(inp["logits"][..., :V].double(), -1)
                picked = torch.zeros(LEAD + (V,), dtype=torch.bool)
                picked.scatter_(-1, inp["q"], True)
                picked.scatter_(-1, inp["tokens"].unsqueeze(-1), True)
                tol = tol + ~picked * 2 ** -7 * logp.exp() * scale * (1 + logp.abs())
            excess = err - tol
            assert excess.max().item() <= 0, (name, excess.max().item())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_chunk_size_does_not_change_results_and_collectives_counted(runs, tp):
    ranks = runs[tp]
    base = ranks[0]["chunk/None"]
    for cs in (1, 4):
        out = ranks[0][f"chunk/{cs}"]
        for key in ("kl", "logprob", "logprob_topk", "entropy"):
            assert max_err(out[key], base[key]) <= 1e-12, (cs, key)
        assert max_err(gathered_grad(ranks, f"chunk/{cs}"), gathered_grad(ranks, "chunk/None")) <= 1e-12
    for name in ("chunk/4/counts", "chunk/1/counts", "chunk/4/inplace/counts"):
        counts = ranks[0][name]
        # forward: one all-gather for the whole pass (<= 2 per chunk); backward: none; TP = 1: none
        assert counts["forward"] == (1 if tp > 1 else 0), (name, counts)
        assert counts["backward"] == 0, (name, counts)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_loss_masked_tokens_zero_gradient(runs, tp):
    ranks = runs[tp]
    mask = loss_mask_pattern()
    ref = reference(make_inputs(5), "topk-reverse", "unbiased", True, True, weight=mask)
    for inplace in (False, True):
        name = f"mask/inplace{inplace}"
        out = ranks[0][name]
        for key in ("kl", "logprob", "entropy"):
            assert torch.all(out[key][~mask] == 0), (name, key)
            assert max_err(out[key][mask], ref[key][mask]) <= 1e-10, (name, key)
        grad = gathered_grad(ranks, name)
        assert torch.all(grad[~mask] == 0)
        assert max_err(grad[..., :V], ref["grad"]) <= 1e-10


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_holding_only_padding(runs, tp):
    """vocab_size 25 of 40 columns: at TP 4 rank 3 owns no real id, at TP 2 rank 1 owns five."""
    ranks = runs[tp]
    inp = small_vocab_inputs()
    ref = reference(inp, "topk-reverse", "unbiased", True, True, vocab_size=SMALL_V)
    for name in ("small_vocab", "small_vocab/inplace"):
        check_against_reference(ranks, name, ref, TOL["fp64"], vocab_size=SMALL_V)
    want = inp["logits"][..., :SMALL_V].topk(SMALL_V, dim=-1).indices
    for r in ranks:
        assert torch.equal(r["small_vocab/topk"], want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_distributed_topk_equals_torch_topk_and_skips_padding(runs, tp):
    ranks = runs[tp]
    inp = make_inputs(5)
    full = inp["logits"][..., :V]
    lp = full.log_softmax(-1)
    for k in (1, 5, 25, V):
        want = full.topk(k, dim=-1)
        for r in ranks:
            got = r[f"topk/k{k}"]
            assert torch.equal(got["ids"], want.indices), k
            assert got["ids"].max().item() < V  # padding (logit 6, above every real one) never chosen
            assert max_err(got["logprobs"], lp.gather(-1, want.indices)) <= 1e-12
            assert got["collectives"] == (1 if tp > 1 else 0)  # one packed all-gather (chunk_size 4)
            assert torch.equal(r[f"topk/k{k}/fp32"]["ids"], want.indices)
    assert max_err(ranks[0]["lse"], full.logsumexp(-1)) <= 1e-12
    assert max_err(ranks[0]["logprobs_at"], lp.gather(-1, inp["q"])) <= 1e-12
    assert max_err(ranks[0]["logprobs_at_token"], lp.gather(-1, inp["tokens"].unsqueeze(-1)).squeeze(-1)) <= 1e-12


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_target_logprob_equals_minus_megatron_cross_entropy(runs, tp):
    for r in runs[tp]:  # Megatron's CE computes in fp32: compare at fp32 precision
        for case, err in r["megatron_ce"].items():
            assert err["value"].item() <= 2e-6, (case, err["value"].item())
            assert err["grad"].item() <= 1e-6, (case, err["grad"].item())


def _unshard(name, shards, dim):
    """Concatenate TP shards into the TP = 1 layout (SwiGLU fc1 holds [gate; up] per rank)."""
    if dim < 0:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def test_gpt_policy_loss_pp2_and_tp2_equal_single_rank(runs):
    ref = runs[1][0]["gpt"]
    assert_pp2_matches(*runs["pp2"], ref)
    tp2 = [r["gpt"] for r in runs[2]]
    torch.testing.assert_close(tp2[0]["losses"], ref["losses"], rtol=0, atol=1e-6)
    for name, g in ref["grads"].items():
        full = _unshard(name, [r["grads"][name] for r in tp2], tp2[0]["partition_dims"][name])
        torch.testing.assert_close(full, g, rtol=1e-4, atol=1e-6, msg=name)
    assert ref["grads"]["output_layer.weight"][100:].abs().max() == 0  # padding rows: no gradient
