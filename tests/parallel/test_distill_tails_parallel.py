"""The distillation tails (``truncate`` = ``none``, ``renorm``) on the vocab-parallel path: two gloo ranks
(TP 2, a padded vocabulary) through the logits op and through the fused output layer, against the
single-device ``topk_kl`` / ``topk_fdiv`` on the gathered logits, values and gradients (fp64). The anchor is
a teacher of another shape (mass where the student has little), as in on-policy distillation.

The rank function lives here (module level, so the spawned ranks import it by this module's name).
"""

import pytest
import torch

from emapg_megatron.kl import topk_fdiv, topk_kl
from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow

V, PADDED, H = 11, 12, 6  # real vocabulary, padded to TP 2 x 6 columns; hidden size
LEAD = (6,)  # [T]: hidden states [T, H], the fused op's token-major layout
KS = (1, 4, V)
TAILS = ("truncate", "none", "renorm")
KINDS = {"topk-reverse": "reverse", "topk-forward": "forward", "topk-jensen_shannon": "jensen_shannon"}
TOL = 1e-10


def _inputs(k: int) -> dict:
    """Everything both the ranks and the reference need, identical everywhere (fixed seed)."""
    g = torch.Generator().manual_seed(70 + k)
    hidden = torch.randn(LEAD + (H,), generator=g, dtype=torch.float64)
    weight = torch.randn(PADDED, H, generator=g, dtype=torch.float64)
    z = hidden @ weight[:V].t()
    ref = torch.log_softmax(-1.5 * z + 0.3 * torch.randn(LEAD + (V,), generator=g, dtype=torch.float64), -1)
    tokens = torch.multinomial(torch.softmax(z, -1).reshape(-1, V), 1, generator=g).view(LEAD)
    return dict(hidden=hidden, weight=weight, ref=ref, tokens=tokens, w_kl=torch.randn(LEAD, generator=g,
                dtype=torch.float64), q={"old": z.topk(k, dim=-1).indices, "anchor": ref.topk(k, dim=-1).indices})


def _q(inp, kind):
    """q where the registry takes it: pi_old (the student here) for reverse, the anchor otherwise."""
    return inp["q"]["old" if KINDS[kind] == "reverse" else "anchor"]


def _kl_args(inp, q):
    ref_y = inp["ref"].gather(-1, inp["tokens"].unsqueeze(-1)).squeeze(-1)
    return inp["ref"].gather(-1, q), ref_y


def rank_job() -> dict:
    """Every kind x tail x k through both vocab-parallel paths on this rank's shard."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.parallel import (
        kl_from_policy_terms,
        lmhead_policy_terms,
        vocab_parallel_policy_terms,
    )

    group = ps.get_tensor_model_parallel_group()
    rank, width = ps.get_tensor_model_parallel_rank(), PADDED // ps.get_tensor_model_parallel_world_size()
    cols = slice(rank * width, (rank + 1) * width)
    res = {}
    for k in KS:
        inp = _inputs(k)
        for kind in KINDS:
            q = _q(inp, kind)
            ref_q, ref_y = _kl_args(inp, q)
            for tail in TAILS:
                # the logits op on this rank's logits shard
                shard = (inp["hidden"] @ inp["weight"][cols].t()).requires_grad_(True)
                terms = vocab_parallel_policy_terms(shard, inp["tokens"], q, group=group, vocab_size=V)
                kl = kl_from_policy_terms(terms, inp["tokens"], q, ref_q, ref_y, kind=kind, tail=tail)
                (inp["w_kl"] * kl).sum().backward()
                res[f"logits/{kind}/{tail}/{k}"] = dict(kl=kl.detach(), grad=shard.grad)
                # the fused output layer on the hidden states and this rank's weight rows
                h = inp["hidden"].clone().requires_grad_(True)
                w = inp["weight"][cols].clone().requires_grad_(True)
                terms = lmhead_policy_terms(h, w, inp["tokens"], q, group=group, vocab_size=V)
                kl = kl_from_policy_terms(terms, inp["tokens"], q, ref_q, ref_y, kind=kind, tail=tail)
                (inp["w_kl"] * kl).sum().backward()
                res[f"lmhead/{kind}/{tail}/{k}"] = dict(kl=kl.detach(), grad_hidden=h.grad, grad_weight=w.grad)
    return res


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(rank_job, 2, tp=2)


def _reference(inp, kind, tail):
    """The single-device library on the full logits h W^T: value, d/dlogits, d/dh, d/dW."""
    h = inp["hidden"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    z = h @ w[:V].t()
    z.retain_grad()
    q = _q(inp, kind)
    ref_q, ref_y = _kl_args(inp, q)
    if kind in ("topk-reverse", "topk-forward"):
        kl = topk_kl(z, inp["tokens"], q, ref_q, ref_y, direction=KINDS[kind], tail=tail)
    else:
        kl = topk_fdiv(z, inp["tokens"], q, ref_q, ref_y, divergence=KINDS[kind], tail=tail)
    (inp["w_kl"] * kl).sum().backward()
    return dict(kl=kl.detach(), grad=z.grad, grad_hidden=h.grad, grad_weight=w.grad)


def _err(a, b) -> float:
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


@pytest.mark.parametrize("kind", list(KINDS))
def test_distillation_tails_match_the_single_device_library(ranks, kind):
    for k in KS:
        inp = _inputs(k)
        for tail in TAILS:
            ref = _reference(inp, kind, tail)
            where = (kind, tail, k)
            logits = [r[f"logits/{kind}/{tail}/{k}"] for r in ranks]
            lmhead = [r[f"lmhead/{kind}/{tail}/{k}"] for r in ranks]
            for out in logits + lmhead:  # per-token values are replicated on every rank
                assert _err(out["kl"], ref["kl"]) <= TOL, where
            grad = torch.cat([o["grad"] for o in logits], dim=-1)
            assert _err(grad[..., :V], ref["grad"]) <= TOL, where
            assert (grad[..., V:] == 0).all(), where  # padding: zero probability, zero gradient
            for o in lmhead:  # dh is complete on each rank, dW is this rank's rows
                assert _err(o["grad_hidden"], ref["grad_hidden"]) <= TOL, where
            grad_w = torch.cat([o["grad_weight"] for o in lmhead], dim=0)
            assert _err(grad_w, ref["grad_weight"]) <= TOL, where
            assert (ref["grad_weight"][V:] == 0).all()
        for path in ("logits", "lmhead"):  # truncate is none, bit for bit
            for r in ranks:
                a, b = r[f"{path}/{kind}/truncate/{k}"], r[f"{path}/{kind}/none/{k}"]
                assert all(torch.equal(a[key], b[key]) for key in a), (path, kind, k)
