"""The rollout-engine protocol and the batch it returns.

An engine turns token-id prompts into ``n`` sampled responses each, recording the
log-probability of every sampled token under the *sampling* distribution (after
temperature and top-p), which the KL estimators need for their importance weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

WIDTH_MULTIPLE = 8
"""Batch widths are a multiple of this (tensor-parallel sizes up to 8 divide it, as sequence
parallelism needs), and do not depend on the parallel layout."""


@dataclass
class RolloutBatch:
    """``S = len(prompts) * n`` sequences, right-padded to ``L``: the batch's longest sequence
    rounded up to :data:`WIDTH_MULTIPLE` (at most ``--seq-length``), never to ``--seq-length``
    itself, so short batches carry no padding up to the configured maximum.

    * ``tokens`` ``[S, L]``: prompt, then response, then padding.
    * ``loss_mask`` ``[S, L]``: 1 where the policy produced the token (0 on prompt,
      environment-observation and padding tokens).
    * ``sampling_logprobs`` ``[S, L]``: log pi_sampling of each produced token (0 elsewhere).
    * ``prompt_lengths`` ``[S]``; ``responses``: the produced token ids per sequence.
    * ``stats``: what producing it cost, when the engine says (the built-in sampler's
      :class:`~emapg_megatron.rollout.decoders.DecodeStats`: ``.metrics()``, ``.forwards()``).
    * ``routes`` ``[S, L, layers, k]``: the experts a MoE policy's sampler routed each token to
      (:mod:`.route_recording`), None when it recorded none.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    sampling_logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    responses: list[list[int]]
    stats: Any = None
    routes: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the trainer's rollout collection asks of an engine (the built-in Megatron sampler,
    vLLM). Sequences are prompt-major; ``seq_index`` gives each sequence's index in the global
    batch and ``rng_step`` the step: together they key its randomness, so a sample does not
    depend on the parallel layout."""

    seq_length: int
    pad_id: int

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, *, stop: Sequence[str] | None = None, rng_step: int = 0,
                 seq_index: Sequence[int] | None = None) -> RolloutBatch:
        """Sample ``n`` responses per prompt, each ending at eos, a stop string (kept) or
        ``max_new_tokens``."""

    def generate_episodes(self, prompts: Sequence[Sequence[int]], n: int, envs: Sequence[Any], *,
                          tokenizer, temperature: float, top_p: float, max_new_tokens: int,
                          stop: Sequence[str] | None = None, rng_step: int = 0,
                          seq_index: Sequence[int] | None = None) -> tuple[RolloutBatch, list]:
        """Multi-turn: one episode per environment (``n`` per prompt); the batch's loss mask is 0
        on observations. Returns the batch and the episodes."""

    def update_weights(self, model_chunks) -> Any:
        """Make the engine sample from the trainer's current weights."""

    def metrics(self) -> dict:
        """Per-step engine metrics for the log: the last weight sync's (``weight_sync_s``, ...)."""


class ContinuingEngine(RolloutEngine, Protocol):
    """An engine that can continue sequences across steps (partial rollouts)."""

    vocab_size: int
    """The ids it samples are 0 .. vocab_size - 1 (a pool read back from a checkpoint is checked)."""

    def continue_sequences(self, seqs: Sequence[Any], *, temperature: float, top_p: float,
                           max_new_tokens: int, stop: Sequence[str] | None = None, enough=None,
                           agree=None) -> Any:
        """Continue each sequence (its prompt, tokens, log-probs and the key of its uniforms) until
        ``enough(finished flags)``; ``.turns`` (unfinished: finish reason "") and ``.stats``."""

    def idle_stats(self) -> Any:
        """The ``.stats`` of a step that continued nothing (zero counts)."""


def build_rollout_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        logprobs: Sequence[Sequence[float]], seq_length: int, pad_id: int,
                        n: int) -> RolloutBatch:
    """Pack prompt-major (prompt i's n responses are rows i*n .. i*n+n-1) results."""
    S = len(responses)
    ends = [len(prompts[s // n]) + len(r) for s, r in enumerate(responses)]
    width = min(seq_length, -(-max(ends, default=1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
    tokens = torch.full((S, width), pad_id, dtype=torch.long)
    mask = torch.zeros((S, width))
    lps = torch.zeros((S, width))
    plens = torch.zeros(S, dtype=torch.long)
    for s, (resp, lp) in enumerate(zip(responses, logprobs)):
        prompt, end = prompts[s // n], ends[s]
        if end > seq_length:
            raise ValueError(f"sequence of {end} tokens exceeds --seq-length {seq_length}")
        tokens[s, :len(prompt)] = torch.as_tensor(prompt)
        tokens[s, len(prompt):end] = torch.as_tensor(resp, dtype=torch.long)
        mask[s, len(prompt):end] = 1.0
        lps[s, len(prompt):end] = torch.as_tensor(lp, dtype=torch.float32)
        plens[s] = len(prompt)
    return RolloutBatch(tokens, mask, lps, plens, [list(r) for r in responses])


def logprob_mismatch(sampling_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     mask: torch.Tensor, *, group=None) -> dict:
    """How far the rollout engine's log-probs are from the trainer's recomputed ones.

    All three tensors are aligned ``[S, L]`` (the trainer's label alignment). Over tokens with
    ``mask > 0``: the mean of ``|log pi_old - log pi_sampling|`` and the largest and smallest
    importance ratio ``pi_old / pi_sampling`` (the weight the KL tail applies at the first PPO
    epoch). With ``group`` the statistics are reduced over that process group. No tokens:
    mean 0, ratios 1.
    """
    sel = mask > 0
    diff = (old_logprobs.double() - sampling_logprobs.double())[sel]
    stats = torch.stack([
        diff.abs().sum(),
        torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device),
        diff.max() if diff.numel() else torch.tensor(-torch.inf, dtype=torch.float64, device=diff.device),
        -diff.min() if diff.numel() else torch.tensor(-torch.inf, dtype=torch.float64, device=diff.device),
    ])
    if group is not None:
        sums, extremes = stats[:2].clone(), stats[2:].clone()
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        stats = torch.cat([sums, extremes])
    abs_sum, count, max_log, neg_min_log = stats.tolist()
    if count == 0:
        return {"logprob_abs_diff_mean": 0.0, "importance_ratio_max": 1.0,
                "importance_ratio_min": 1.0, "logprob_tokens": 0}
    return {"logprob_abs_diff_mean": abs_sum / count,
            "importance_ratio_max": float(torch.tensor(max_log, dtype=torch.float64).exp()),
            "importance_ratio_min": float(torch.tensor(-neg_min_log, dtype=torch.float64).exp()),
            "logprob_tokens": int(count)}
