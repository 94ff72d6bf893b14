"""Configs of the RL algorithm: one step (sampling, batching, advantages) and the policy loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

from emapg_megatron.configurable import (
    ANY_NUMBER,
    above,
    at_least,
    between,
    check_fields,
    option,
)
from emapg_megatron.errors import ConfigError

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ROLLOUT_IS_MODES = ("none", "tis", "mis")
ADVANTAGE_NORMS = ("group", "global", "none")


@dataclass
class StepConfig:
    """One RL step: how much is sampled, how it is split into batches, how advantages are formed."""

    rollout_batch_size: int = option(8, aliases=("--grpo-prompts-per-step",), range=at_least(1),
                                     trajectory=True)
    """Prompts per trainer step (B)."""
    num_samples: int = option(8, flag="--num-samples-per-prompt", aliases=("--grpo-group-size",),
                              range=at_least(1), trajectory=True)
    """Responses per prompt (N, the GRPO group)."""
    max_new_tokens: int = option(16, range=at_least(1), trajectory=True)
    """Response length limit (--task search: each model turn has --max-turn-tokens instead)."""
    seq_length: int = option(64, range=at_least(2))
    """Maximum prompt + response length in tokens."""
    temperature: float = option(1.0, range=above(0), trajectory=True)
    """Sampling temperature (> 0)."""
    top_p: float = option(1.0, range=between(0, 1, low_open=True), trajectory=True)
    """Nucleus sampling threshold in (0, 1]; the KL estimators' importance weights use the
    sampler's own (truncated) log-probs, so they stay consistent, but the samples no longer come
    from the policy (see docs/kl_estimators.md)."""
    micro_batch_size: int = option(8, range=at_least(1))
    """Sequences per forward/backward micro-batch."""
    global_batch_size: int | None = option(None, range=at_least(1))
    """Sequences per optimizer step (PPO mini-batch); default: the whole rollout batch."""
    ppo_epochs: int = option(1, aliases=("--grpo-iterations",), range=at_least(1))
    """Passes over the rollout batch (Lambda)."""
    sequence_packing: bool = option(False)
    """Pack whole sequences into token rows for the old, anchor and training passes, so no compute
    goes to padding: Transformer Engine attention gets PackedSeqParams (THD, cu_seqlens), the local
    spec a block-diagonal causal mask with per-sequence positions (chosen automatically); with
    DP > 1, sequences move between DP ranks within their PPO mini-batch so every rank computes
    about the same tokens (logged as dp_token_imbalance); every loss normalisation stays that of
    the padded batch."""
    max_tokens_per_microbatch: int | None = option(None, range=at_least(1))
    """--sequence-packing: token budget of one packed micro-batch (a longer sequence gets its own);
    micro-batch counts are equal on every DP rank and loads balanced. Default: --micro-batch-size
    x --seq-length."""
    fused_lm_head: bool = option(True, negatable=True)
    """Compute the old, anchor and loss passes' log-probs, top-k and entropy from the final hidden
    states and the output weight, chunk by chunk, never holding the logits (O(hidden + k) bytes per
    token for backward whatever the vocabulary); --no-fused-lm-head runs Megatron's output layer
    and the ops on its logits."""
    advantage_norm: str = option("group", choices=ADVANTAGE_NORMS)
    """group: (R-mean)/std per prompt; global: z-score over the batch; none: R-mean only."""
    advantage_eps: float = option(1e-6, range=at_least(0))
    """Epsilon added to the std."""
    kl_in_reward_coef: float = option(0.0, range=at_least(0))
    """Sequence-level KL subtracted from the reward (WARP baseline); 0 disables. With a teacher,
    the sampled-token log-ratio to it: the peers' sampled-token distillation signal."""
    task_reward: bool = option(True, negatable=True)
    """Form the advantages from the task's reward; --no-task-reward leaves them to the KL terms
    alone (pure on-policy distillation: needs a teacher). The reward is still computed and logged."""
    @property
    def rollout_size(self) -> int:
        """Sequences sampled per step: B x N."""
        return self.rollout_batch_size * self.num_samples

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step (PPO mini-batch), global over DP ranks."""
        return self.global_batch_size or self.rollout_size

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates of one trainer step: --ppo-epochs x the rollout's mini-batches."""
        return self.ppo_epochs * self.rollout_size // self.mini_batch_size

    def token_budget(self) -> int:
        """Tokens of one packed micro-batch: --max-tokens-per-microbatch, else micro_batch_size x
        seq_length."""
        return self.max_tokens_per_microbatch or self.micro_batch_size * self.seq_length

    def validate(self) -> None:
        """The flags of the step, checked once (raises ConfigError with one line)."""
        check_fields(self)
        if self.advantage_norm == "group" and self.num_samples < 2:
            raise ConfigError("--advantage-norm group needs --num-samples-per-prompt >= 2")
        if self.max_tokens_per_microbatch is not None and not self.sequence_packing:
            raise ConfigError("--max-tokens-per-microbatch is the budget of --sequence-packing")
        gbs, rollout = self.mini_batch_size, self.rollout_size
        if rollout % gbs:
            raise ConfigError(f"--global-batch-size {gbs} does not divide the rollout batch "
                              f"({self.rollout_batch_size} prompts x {self.num_samples} samples = {rollout})")


@dataclass
class LossConfig:
    """The per-token policy loss: PPO-clip + beta * KL - entropy bonus, and its aggregation."""

    clip_eps_low: float = option(0.2, aliases=("--grpo-clamp-eps-lower",), range=between(0, 1))
    """PPO clip epsilon below 1."""
    clip_eps_high: float = option(0.28, aliases=("--grpo-clamp-eps-upper",), range=at_least(0))
    """PPO clip epsilon above 1 (clip-higher)."""
    kl_coef: float = option(0.001, aliases=("--grpo-kl-beta",), range=at_least(0))
    """beta: weight of the token-level KL loss."""
    entropy_coef: float = option(0.0, aliases=("--grpo-entropy-term-weight",), range=ANY_NUMBER)
    """Entropy bonus coefficient."""
    agg_mode: str = option("token-mean", flag="--loss-agg-mode", choices=AGG_MODES)
    """How per-token losses are averaged over the batch."""
    rollout_is: str = option("none", choices=ROLLOUT_IS_MODES)
    """Correct the PPO term for the rollout engine's log-probs differing from the trainer's: tis
    truncates the per-token ratio pi_old/pi_sampling at the threshold; mis (IcePop) keeps the ratio
    inside [lower, threshold] and drops tokens outside; none takes the rollout as on-policy
    (docs/rollout_correction.md)."""
    rollout_is_threshold: float = option(2.0, range=above(1))
    """Upper bound of the ratio for --rollout-is tis/mis (> 1)."""
    rollout_is_threshold_lower: float | None = option(None, range=between(0, 1, high_open=True))
    """--rollout-is mis: lower bound of the ratio (default: 1/threshold)."""

    def validate(self) -> None:
        """The flags of the loss, checked once (raises ConfigError with one line)."""
        if not (self.rollout_is_threshold > 1.0 and math.isfinite(self.rollout_is_threshold)):
            raise ConfigError(f"--rollout-is-threshold must be a finite number > 1 "
                              f"(got {self.rollout_is_threshold})")
        if self.rollout_is_threshold_lower is not None and self.rollout_is != "mis":
            raise ConfigError("--rollout-is-threshold-lower is the lower bound of --rollout-is mis only")
        check_fields(self)
