"""The output layer fused into the policy-terms op (:mod:`emapg_megatron.parallel.lmhead_terms`) against
the unfused path (Megatron's ColumnParallelLinear function, then the logits ops): values, top-k and the
gradients of the hidden states and of the weight, at TP 1 (in process), TP 2 with and without sequence
parallelism, and through a real GPTModel with the output-layer hook at PP 2 (tied and untied) and TP 2 + SP.

Tolerances. fp64 / fp32: both paths run the same maths on the same logits, so they agree to rounding
(``1e-6`` of the largest entry; the weight gradient is one GEMM unfused, a sum of per-chunk GEMMs
fused). bf16: the logits are the bf16 output of the same GEMM in both paths and every later step is
the same fp32 chunk maths with ``dz`` rounded to bf16, so values and ``dh`` may differ only where a
GEMM kernel rounds a logit differently for a different number of rows: half a bf16 ulp of the
largest entry (``2**-8``). The weight gradient is rounded once per chunk fused (summed in fp32),
once unfused: one bf16 ulp of its largest entry (``2**-7``), and never further from the fp64 truth
than the unfused one is.
"""

import pytest
import torch
from lmhead_workers import DTYPES, op_inputs, op_run, pp_job, saved_bytes, tp_job

from emapg_megatron import mcore_compat
from emapg_megatron.multiprocess import run_distributed

REL = {"fp64": 1e-12, "fp32": 1e-6, "bf16": 2.0 ** -8}
KEYS = ("logprob", "logprob_topk", "entropy", "grad_hidden", "grad_weight")


@pytest.fixture(scope="module")
def runs():
    inp = op_inputs()
    return {
        1: [{f"{tag}/sp0": op_run(inp, tag, None, 1, 0, False) for tag in DTYPES}],
        2: run_distributed(tp_job, 2, tp=2, args=((False, True),)),
        "pp2": run_distributed(pp_job, 2, pp=2, args=(((False, False), (True, False), (True, True)),)),
    }


def max_err(a, b) -> float:
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & (a == b)
    return torch.where(same_inf, torch.zeros_like(a), (a - b).abs()).max().item() if a.numel() else 0.0


def scale(x) -> float:
    return max(1.0, x.double().abs().max().item())


def check_pair(fused, unfused, rel, rel_wgrad, where):
    for key in fused:
        tol = (rel_wgrad if key == "grad_weight" else rel) * scale(unfused[key])
        assert max_err(fused[key], unfused[key]) <= tol, (where, key, max_err(fused[key], unfused[key]), tol)


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("tag", list(DTYPES))
def test_values_and_gradients_match_the_unfused_path(runs, tp, sp, tag):
    rel_w = 2.0 ** -7 if tag == "bf16" else REL[tag]
    for rank, res in enumerate(runs[tp]):
        r = res[f"{tag}/sp{int(sp)}"]
        assert r["fused"]["grad_hidden"].dtype == r["fused"]["grad_weight"].dtype == DTYPES[tag]
        check_pair(r["fused"], r["unfused"], REL[tag], rel_w, (tp, sp, tag, rank))
        s, u = r["scores/fused"], r["scores/unfused"]
        assert torch.equal(s["topk_ids"], u["topk_ids"]), (tp, sp, tag)
        check_pair({k: s[k] for k in ("at", "topk", "lse")}, u, REL[tag], REL[tag], (tp, sp, tag, rank, "scores"))
    if tp > 1:  # per-token outputs replicated; weight shards and (SP) hidden slices differ per rank
        r0, r1 = (res[f"{tag}/sp{int(sp)}"]["fused"] for res in runs[tp])
        for key in ("logprob", "logprob_topk", "entropy"):
            assert torch.equal(r0[key], r1[key]), key


@pytest.mark.slow
def test_padding_rows_of_the_weight_get_zero_gradient(runs):
    from lmhead_workers import PADDED, V

    last = runs[2][1]["fp32/sp0"]["fused"]["grad_weight"]  # rank 1 holds rows 20..39, 37..39 padding
    assert last.shape[0] == PADDED // 2
    assert torch.all(last[V - PADDED // 2:] == 0) and last[: V - PADDED // 2].abs().sum() > 0


def test_bf16_weight_gradient_no_further_from_fp64_than_unfused():
    inp = op_inputs()
    r = op_run(inp, "bf16", None, 1, 0, False)
    exact = dict(inp, hidden=inp["hidden"].to(torch.bfloat16).double(), weight=inp["weight"].to(torch.bfloat16).double())
    ref = op_run(exact, "fp64", None, 1, 0, False)["fused"]
    for key in KEYS:
        fused, unfused = max_err(r["fused"][key], ref[key]), max_err(r["unfused"][key], ref[key])
        assert fused <= unfused + 2.0 ** -8 * scale(ref[key]), (key, fused, unfused)


@pytest.mark.parametrize("tag", ["fp32", "bf16"])
def test_saved_bytes_per_token_bounded_and_independent_of_vocab(tag):
    res = saved_bytes(tag)
    per = res["per_token"]
    assert len(set(per.values())) == 1, per  # the same at V = 1000 and 4000
    bound = 4 * res["hidden"] + 64 * res["k"] + 64
    hidden_row = res["hidden"] * res["elt"]
    assert hidden_row <= per[1000] <= hidden_row + 8 * (res["k"] + 1) + 13 <= bound, per


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tied0/fp32", "tied1/fp32", "tied1/bf16"])
def test_gpt_model_through_the_hook_matches_logits_at_pp2(runs, case):
    _check_gpt([r[case] for r in runs["pp2"]], "bf16" in case)


@pytest.mark.slow
def test_gpt_model_through_the_hook_matches_logits_at_tp2_sequence_parallel(runs):
    _check_gpt([r["gpt/sp/fp32"] for r in runs[2]], False)


def _check_gpt(ranks, bf16):
    out_weights = ("output_layer.weight", "embedding.word_embeddings.weight")  # tied: summed over stages
    for res in ranks:
        assert res["restored"]
        hook = res["hook"]  # on the last stage megatron-core's own seam where it has one, else a patch
        if not hook.pop("last_stage"):
            assert hook == {"patched": False, "model_kwargs": []}
        elif mcore_compat.HAS_OUTPUT_PROCESSOR:
            assert hook == {"patched": False, "model_kwargs": ["output_processor"]}
        else:
            assert hook == {"patched": True, "model_kwargs": []}
        f, u = res["fused"], res["unfused"]
        assert len(f["losses"]) == len(u["losses"])
        for a, b in zip(f["losses"], u["losses"]):
            assert max_err(a, b) <= 1e-6 * scale(b)
        for a, b in zip(f["nograd"], u["nograd"]):
            assert torch.equal(a["topk_ids"], b["topk_ids"])
            for key in ("at", "topk"):
                assert max_err(a[key], b[key]) <= (2.0 ** -8 if bf16 else 1e-6) * scale(b[key]), key
        assert f["grads"].keys() == u["grads"].keys()
        for name, g in u["grads"].items():
            rel = (2.0 ** -7 if name in out_weights else 2.0 ** -8) if bf16 else 1e-6
            assert max_err(f["grads"][name], g) <= rel * g.abs().max().item() + 1e-12, (name, max_err(f["grads"][name], g))
    assert any(len(r["fused"]["losses"]) for r in ranks)  # the last stage ran the loss
