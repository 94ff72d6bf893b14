"""EMA anchor: configuration errors, checkpoint block decomposition, stability regimes (no processes)."""

import logging
import math

import pytest

from emapg_megatron.anchor import EmaConfig
from emapg_megatron.anchor.checkpoint import flat_range_blocks
from emapg_megatron.anchor.stability import assess
from emapg_megatron.errors import ConfigError


@pytest.mark.parametrize("kwargs, dist_opt, match", [
    (dict(eta=1.5), False, r"--ema-eta must be in \[0, 1\] \(got 1.5\)"),
    (dict(eta=-0.1), False, r"--ema-eta must be in \[0, 1\]"),
    (dict(update_period=0), False, r"--ema-update-period must be >= 1 \(got 0\)"),
    (dict(stability_interval=-1), False, r"--ema-stability-interval must be >= 0"),
    (dict(shard_over_dp=True), False, r"--ema-shard-over-dp needs --use-distributed-optimizer"),
])
def test_bad_config_is_a_one_line_config_error(kwargs, dist_opt, match):
    with pytest.raises(ConfigError, match=match) as info:
        EmaConfig(**kwargs).validate(use_distributed_optimizer=dist_opt)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("eta", [0.0, 0.9, 1.0])
def test_good_config_passes(eta):
    EmaConfig(eta=eta, update_period=1, shard_over_dp=True).validate(use_distributed_optimizer=True)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 2, 1, 3)])
def test_flat_range_blocks_tile_every_range_with_contiguous_boxes(shape):
    numel = math.prod(shape)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1):
            blocks = flat_range_blocks(shape, lo, hi)
            assert len(blocks) <= max(2 * len(shape) - 1, 1)
            pos = lo
            for offset, box in blocks:
                assert len(offset) == len(box) == len(shape)
                assert all(o + b <= s for o, b, s in zip(offset, box, shape))
                # Each box starts where the previous ended and is one contiguous run.
                assert sum(o * st for o, st in zip(offset, strides)) == pos
                inner_full = [b == s for b, s in zip(box, shape)]
                first_partial = next((i for i, b in enumerate(box) if b != 1), len(box))
                assert all(inner_full[first_partial + 1:])
                pos += math.prod(box)
            assert pos == hi


def test_stability_regimes_and_warning(caplog):
    # Lemma 4.2 with eta = 0.9: monotone up to 0.9, oscillatory below 1.9, unstable from 1.9.
    assert assess(9.0, 0.9, lr=0.1, beta=1.0).regime == "monotone"
    osc = assess(15.0, 0.9, lr=0.1, beta=1.0)
    assert osc.regime == "oscillatory" and osc.margin == pytest.approx(0.4)
    with caplog.at_level(logging.WARNING, logger="emapg_megatron.anchor.stability"):
        bad = assess(20.0, 0.9, lr=0.1, beta=1.0)
    assert bad.regime == "unstable" and bad.margin == pytest.approx(-0.1)
    assert "may be unstable" in caplog.text
