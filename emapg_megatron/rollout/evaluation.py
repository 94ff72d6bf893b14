"""Held-out evaluation during training (--eval-interval): Pass@k of the policy on held-out rows,
sampled as the rollouts are (:func:`~emapg_megatron.rollout.collect.sample_rows`)."""

from __future__ import annotations

from megatron.core import parallel_state as ps

from emapg_megatron.rollout.collect import SamplingSettings, sample_rows
from emapg_megatron.tasks.passk import default_ks, pass_at_k
from emapg_megatron.training.collectives import reduce_sum

EVAL_RNG_OFFSET = 10**9  # evaluation samples are keyed apart from every training step's


class HeldOutEvaluation:
    """Pass@k (k = 1, 2, 4, ..., n) on held-out ``rows``: ``n`` samples each at the run's sampling
    settings, the rows split over DP ranks; the same numbers on every rank."""

    def __init__(self, engine, task, tokenizer, rows: list, n: int, sampling: SamplingSettings):
        self.engine, self.task, self.tokenizer = engine, task, tokenizer
        self.rows, self.n, self.sampling = rows, n, sampling

    def __call__(self, step: int) -> dict:
        dp, dp_rank, group = (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
                              ps.get_data_parallel_group())
        positions = list(range(dp_rank, len(self.rows), dp))
        mine = [self.rows[i] for i in positions]
        n = self.n
        rollout = sample_rows(self.engine, self.task, self.tokenizer, mine, positions, n,
                              EVAL_RNG_OFFSET + step, self.sampling)
        correct = self.task.correct_many(rollout.responses, rollout.rows)
        counts = [sum(correct[i * n:(i + 1) * n]) for i in range(len(mine))]
        sums = {f"eval/pass@{k}": sum(pass_at_k(n, c, k) for c in counts) for k in default_ks(n)}
        sums = reduce_sum({**sums, "prompts": float(len(mine))}, group=group)
        return {k: v / sums["prompts"] for k, v in sums.items() if k != "prompts"}
