"""--rollout-is through the trainer: the logged share of truncated / masked tokens is exact."""

import math

import pytest
from train_run_workers import train_with_skewed_engine

from emapg_megatron.multiprocess import run_distributed

BASE = ["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", "--rollout-batch-size", "4",
        "--num-samples-per-prompt", "4", "--micro-batch-size", "8", "--global-batch-size", "16",
        "--max-new-tokens", "4"]


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_rollout_is_logs_the_share_it_corrected(mode):
    (out,) = run_distributed(train_with_skewed_engine, 1, args=([*BASE, "--rollout-is", mode],))
    m, expected = out["metrics"], out["expected"]
    want = 0.0 if mode == "none" else expected[mode]
    assert math.isclose(m["rollout_is_corrected_frac"], want, rel_tol=1e-6), (m, expected)
    assert m["rollout_iw_max"] > 2.9  # the skew is what the mismatch metric sees too
    assert m["skipped"] == 0.0 and math.isfinite(m["pg_loss"])
