"""Per-token PPO-clip policy loss with clip-higher, the KL penalty and the entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from emapg_megatron.algo.rollout_correction import check_rollout_is, rollout_is_weights
from emapg_megatron.runtime import ConfigError

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class LossConfig:
    """The per-token policy loss: PPO-clip + beta * KL - entropy bonus, and its aggregation."""

    clip_eps_low: float = 0.2
    """PPO clip epsilon below 1."""
    clip_eps_high: float = 0.28
    """PPO clip epsilon above 1 (clip-higher)."""
    kl_coef: float = 0.001
    """beta: weight of the token-level KL against the anchor."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    rollout_is: str = "none"
    """Rollout-trainer mismatch correction of the PPO term: none | tis | mis (rollout_correction)."""
    rollout_is_threshold: float = 2.0
    """Upper bound C of the ratio pi_old/pi_sampling: truncation point (tis), mask above (mis)."""
    rollout_is_threshold_lower: float | None = None
    """mis only: mask below this ratio (default 1/C)."""

    def validate(self) -> None:
        """The flags of the loss, checked once (raises ConfigError with one line)."""
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ConfigError("PPO clip epsilons must be >= 0")
        if self.kl_coef < 0:
            raise ConfigError("--kl-coef must be >= 0")
        check_rollout_is(self.rollout_is, self.rollout_is_threshold, self.rollout_is_threshold_lower)


def ppo_clip(logprob, old_logprob, advantages, eps_low: float, eps_high: float):
    """Returns (per-token loss, clipped indicator). ``advantages`` broadcast per sequence."""
    ratio = torch.exp(logprob - old_logprob)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def per_sequence_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Token weights whose sum over a batch, divided by its normaliser, is the aggregate.

    ``token-mean``: 1 per token (normaliser: token count); ``seq-mean-token-mean``:
    1/len per token (normaliser: sequence count); ``seq-mean-token-sum``: 1 per token
    (normaliser: sequence count).
    """
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)
    if mode in ("token-mean", "seq-mean-token-sum"):
        return mask
    raise ValueError(f"unknown --loss-agg-mode {mode!r}; choose from {AGG_MODES}")


def normaliser(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This batch's contribution to the global normaliser of :func:`per_sequence_weights`."""
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(dim=-1) > 0).float().sum()


def policy_loss_terms(logprob, old_logprob, advantages, kl, entropy, mask, cfg: LossConfig,
                      sampling_logprob=None):
    """Weighted sum of per-token losses over the batch and its metrics (not normalised).

    ``sampling_logprob`` (the rollout engine's) is needed only by ``cfg.rollout_is`` != none.
    """
    pg, clipped = ppo_clip(logprob, old_logprob, advantages.unsqueeze(-1),
                           cfg.clip_eps_low, cfg.clip_eps_high)
    corrected = torch.zeros_like(pg)
    if cfg.rollout_is != "none":
        is_w, corrected = rollout_is_weights(old_logprob, sampling_logprob, cfg.rollout_is,
                                             cfg.rollout_is_threshold, cfg.rollout_is_threshold_lower)
        pg = pg * is_w
    per_token = pg + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    w = per_sequence_weights(mask, cfg.agg_mode)
    total = (per_token * w).sum()
    with torch.no_grad():
        metrics = {
            "pg_loss": (pg * w).sum(),
            "kl": (kl * mask).sum(),
            "clip_frac": (clipped * mask).sum(),
            "rollout_is_corrected": (corrected * mask).sum(),
            "entropy": (entropy * mask).sum() if entropy is not None else torch.zeros(()),
            "tokens": mask.sum(),
        }
    return total, metrics
