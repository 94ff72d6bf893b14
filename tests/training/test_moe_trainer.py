"""Mixture-of-experts training at expert parallelism: the one-rank run's metrics and weights.

A 2-layer, 4-expert top-2 policy (every layer a MoE layer, Megatron's SequentialMLP experts and
TopKRouter) trains three trainer steps (two optimizer updates each) from the same weights on one
rank and at EP=2 over two ranks (each holding two experts of every layer; the rollouts sampled
by the expert group together), with the allgather and the alltoall token dispatchers and with
the distributed optimizer: the metrics match the one-rank run (rel <= 1e-4) and so does every
weight afterwards, router and experts included (each global expert read from the rank holding it).
"""

import pytest
import torch
from test_equivalence_matrix import BASE as DENSE_BASE
from test_equivalence_matrix import STEPS
from trainer_launch import COMPARED as DENSE_COMPARED

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow

# the expert load (most-loaded expert over the mean, per layer, counted over all data ranks)
COMPARED = (*DENSE_COMPARED, "moe_load_max_over_mean", "moe_load_max_over_mean_worst")

# the dense equivalence matrix's run on tiny-cpu's model with experts
BASE = [*DENSE_BASE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
EP2 = ["--expert-model-parallel-size", "2"]
LAYOUTS = {
    "ep2-allgather": EP2,
    "ep2-alltoall": [*EP2, "--moe-token-dispatcher-type", "alltoall"],
    "ep2-distopt": [*EP2, "--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def weights():
    from moe_train_workers import initial_weights

    (out,) = run_distributed(initial_weights, 1, args=(BASE,), timeout=300)
    return out


@pytest.fixture(scope="module")
def reference(weights):
    from moe_train_workers import train_steps_from

    (out,) = run_distributed(train_steps_from, 1, args=(BASE, STEPS, weights), timeout=600)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_trains_like_one_rank(layout, weights, reference):
    from moe_train_workers import train_steps_from

    outs = run_distributed(train_steps_from, 2, ep=2, args=([*BASE, *LAYOUTS[layout]], STEPS, weights),
                           timeout=600)
    ref = reference["metrics"]
    for rank, out in enumerate(outs):
        for step, (m, r) in enumerate(zip(out["metrics"], ref, strict=True), start=1):
            assert m["reward_mean"] == r["reward_mean"], (rank, step)  # identical samples
            for k in COMPARED:
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, rank, step)
    assert ref[-1]["ema_lag"] > 0 and ref[-1]["kl"] != 0  # the policy really moved
    # each rank holds two of the four experts of each layer; together, all of them
    held = [set(out["expert_keys"]) for out in outs]
    assert not held[0] & held[1] and held[0] | held[1] == set(reference["expert_keys"])
    assert len(reference["expert_keys"]) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    moved = 0
    for out in outs:
        for key, p in out["params"].items():
            r = reference["params"][key]
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6, msg=key)
            moved += ".router." in key and not torch.equal(r, weights[key.split("|")[0]])
    assert moved > 0  # the router trained


def test_router_losses_enter_the_backward_and_are_logged(weights, reference):
    """--moe-aux-loss-coeff / --moe-z-loss-coeff: Megatron's router adds the losses to the backward
    (so the router trains differently from the coefficient-0 reference) and the step logs them
    (moe_aux_loss, moe_z_loss: before their coefficients, mean per MoE layer and training
    micro-batch); none is logged at 0."""
    from moe_train_workers import train_steps_from

    argv = [*BASE, "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
    (out,) = run_distributed(train_steps_from, 1, args=(argv, STEPS, weights), timeout=600)
    for m, r in zip(out["metrics"], reference["metrics"], strict=True):
        assert m["moe_aux_loss"] > 0 and m["moe_z_loss"] > 0, m
        assert "moe_aux_loss" not in r and "moe_z_loss" not in r
        assert m["reward_mean"] == r["reward_mean"] or m["step"] > 1  # step 1 samples the same weights
    # logged before its coefficient: 1 for a perfectly balanced router, up to the expert count
    # for a collapsed one; a fresh router is near balance
    assert out["metrics"][0]["moe_aux_loss"] == pytest.approx(1.0, rel=0.5)
    router = [k for k in out["params"] if ".router." in k]
    assert router and any(not torch.equal(out["params"][k], reference["params"][k]) for k in router)


def _run(nproc, ep, argv, weights):
    from moe_train_workers import run_from

    return run_distributed(run_from, nproc, ep=ep, args=(argv, weights), timeout=600)[0]


@pytest.mark.parametrize("saved_ep, resumed_ep", [(2, 2), (2, 1), (1, 2)])
def test_checkpoint_resumes_exactly_and_reshards_experts(saved_ep, resumed_ep, weights, reference, tmp_path):
    """Two steps saved at one EP, the third resumed at the same or the other EP (model, optimizer
    and the EMA anchor over the experts resharded by dist_checkpointing): bit-exact at the same
    layout, the one-rank run's step 3 (rel <= 1e-4) at the other."""
    ep_flags = {1: [], 2: EP2}
    saved = [*BASE, *ep_flags[saved_ep], "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
             "--train-iters", "2", "--log-dir", str(tmp_path / "a")]
    first = _run(saved_ep, saved_ep, saved, weights)
    resumed = [*BASE, *ep_flags[resumed_ep], "--load", str(tmp_path / "ckpt"), "--train-iters", "3",
               "--log-dir", str(tmp_path / "b")]
    (third,) = _run(resumed_ep, resumed_ep, resumed, weights)
    ref = reference["metrics"]
    assert [m["step"] for m in first] == [1, 2] and third["step"] == 3
    for m, r in zip([*first, third], ref, strict=True):
        for k in COMPARED:
            assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, m["step"])
    if saved_ep == resumed_ep == 2:
        uninterrupted = _run(2, 2, [*BASE, *EP2, "--train-iters", "3", "--log-dir", str(tmp_path / "c")],
                             weights)
        assert {k: third[k] for k in COMPARED} == {k: uninterrupted[2][k] for k in COMPARED}


def test_routing_replay_routes_as_recorded_against_a_perturbed_router():
    """--moe-routing-replay r2's mechanism (Megatron's RouterReplay, driven by the old pass's
    recording and the training pass's micro-batches): once the router is perturbed, fresh routing
    disagrees with the recorded routes on many tokens, replayed routing on none."""
    from moe_train_workers import replay_against_a_perturbed_router

    (out,) = run_distributed(replay_against_a_perturbed_router, 1, timeout=300)
    assert out["shape"] == (3, 12, 2, 2) and out["dtype"] == "torch.uint8"  # [b, s, layers, k]
    assert min(out["fresh"]) > 0.2, out["fresh"]
    assert out["replayed"] == [0.0, 0.0]


def test_routing_replay_at_ep2_trains_like_one_rank(weights, reference):
    """R2 at EP=2 (routes recorded and replayed per rank) gives the one-rank R2 run's metrics,
    and differs from the run without replay (the routes it replays are not the fresh ones)."""
    from moe_train_workers import train_steps_from

    argv = [*BASE, "--moe-routing-replay", "r2"]
    (one,) = run_distributed(train_steps_from, 1, args=(argv, STEPS, weights), timeout=600)
    outs = run_distributed(train_steps_from, 2, ep=2, args=([*argv, *EP2], STEPS, weights), timeout=600)
    for out in outs:
        for m, r in zip(out["metrics"], one["metrics"], strict=True):
            for k in COMPARED:
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, m["step"])
    assert one["metrics"][-1]["kl"] != 0
    assert any(m["kl"] != r["kl"] for m, r in zip(one["metrics"], reference["metrics"]))  # replay acted
