"""GPU unit checks, in one spawned CUDA rank (nccl): the Megatron optimizer build, the built-in
sampler and the fused vocab-parallel Top-k KL op against the single-device library."""

import math

import pytest
import torch

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def units():
    from gpu_workers import units_job

    (out,) = run_distributed(units_job, 1, device="cuda", timeout=600)
    return out


def part(units, name):
    res = units[name]
    assert "error" not in res, f"{name} raised on the GPU:\n{res.get('error')}"
    return res


@pytest.mark.parametrize("kind", ["plain", "distributed"])
def test_megatron_optimizer_builds_and_trains_under_nccl(units, kind):
    res = part(units, f"optimizer/{kind}")
    assert res["backend"] == "nccl"
    expected = "DistributedOptimizer" if kind == "distributed" else "Float16OptimizerWithFloat16Params"
    assert expected in res["optimizers"], res["optimizers"]
    assert all(d.startswith("cuda") for d in res["param_devices"] + res["main_devices"]), \
        (res["param_devices"], res["main_devices"])
    assert res["param_dtypes"] == res["param_dtypes_after"] == ["torch.bfloat16"]
    assert res["main_dtypes"] == ["torch.float32"]  # fp32 main params behind the bf16 weights
    assert all(res["step_ok"]), res["step_ok"]
    assert all(math.isfinite(n) and n > 0 for n in res["grad_norms"]), res["grad_norms"]
    # Six Adam steps (lr 1e-3) on one fixed batch: the loss must fall clearly (random init: ~ln 1000).
    losses = res["losses"]
    assert abs(losses[0] - math.log(1000)) < 1.0, losses
    assert losses[-1] < losses[0] - 0.05, losses
    moved = [n for n, w in res["weights_after"].items() if not torch.equal(w, res["weights_before"][n])]
    assert len(moved) == len(res["weights_after"]), "some parameters never changed"


def test_plain_and_distributed_optimizer_agree(units):
    plain, dist = part(units, "optimizer/plain"), part(units, "optimizer/distributed")
    for name, w in plain["weights_before"].items():  # same seed: same initial weights
        assert torch.equal(w, dist["weights_before"][name]), name
    assert plain["losses"][0] == pytest.approx(dist["losses"][0], abs=1e-3)
    # Same Adam on the same gradients (DP=1: the distributed optimizer's shard is everything).
    # Nondeterministic GPU reductions may flip a bf16 rounding, so compare in norm, not bits.
    num = sum((w - dist["weights_after"][n]).norm() ** 2 for n, w in plain["weights_after"].items())
    den = sum(w.norm() ** 2 for w in plain["weights_after"].values())
    assert (num / den).sqrt() < 1e-2
    assert plain["losses"][-1] == pytest.approx(dist["losses"][-1], rel=1e-2)


def test_builtin_sampler_on_cuda(units):
    res = part(units, "sampler")
    assert all(d.startswith("cuda") for d in res["param_devices"]), res["param_devices"]
    assert res["response_lengths"] == [16]  # no eos id: every response runs to max_new_tokens
    assert res["max_token"] < 1000  # never a padding id of the 1024-wide logits
    assert res["same_seed_same_tokens"] and res["same_seed_logprob_diff"] <= 1e-5
    assert res["other_step_differs"]
    assert res["n_sampled"] == 16 * 16 and res["distinct_sampled"] > 20
    # The log-prob recorded while sampling (position by position, padded batch) is the policy's
    # log-prob of that token in one teacher-forced pass: equal up to bf16 rounding.
    diff = res["sampled_logprob_diff"]
    assert diff.mean() < 1e-2 and diff.max() < 5e-2, (diff.mean(), diff.max())
    assert res["sampled_logprob_mean"] < -1.0  # real log-probs of a 1000-token vocabulary
    # Top-p 0.5 renormalises over the nucleus, so its log-prob is >= the full one, strictly on average.
    nucleus = res["nucleus_minus_full"]
    assert nucleus.min() > -5e-2 and nucleus.mean() > 0.1, (nucleus.min(), nucleus.mean())
    # The cache's memory sizing on the real device: one wave by free memory, four of at most 5 rows
    # by --inference-max-requests, the same samples up to bf16 kernels picked by batch size.
    assert 0 < res["free_bytes"] <= res["total_bytes"], (res["free_bytes"], res["total_bytes"])
    # keys and values x 2 layers x 48 positions x 2 query groups x head_dim 32 x 2 bytes (bf16)
    assert res["bytes_per_row"] == 2 * 2 * 48 * 2 * 32 * 2
    assert res["auto_waves"] == 1 and res["max_requests_waves"] == 4 and res["max_rows_fed"] == 5
    assert res["waves_same_responses"] >= 12, res["waves_same_responses"]
    # Forwards of more than 8 tokens (the prefill) in row micro-batches: Megatron's path on CUDA.
    assert res["split_same_responses"] >= 12, res["split_same_responses"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_topk_kl_op_matches_single_device_library(units, dtype):
    res = part(units, f"topk_kl/{dtype}")
    assert res["device"].startswith("cuda")
    for case, row in res.items():
        if case == "device":
            continue
        assert row["grad_device"].startswith("cuda") and row["grad_dtype"] == f"torch.{dtype}", (case, row)
        assert row["padding_grad_max"] == 0.0, case  # padding: zero probability, zero gradient
        # Values come out in fp32 whatever the logits' dtype (the maths is fp32 per chunk).
        assert row["logprob_err"] <= 1e-4, (case, row)
        assert row["kl_err"] <= 1e-4 * max(1.0, row["kl_scale"]), (case, row)
        if "entropy_err" in row:
            assert row["entropy_err"] <= 1e-4, (case, row)
        assert row["grad_scale"] > 0.1, (case, row)
        if dtype == "float32":
            assert row["grad_err"] <= 1e-5 * max(1.0, row["grad_scale"]), (case, row)
        else:
            # The gradient is written in bf16: one rounding of each value, plus fp32 noise; the
            # in-place variant also keeps the probabilities in bf16 (picked columns partly cancel).
            floor = (2e-4 if "inplace" in case else 2e-5) * row["grad_scale"]
            assert row["grad_excess_over_rounding"] <= floor, (case, row)
