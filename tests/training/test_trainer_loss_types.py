"""Every --kl-loss-type that --help offers trains: two trainer steps each, at TP=2."""

import math

import pytest
from train_run_workers import train_each_loss_type

from emapg_megatron.arguments import build_parser
from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow

BASE = ["--preset", "tiny-cpu", "--rollout-batch-size", "4", "--num-samples-per-prompt", "4",
        "--micro-batch-size", "8", "--global-batch-size", "16", "--max-new-tokens", "4",
        "--ema-update-period", "1", "--ema-eta", "0.5", "--kl-coef", "0.1", "--kl-topk-tokens", "4"]


def offered_loss_types() -> list:
    (action,) = [a for a in build_parser()._actions if a.dest == "kl_loss_type"]
    return list(action.choices)


def test_every_offered_loss_type_trains_two_steps():
    names = offered_loss_types()
    assert len(names) == 14 and {"topk-alpha", "topk-pearson_chi2", "k3++"} <= set(names)
    outs = run_distributed(train_each_loss_type, 2, tp=2, args=(BASE, names, 2), timeout=900)
    for out in outs:
        assert list(out) == names
        for name, m in out.items():
            assert m["skipped"] == 0.0, name
            assert all(math.isfinite(m[k]) for k in ("kl", "pg_loss", "entropy")), (name, m)
            assert m["ema_lag"] > 0, name  # the update and the EMA step really ran
