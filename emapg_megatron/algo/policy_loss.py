"""Per-token PPO-clip policy loss with clip-higher, the KL penalty and the entropy bonus."""

from __future__ import annotations

import torch

from emapg_megatron.algo.config import AGG_MODES, LossConfig
from emapg_megatron.algo.rollout_correction import rollout_is_weights


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
