"""One EMA-PG / GRPO trainer step on Megatron-Core, as orchestration only.

    rollout -> rewards -> advantages -> old-policy pass -> anchor pass (EMA swapped in)
      -> Lambda epochs of mini-batch PPO-clip + beta * KL -> optimizer step -> EMA update

Each phase returns what it produced (the collector's :class:`~emapg_megatron.rollout.collect.Rollout`,
the batch with the passes' outputs, the update's sums) and the step's metrics are computed from
those records (``step.metrics``). What a checkpoint keeps is the :class:`~emapg_megatron.step.state.TrainState`.
Between passes a token carries O(k) state (top-k ids, anchor log-probs at them, three scalars);
full logits exist only inside one micro-batch's forward pass on the last stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config

from emapg_megatron import runtime
from emapg_megatron.algo.advantages import compute_advantages
from emapg_megatron.algo.config import StepConfig
from emapg_megatron.algo.policy_loss import normaliser
from emapg_megatron.kl import sequence_kl_penalized_reward
from emapg_megatron.models.routing_replay import ROLLOUT_ROUTES
from emapg_megatron.rollout.engine import logprob_mismatch
from emapg_megatron.rollout.route_recording import pad_routes
from emapg_megatron.step.metrics import LOSS_KEYS, StepRecord, step_metrics
from emapg_megatron.step.passes import PolicyPasses
from emapg_megatron.step.state import TrainState
from emapg_megatron.training import packing, sequence_balance
from emapg_megatron.training.collectives import gather_at, gather_cat, reduce_sum
from emapg_megatron.training.microbatches import microbatching
from emapg_megatron.training.model_and_optimizer import zero_grads
from emapg_megatron.training.optimizer_step import check_weights, step_if_finite
from emapg_megatron.training.schedule import forward_backward, forward_only


def shifted(per_token: torch.Tensor) -> torch.Tensor:
    """Align a per-token tensor with next-token prediction: position p predicts p+1."""
    out = torch.zeros_like(per_token)
    out[:, :-1] = per_token[:, 1:]
    return out


def training_batch(rollout, width_multiple: int = 1) -> dict:
    """The rollout as the passes read it: label-aligned, on the device, its width padded to a
    multiple of ``width_multiple`` (sequence parallelism splits it over TP). The sampler's routes,
    when it recorded them, as ``ROLLOUT_ROUTES`` (input-aligned, like the tokens: not shifted)."""
    device = runtime.device()
    pad = -rollout.tokens.shape[1] % width_multiple

    def lay(t):
        return torch.nn.functional.pad(t, (0, pad)).to(device)

    batch = {
        "tokens": lay(rollout.tokens),
        "labels": lay(shifted(rollout.tokens)),
        "mask": lay(shifted(rollout.loss_mask)),
        "sampling_logprob": lay(shifted(rollout.sampling_logprobs)),
    }
    if getattr(rollout, "routes", None) is not None:
        batch[ROLLOUT_ROUTES] = pad_routes(rollout.routes, pad).to(device)
    return batch


@dataclass
class StepResult:
    """What a step gives the loop: its metrics (alike on every rank) and this rank's
    ``(prompt, response, reward)`` of each sequence (for rollout dumps)."""

    metrics: dict
    samples: list


class Trainer:
    def __init__(self, *, state: TrainState, collector, engine, task, passes: PolicyPasses,
                 step_cfg: StepConfig, monitor=None, monitor_sequences: int = 2, batching=None,
                 routing=None):
        self.state = state
        self.collector = collector  # fresh or partial rollouts: the trainer never asks which
        self.engine = engine  # the rollout engine: synced after each update
        self.task = task
        self.passes = passes
        self.cfg = step_cfg
        # padded or packed micro-batches (training.microbatches); the trainer never asks which
        self.batching = batching or microbatching(step_cfg)
        self.monitor = monitor
        self.monitor_sequences = monitor_sequences
        self.routing = routing  # a MoE policy's step.moe.MoERouting, else None

    @property
    def model_chunks(self) -> list:
        return self.state.model_chunks

    @staticmethod
    def _dp():
        return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()

    # --- the step ----------------------------------------------------------------------
    def step(self, iteration: int) -> StepResult:
        started = time.monotonic()
        rollout = self.collector.collect(iteration)
        sampled = time.monotonic()
        rewards = torch.tensor(self.task.rewards(rollout.responses, rollout.rows), dtype=torch.float32,
                               device=runtime.device())
        all_rewards = gather_cat(rewards, self._dp()[2])  # rank-major: sequence seq_pos at seq_pos
        batch, imbalance = self.sequences(rollout.batch, rewards)
        batch = self.routing.before_passes(batch) if self.routing else batch
        batch, padding = self.no_grad_passes(batch)
        batch, expert_load = self.routing.after_passes(batch) if self.routing else (batch, {})
        batch["advantages"] = self.advantages(batch, all_rewards)
        passed = time.monotonic()
        mismatch = self.rollout_mismatch(batch)
        update = self.update(batch)
        if update["updates_applied"]:
            check_weights(self.model_chunks, f"after step {iteration}")  # before the EMA and any save
        self.state.anchor.step(iteration)
        stability = self.stability(iteration, batch)
        self.engine.update_weights(self.model_chunks)
        record = StepRecord(rollout, all_rewards, update, padding, imbalance, started, sampled, passed)
        metrics = step_metrics(record, n=self.cfg.num_samples, task_reward=self.cfg.task_reward,
                               anchor_metrics=self.state.anchor.metrics(),
                               lr=self.state.optimizer.param_groups[0]["lr"])
        return StepResult({**metrics, **update["router"], **expert_load, **mismatch, **stability,
                           **rollout.decode, **self.engine.metrics()},
                          rollout.samples(rewards.tolist()))

    def shaped_rewards(self, rewards: torch.Tensor, batch: dict) -> torch.Tensor:
        """R - coef * sequence KL(pi_old || pi_ema) (the WARP baseline), where the passes ran."""
        coef = self.cfg.kl_in_reward_coef
        if not coef or "ref_logprob" not in batch:  # off, or not the last pipeline stage
            return rewards
        return sequence_kl_penalized_reward(rewards, batch["old_logprob"], batch["ref_logprob"],
                                            batch["mask"], coef).float()

    def advantages(self, batch: dict, all_rewards: torch.Tensor) -> torch.Tensor:
        """GRPO advantages over the global batch (``all_rewards``, rank-major), at this rank's
        sequences (``seq_pos``); shaped rewards are gathered from where the passes ran.

        Only the last pipeline stage uses them.
        """
        if not self.cfg.task_reward:  # pure distillation: the KL terms alone drive the update
            batch = {**batch, "reward": torch.zeros_like(batch["reward"])}
            all_rewards = torch.zeros_like(all_rewards)
        shaped = self.shaped_rewards(batch["reward"], batch)
        if shaped is not batch["reward"]:
            all_rewards = gather_at(shaped, batch["seq_pos"], all_rewards.numel(), self._dp()[2])
        adv = compute_advantages(all_rewards, self.cfg.num_samples, self.cfg.advantage_norm,
                                 self.cfg.advantage_eps)
        return adv[batch["seq_pos"]]

    def sequences(self, rollout_batch, rewards: torch.Tensor) -> tuple[dict, float]:
        """This rank's training batch: the rollout label-aligned, each sequence's reward and its
        place in the rank-major global batch (``seq_pos``); and the DP token imbalance. With
        --sequence-packing over DP ranks, sequences move between ranks so each mini-batch's tokens
        are balanced (``training/sequence_balance``)."""
        dp, dp_rank, group = self._dp()
        multiple = self._width_multiple()
        batch = training_batch(rollout_batch, multiple)
        S = batch["tokens"].shape[0]
        batch["reward"] = rewards.to(runtime.device())
        batch["seq_pos"] = torch.arange(dp_rank * S, (dp_rank + 1) * S, device=runtime.device())
        if dp == 1:
            return batch, 1.0
        lengths = packing.sequence_lengths(batch["mask"])
        per_rank = gather_cat(torch.tensor(lengths), group).view(dp, S).tolist()
        local_mini = self.cfg.mini_batch_size // dp
        groups = [list(range(m, min(m + local_mini, S))) for m in range(0, S, local_mini)]
        dest = [[r] * S for r in range(dp)]
        if self.cfg.sequence_packing:
            dest = sequence_balance.assign(per_rank, groups)
            batch = sequence_balance.exchange(batch, per_rank, dest, rank=dp_rank, group=group,
                                              width_multiple=multiple)
        return batch, sequence_balance.imbalance(per_rank, dest, groups)

    def _width_multiple(self) -> int:
        """What a batch's width is a multiple of: TP under sequence parallelism (it splits the
        width over TP ranks), times 8 under FP8 (its GEMMs need token counts per rank that are
        multiples of 8; rollouts are trimmed to a multiple of 8 only, and a batch re-laid after
        the DP exchange is trimmed to its own longest sequence)."""
        cfg = get_model_config(self.model_chunks[0])
        tp = ps.get_tensor_model_parallel_world_size() if cfg.sequence_parallel else 1
        return 8 * tp if cfg.fp8 else tp

    def no_grad_passes(self, batch: dict) -> tuple[dict, float]:
        """The old-policy pass, then the anchor pass (the EMA swapped in, or the teacher): per-token
        outputs merged into ``batch``; and the share of padding the passes computed. One
        micro-batch plan serves both: the lengths do not change."""
        plan = self.batching.plan(batch)  # packing: a collective over DP

        def run(pass_fn, batch, chunks, **routes):
            mbs = plan.split(batch)
            return plan.merge(forward_only(chunks, mbs, pass_fn, fused_lmhead=self.passes.head.fused,
                                           **routes), mbs)

        # a MoE policy's old pass records each token's experts (R2, expert load) or replays the
        # sampler's (R3)
        routes = self.routing.old_pass() if self.routing else {}
        batch = {**batch, **run(self.passes.old, batch, self.model_chunks, **routes)}
        with self.state.anchor.model() as anchor_chunks:  # the EMA swapped in, or the teacher
            batch = {**batch, **run(self.passes.anchor, batch, anchor_chunks)}  # with the old pass's top-k ids
        return batch, plan.padding_fraction

    def train_minibatch(self, batch: dict) -> dict:
        """One optimizer step over ``batch`` (this rank's share of a mini-batch)."""
        dp, _, dp_group = self._dp()
        mbs = self.batching.plan(batch).split(batch)
        agg = self.passes.loss.agg_mode
        norm = reduce_sum({"n": normaliser(batch["mask"], agg)}, group=dp_group)["n"]
        scale = len(mbs) * dp / max(norm, 1.0)  # undo Megatron's 1/num_mb and DDP's 1/dp

        def loss(head_input, mb):
            total, metrics = self.passes.loss_terms(head_input, mb)
            return total * scale, metrics

        optimizer = self.state.optimizer
        zero_grads(self.model_chunks, optimizer)
        # grads finalized by Megatron's hook
        outs = forward_backward(self.model_chunks, mbs, loss, fused_lmhead=self.passes.head.fused)
        sums = {k: sum(float(o[k]) for o in outs) for k in LOSS_KEYS} if outs else dict.fromkeys(LOSS_KEYS, 0.0)
        applied, grad_norm = step_if_finite(self.model_chunks, optimizer, self.state.scheduler, sums.values())
        return {**sums, "applied": float(applied), "grad_norm": grad_norm, "norm": norm,
                "microbatches": len(mbs)}

    def update(self, batch: dict) -> dict:
        """Lambda epochs over the PPO mini-batches; this rank's share of mini-batch m is every
        sequence it holds that the rank-major global batch places in m (``seq_pos``)."""
        dp, _, _ = self._dp()
        n_local = self.cfg.rollout_size // dp
        local_mini = self.cfg.mini_batch_size // dp
        which = (batch["seq_pos"] % n_local) // local_mini
        totals = dict.fromkeys(LOSS_KEYS, 0.0)
        applied = refused = forwards = 0
        grad_norms = []
        for _ in range(self.cfg.ppo_epochs):
            for m in range(-(-n_local // local_mini)):
                rows = torch.nonzero(which == m).flatten()
                mini = {k: (v[rows] if v is not None else None) for k, v in batch.items()}
                out = self.train_minibatch(mini)
                applied += int(out["applied"])
                refused += int(not out["applied"])
                forwards += out["microbatches"]
                if out["grad_norm"] is not None:
                    grad_norms.append(out["grad_norm"])
                for k in LOSS_KEYS:
                    totals[k] += out[k]
        self.state.skipped_steps += int(refused > 0)
        # "skipped": no update applied, so the step changed nothing; a step with some refused
        # updates shows them in "updates_refused" (its applied updates are health-checked).
        return {**totals, "skipped": float(applied == 0), "updates_applied": applied,
                "updates_refused": refused,
                # a MoE policy's router losses of this step's training forwards
                "router": self.routing.router_losses(forwards) if self.routing else {},
                "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None}

    def stability(self, iteration: int, batch: dict) -> dict:
        """Paper eq. 28: margin 1 + eta - lr * beta * tr(F) from per-sequence gradient norms."""
        if self.monitor is None or not self.monitor.due(iteration):
            return {}
        keys = ("tokens", "labels", "mask")
        seqs = [{k: batch[k][i:i + 1] for k in keys}
                for i in range(min(self.monitor_sequences, batch["tokens"].shape[0]))]

        def logprob_fn(seq):
            forward_backward(self.model_chunks, [seq], self.passes.sequence_logprob,
                             fused_lmhead=self.passes.head.fused)

        est = self.monitor.estimate(self.model_chunks, seqs, logprob_fn,
                                    lr=self.state.optimizer.param_groups[0]["lr"],
                                    beta=self.passes.loss.kl_coef)
        return est.as_log()

    def rollout_mismatch(self, batch: dict) -> dict:
        """Rollout engine log-probs vs the trainer's recomputed old log-probs (last stage, all DP)."""
        values = {"rollout_logprob_diff": 0.0, "rollout_iw_max": 0.0}
        if ps.is_pipeline_last_stage():
            m = logprob_mismatch(batch["sampling_logprob"], batch["old_logprob"], batch["mask"],
                                 group=ps.get_data_parallel_group())
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:  # one rank reports
                values = {"rollout_logprob_diff": m["logprob_abs_diff_mean"],
                          "rollout_iw_max": m["importance_ratio_max"]}
        return reduce_sum(values)  # to every rank, including the logging rank
