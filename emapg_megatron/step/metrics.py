"""A trainer step's metrics, from the records its phases returned (nothing read off the trainer).

Token sums are reduced once over every rank (``training.collectives.reduce_sum``); only the
ranks that computed a term contribute it: the loss terms and the sampled tokens on the last
pipeline stage's first TP rank, the environments' counts on the model-parallel group's first rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from emapg_megatron.training.collectives import reduce_sum

#: The per-micro-batch sums the loss passes return (``algo.policy_loss.policy_loss_terms``).
LOSS_KEYS = ("pg_loss", "kl", "clip_frac", "entropy", "rollout_is_corrected", "tokens")


@dataclass
class StepRecord:
    """What one step's phases produced, as the metrics read it."""

    rollout: object
    """The step's :class:`~emapg_megatron.rollout.collect.Rollout` on this rank."""
    rewards: torch.Tensor
    """Every sequence's reward, all data-parallel ranks (rank-major)."""
    update: dict
    """The update's sums over its mini-batches (:data:`LOSS_KEYS`), ``skipped`` and ``updates_refused``."""
    padding_frac: float
    """Share of the token slots the passes computed that were padding (this rank's batch)."""
    dp_token_imbalance: float
    """Per mini-batch, the busiest DP rank's tokens over the mean; the worst (1: balanced)."""
    started: float
    sampled: float
    passed: float
    """``time.monotonic()`` at the step's start, after its rollout and after its passes."""


def step_metrics(rec: StepRecord, *, n: int, task_reward: bool, anchor_metrics: dict, lr: float) -> dict:
    """The step's log line and metrics.jsonl record (the same on every rank)."""
    contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    rollout, rewards = rec.rollout, rec.rewards
    local = {k: (rec.update[k] if contributes else 0.0) for k in LOSS_KEYS}
    local["gen_tokens"] = float(rollout.batch.loss_mask.sum()) if contributes else 0.0
    local["sampled_tokens"] = float(rollout.sampled_tokens) if contributes else 0.0
    # the environments stepped on the model-parallel group's first rank (episodes.answer)
    stepped = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage()
    local.update({k: (v if stepped else 0.0) for k, v in rollout.counts.items()})
    g = reduce_sum(local)
    tokens = max(g["tokens"], 1.0)
    elapsed = time.monotonic() - rec.started
    return {
        # in fp64: exact for float32 rewards, so independent of the DP gather order
        "reward_mean": float(rewards.double().mean()),
        "reward_std": float(rewards.double().std()),
        **_zero_std_group_frac(rewards, n, task_reward),
        "kl": g["kl"] / tokens,
        "entropy": g["entropy"] / tokens,
        "clip_frac": g["clip_frac"] / tokens,
        # share of response tokens truncated (tis) or masked (mis); 0 without --rollout-is
        "rollout_is_corrected_frac": g["rollout_is_corrected"] / tokens,
        "pg_loss": g["pg_loss"] / tokens,
        **anchor_metrics,  # ema_lag, or the teacher pass's seconds
        "response_len": g["gen_tokens"] / rewards.numel(),
        "tokens_per_s": g["gen_tokens"] / elapsed,
        "rollout_time_s": rec.sampled - rec.started,
        **_rollout_rate(g["sampled_tokens"], rec.sampled - rec.started),
        "step_time_s": elapsed,
        "update_time_s": time.monotonic() - rec.passed,
        "lr": lr,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,  # 0 in CPU mode
        "padding_frac": rec.padding_frac,
        "dp_token_imbalance": rec.dp_token_imbalance,
        "skipped": rec.update["skipped"],
        "updates_refused": rec.update["updates_refused"],
        # the mean over the step's applied updates of the gradient norm before clipping (Megatron's)
        **({"grad_norm": rec.update["grad_norm"]} if rec.update.get("grad_norm") is not None else {}),
        **_episode_metrics(g, rollout.counts, rewards.numel()),
        **rollout.metrics,
    }


def _rollout_rate(sampled: float, seconds: float) -> dict:
    """Tokens sampled per second of rollout; none for a step that sampled nothing (partial
    rollouts: enough complete groups were waiting): it has no rate."""
    return {"rollout_tokens_per_s": sampled / max(seconds, 1e-9)} if sampled else {}


def _zero_std_group_frac(rewards: torch.Tensor, n: int, task_reward: bool) -> dict:
    """Groups whose samples all got one reward: no advantage, so no policy gradient from them
    (nothing to say without the task's reward in the advantages)."""
    if not task_reward:
        return {}
    same = rewards.view(-1, n).std(dim=1) == 0
    return {"zero_std_group_frac": float(same.double().mean())}


def _episode_metrics(sums: dict, counts: dict, episodes: int) -> dict:
    """Multi-turn tasks: the environments' counts per episode, and the share of valid turns."""
    if not counts:
        return {}
    out = {k: sums[k] / episodes for k in counts}
    if "search/turns" in out:
        out["search/valid_action_rate"] = 1.0 - out.pop("search/invalid_turns") / max(out["search/turns"], 1e-9)
    return out
