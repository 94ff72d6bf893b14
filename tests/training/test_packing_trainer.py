"""--sequence-packing through the trainer: three steps follow the padded run from the same weights
(rel <= 1e-4) at PP=2 (one row length for the pipeline) and PP=2 x DP=2 (sequences moved
between the DP ranks to even their tokens, on every pipeline stage alike; equal micro-batch
counts)."""

import pytest
from train_run_workers import train_steps
from trainer_launch import COMPARED

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow

BASE = ["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", "--rollout-batch-size", "4",
        "--num-samples-per-prompt", "4", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--ema-update-period", "1", "--ema-eta", "0.5", "--max-new-tokens", "6", "--seq-length", "32",
        "--lr", "0.002", "--kl-coef", "0.05"]
LAYOUTS = {"pp2": (2, 1, 2, []), "pp2_dp2": (4, 1, 2, ["--use-distributed-optimizer"])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_trainer_follows_the_padded_one(layout):
    world, tp, pp, flags = LAYOUTS[layout]
    argv = [*BASE, "--pipeline-model-parallel-size", str(pp), *flags]
    padded = run_distributed(train_steps, world, tp=tp, pp=pp, args=(argv, 3), timeout=600)
    packed = run_distributed(train_steps, world, tp=tp, pp=pp, timeout=600,
                             args=([*argv, "--sequence-packing", "--max-tokens-per-microbatch", "24"], 3))
    for p, q in zip(padded, packed):
        for step, (m, r) in enumerate(zip(q["metrics"], p["metrics"]), start=1):
            assert m["reward_mean"] == r["reward_mean"], step
            for k in COMPARED:
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, step)
        # the padded run is already trimmed to each batch's longest sequence (rounded up to 8)
        assert all(m["padding_frac"] < r["padding_frac"] for m, r in zip(q["metrics"], p["metrics"]))
    assert padded[0]["metrics"][-1]["ema_lag"] > 0
    if layout == "pp2_dp2":  # sequences moved between the DP ranks, and the results did not change
        pairs = [(q["dp_token_imbalance"], p["dp_token_imbalance"])
                 for q, p in zip(packed[0]["metrics"], padded[0]["metrics"])]
        assert all(q <= p for q, p in pairs) and any(q < p for q, p in pairs), pairs
