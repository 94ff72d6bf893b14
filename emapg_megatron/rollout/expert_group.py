"""Sampling a mixture-of-experts policy at expert parallelism > 1 with the built-in sampler.

Every MoE layer exchanges tokens across the expert-parallel group (all-gather or all-to-all), so
each rank of the group must run the same forwards: as many, and (under the all-gather dispatcher)
of the same shapes. Data-parallel ranks sample different sequences, which finish at different
steps. :class:`ExpertGroupEngine` therefore has the group sample the union of its ranks'
sequences in one call, and each rank keeps its own rows. A sequence's samples are keyed by its
global index (``seq_index``) and the step, so they are what any layout samples.

The cost: each rank of the group decodes EP x its share of the batch, in one batch (on a GPU the
decode step is bound by reading the weights, so a larger batch costs far less than EP x). Megatron's
own inference engine instead keeps idle expert-parallel ranks stepping with dummy forwards.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from emapg_megatron.rollout.engine import RolloutBatch


def rows_of(batch: RolloutBatch, lo: int, hi: int) -> RolloutBatch:
    """Sequences ``lo..hi-1`` of ``batch`` (the union's width is kept; the decode stats are the
    union's: what this rank's forwards cost)."""
    return replace(batch, tokens=batch.tokens[lo:hi], loss_mask=batch.loss_mask[lo:hi],
                   sampling_logprobs=batch.sampling_logprobs[lo:hi],
                   prompt_lengths=batch.prompt_lengths[lo:hi], responses=batch.responses[lo:hi],
                   routes=None if batch.routes is None else batch.routes[lo:hi])


class ExpertGroupEngine:
    """The engine of this rank, sampling together with the other ranks of ``group``."""

    def __init__(self, engine, group):
        self.engine, self.group = engine, group

    def __getattr__(self, name):  # seq_length, pad_id, update_weights, metrics, idle_stats, ...
        return getattr(self.engine, name)

    def generate(self, prompts, n: int, temperature: float, top_p: float, max_new_tokens: int, *,
                 stop=None, rng_step: int = 0, seq_index=None) -> RolloutBatch:
        index = list(range(len(prompts) * n)) if seq_index is None else list(seq_index)
        shares = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(shares, ([list(p) for p in prompts], index), group=self.group)
        me = dist.get_rank(self.group)
        lo = sum(len(p) for p, _ in shares[:me]) * n
        batch = self.engine.generate([p for ps_, _ in shares for p in ps_], n, temperature, top_p,
                                     max_new_tokens, stop=stop, rng_step=rng_step,
                                     seq_index=[i for _, idx in shares for i in idx])
        return rows_of(batch, lo, lo + len(prompts) * n)

    def generate_episodes(self, *args, **kwargs):
        raise NotImplementedError("multi-turn episodes at expert parallelism > 1 (refused by the CLI)")

    def continue_sequences(self, *args, **kwargs):
        raise NotImplementedError("partial rollouts at expert parallelism > 1 (refused by the CLI)")
