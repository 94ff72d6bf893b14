"""Sequence packing: the token-budget planner, pack/unpack, and packed == padded through the model."""

import random

import pytest
import torch
from packing_workers import AGG_MODES, packed_vs_padded, rollout_like

from emapg_megatron.algo.config import LossConfig
from emapg_megatron.algo.policy_loss import normaliser, policy_loss_terms
from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.training import packing

RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def long_tailed(n: int, seed: int, median: int = 12, cap: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [max(2, min(cap * median, round(rng.lognormvariate(0, 1.0) * median))) for _ in range(n)]


# --- the planner ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [64, 200, 1000])
def test_plan_budget_equal_counts_every_sequence_once(seed, budget):
    per_rank = [long_tailed(24, seed * 10 + r) for r in range(3)]
    plans = packing.plan_microbatches(per_rank, budget)
    assert len({len(p) for p in plans}) == 1  # the same micro-batch count on every DP rank
    cap = max(budget, max(max(ls) for ls in per_rank))
    for ls, p in zip(per_rank, plans):
        assert sorted(i for g in p for i in g) == list(range(len(ls)))
        assert all(sum(ls[i] for i in g) <= cap for g in p)


def test_plan_balances_micro_batches_and_uses_few():
    lengths = long_tailed(64, 7)
    (bins,) = packing.plan_microbatches([lengths], 400)
    loads = [sum(lengths[i] for i in g) for g in bins]
    assert len(bins) <= -(-sum(lengths) // 400) + 1
    assert max(loads) - min(loads) <= max(lengths)  # longest-first into the least loaded bin


def test_plan_oversized_sequence_gets_its_own_micro_batch():
    (bins,) = packing.plan_microbatches([[50, 3, 3, 3]], 10)
    assert [0] in bins


def test_row_tokens_round_up_and_uniform_under_pp():
    assert packing.row_tokens([5, 17], 8, uniform=False) == [8, 24]
    assert packing.row_tokens([5, 17], 8, uniform=True) == [24, 24]


def test_sequence_lengths_reach_the_last_label():
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    assert packing.sequence_lengths(mask) == [4, 1, 6]


# --- pack / unpack / per-sequence aggregation (no model) ---------------------------------------------
def local_plan(batch: dict, budget: int) -> packing.PackPlan:
    lengths = packing.sequence_lengths(batch["mask"])
    (groups,) = packing.plan_microbatches([lengths], budget)
    loads = [sum(lengths[i] for i in g) for g in groups]
    return packing.PackPlan(groups, lengths, tuple(batch["tokens"].shape),
                            packing.row_tokens(loads, packing.ROW_MULTIPLE, uniform=False))


def test_pack_unpack_round_trip_and_layout():
    lengths = [9, 3, 17, 5, 12, 1]
    batch = rollout_like(1, lengths, 20)
    batch["topk"] = torch.randn(6, 20, 3)
    p = local_plan(batch, 24)
    mbs = packing.pack(batch, p)
    assert [mb["tokens"].shape for mb in mbs] == [(1, T) for T in p.row_tokens]
    outs = [{"x": mb["labels"].float() * mb["mask"], "k": mb["topk"]} for mb in mbs]
    back = packing.unpack(outs, mbs, p.shape)
    need = torch.arange(20)[None, :] < torch.tensor(p.lengths)[:, None]
    assert torch.equal(back["x"], batch["labels"].float() * batch["mask"])
    assert torch.equal(back["k"][need], batch["topk"][need])
    for mb in mbs:
        starts = mb["cu_seqlens"][:-1].long()
        assert (mb["position_ids"][0, starts] == 0).all()  # positions restart per sequence
        assert torch.equal(mb["advantages"], batch["advantages"][mb["layout"].rows])


def test_block_causal_mask():
    m = packing.block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0]
    allowed = ~m
    assert allowed[1, 0] and not allowed[0, 1] and not allowed[2, 1] and allowed[4, 2]
    assert allowed.sum() == 3 + 6


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_aggregation_over_packed_micro_batches_is_the_padded_one(agg):
    """Summed over micro-batches and divided by the batch's normaliser, the packed loss is the
    padded loss of the whole batch, for every aggregation mode."""
    lengths = long_tailed(16, 3, median=6)
    L = max(lengths)
    batch = rollout_like(2, lengths, L)
    g = torch.Generator().manual_seed(5)
    batch.update(logprob=-torch.rand(16, L, generator=g), old_logprob=-torch.rand(16, L, generator=g))
    cfg = LossConfig(agg_mode=agg, entropy_coef=0.1)

    def args(b):
        return (b["logprob"], b["old_logprob"], b["advantages"], 0.5 * b["mask"], b["logprob"].abs(),
                b["mask"], cfg)

    ref, ref_m = policy_loss_terms(*args(batch))
    mbs = packing.pack(batch, local_plan(batch, 40))
    def packed_loss(mb):  # the trainer's: per-token values laid out per sequence first
        logprob, old, adv, kl, entropy, mask, cfg = args(mb)
        return policy_loss_terms(*mb["layout"].per_sequence(logprob, old), adv,
                                 *mb["layout"].per_sequence(kl, entropy, mask), cfg)

    outs = [packed_loss(mb) for mb in mbs]
    norm = normaliser(batch["mask"], agg)
    assert abs(sum(o[0] for o in outs) / norm - ref / norm) <= 1e-6 * abs(ref / norm)
    for k, v in ref_m.items():
        torch.testing.assert_close(sum(o[1][k] for o in outs), v, rtol=1e-6, atol=1e-6)


# --- through the model at TP=2, PP=2, DP=2 ----------------------------------------------------------
LENGTHS = [30, 4, 9, 17, 6, 44, 12, 3]  # global batch: 4 sequences per DP rank


@pytest.fixture(scope="module")
def tp_pp_dp():
    return run_distributed(packed_vs_padded, 8, tp=2, pp=2, args=(LENGTHS, 48, 40, "topk-reverse", True),
                           timeout=240)


def last_stages(outs):
    return [o for o in outs if o["last_stage"]]


def assert_passes_equal(outs) -> None:
    """The packed old and anchor passes of ``packed_vs_padded`` equal the padded ones."""
    for o in last_stages(outs):
        pad, pk = o["padded_passes"], o["packed_passes"]
        m = pad["mask"].bool()
        for k in ("old_logprob", "ref_logprob"):
            assert rel(pk[k][m], pad[k][m]) <= RTOL, k
        assert torch.equal(pk["topk_index"][m], pad["topk_index"][m])
        assert rel(pk["ref_logprob_topk"][m], pad["ref_logprob_topk"][m]) <= RTOL


def assert_update_equal(outs, agg: str, atol: float = 0.0) -> None:
    """The packed update's metric sums and gradients equal the padded ones (sums within RTOL,
    relative to at least 1e-6, or within RTOL plus ``atol``, whichever is wider)."""
    for o in outs:
        (pad_sums, pad_grads), (pk_sums, pk_grads) = o[agg]["padded"], o[agg]["packed"]
        for k, v in pad_sums.items():
            bound = max(RTOL * max(abs(v), 1e-6), RTOL * abs(v) + atol)
            assert abs(pk_sums[k] - v) <= bound, (agg, k, pk_sums[k], v)
        assert set(pk_grads) == set(pad_grads)
        for name, g in pad_grads.items():
            assert rel(pk_grads[name], g) <= RTOL, (agg, name, rel(pk_grads[name], g))
        assert any(g.abs().sum() > 0 for g in pk_grads.values())


def test_no_grad_passes_equal(tp_pp_dp):
    assert_passes_equal(tp_pp_dp)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_metrics_and_grads_equal(tp_pp_dp, agg):
    assert_update_equal(tp_pp_dp, agg)


def test_plans_equal_counts_and_little_padding(tp_pp_dp):
    plans = [o["plans"][-1] for o in tp_pp_dp]
    assert len({len(p["groups"]) for p in plans}) == 1  # every rank runs the same number
    assert all(len(set(p["rows"])) == 1 for p in plans)  # one activation shape under PP
    assert all(sum(map(len, p["groups"])) == len(LENGTHS) // 2 for p in plans)
