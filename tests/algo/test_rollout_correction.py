"""TIS and MIS on hand-made batches: exact weights, exact losses and gradients, the logged share."""

import math

import pytest
import torch

from emapg_megatron.algo.config import LossConfig
from emapg_megatron.algo.policy_loss import policy_loss_terms
from emapg_megatron.algo.rollout_correction import rollout_is_weights
from emapg_megatron.errors import ConfigError

# Ratios pi_old / pi_sampling of five tokens: far below, at the lower bound, 1, at and above C = 2.
RHO = torch.tensor([[0.25, 0.5, 1.0, 2.0, 3.0]], dtype=torch.float64)
OLD = torch.zeros(1, 5, dtype=torch.float64)
SAMPLING = -RHO.log()  # log pi_old - log pi_sampling = log rho


def test_tis_truncates_only_above_the_threshold():
    w, corrected = rollout_is_weights(OLD, SAMPLING, "tis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.5, 1.0, 2.0, 2.0]], dtype=torch.float64))
    assert corrected.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]  # rho == C is not truncated


def test_mis_keeps_the_ratio_inside_the_bounds_and_drops_the_rest():
    w, corrected = rollout_is_weights(OLD, SAMPLING, "mis", 2.0)  # lower bound 1/2
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]], dtype=torch.float64))
    assert corrected.tolist() == [[1.0, 0.0, 0.0, 0.0, 1.0]]
    w, corrected = rollout_is_weights(OLD, SAMPLING, "mis", 4.0, 0.3)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 3.0]], dtype=torch.float64))
    assert corrected.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_none_is_one_and_extreme_gaps_do_not_overflow():
    w, corrected = rollout_is_weights(OLD, SAMPLING, "none", 2.0)
    assert torch.equal(w, torch.ones_like(OLD)) and not corrected.any()
    old = torch.tensor([0.0, -200.0], dtype=torch.float32)
    sampling = torch.tensor([-200.0, 0.0], dtype=torch.float32)  # rho = e^200 and e^-200 (fp32 inf / 0)
    w, corrected = rollout_is_weights(old, sampling, "tis", 2.0)
    assert w.tolist() == [2.0, 0.0] and corrected.tolist() == [1.0, 0.0]
    w, corrected = rollout_is_weights(old, sampling, "mis", 2.0)
    assert w.tolist() == [0.0, 0.0] and corrected.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("mode, weights, n_corrected", [
    ("none", [1.0, 1.0, 1.0, 1.0, 1.0], 0),
    ("tis", [0.25, 0.5, 1.0, 2.0, 2.0], 1),
    ("mis", [0.0, 0.5, 1.0, 2.0, 0.0], 2),
])
def test_the_weight_multiplies_the_ppo_term_only(mode, weights, n_corrected):
    """loss = sum_t w_t * PPO_t + beta * KL_t; grad of the PPO part at ratio 1 is -w_t * A."""
    logprob = torch.zeros(1, 5, dtype=torch.float64, requires_grad=True)  # = old: PPO ratio 1
    kl = torch.full((1, 5), 0.1, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    cfg = LossConfig(kl_coef=0.5, rollout_is=mode, rollout_is_threshold=2.0)
    total, m = policy_loss_terms(logprob, OLD, torch.tensor([1.5], dtype=torch.float64), kl, None,
                                 mask, cfg, sampling_logprob=SAMPLING)
    w = torch.tensor([weights], dtype=torch.float64)
    assert math.isclose(total.item(), float((-1.5 * w).sum() + 0.5 * 0.1 * 5), rel_tol=1e-12)
    assert math.isclose(m["pg_loss"].item(), float((-1.5 * w).sum()), rel_tol=1e-12)
    assert m["rollout_is_corrected"].item() == n_corrected
    total.backward()
    torch.testing.assert_close(logprob.grad, -1.5 * w)  # d(ratio)/d(logprob) = 1 at ratio 1


def test_masked_tokens_are_not_counted():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    _, m = policy_loss_terms(OLD.clone(), OLD, torch.ones(1, dtype=torch.float64), torch.zeros(1, 5),
                             None, mask, LossConfig(rollout_is="mis"), sampling_logprob=SAMPLING)
    assert m["rollout_is_corrected"].item() == 1.0  # rho=3 sits on the masked position


@pytest.mark.parametrize("kwargs, message", [
    (dict(rollout_is="bogus"), "--rollout-is must be one of"),
    (dict(rollout_is="tis", rollout_is_threshold=0.9), "finite number > 1"),
    (dict(rollout_is="mis", rollout_is_threshold=float("inf")), "finite number > 1"),
    (dict(rollout_is="tis", rollout_is_threshold_lower=0.1), "mis only"),
    (dict(rollout_is="mis", rollout_is_threshold_lower=-0.1), "[0, 1)"),
])
def test_bad_settings_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        LossConfig(**kwargs).validate()
