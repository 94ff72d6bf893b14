"""One EMA-PG / GRPO trainer step on Megatron-Core, as orchestration only.

    rollout -> rewards -> advantages -> old-policy pass -> anchor pass (EMA swapped in)
      -> Lambda epochs of mini-batch PPO-clip + beta * KL -> optimizer step -> EMA update

Between passes a token carries O(k) state (top-k ids, anchor log-probs at them, three
scalars); full logits exist only inside one micro-batch's forward pass on the last stage.
"""

from __future__ import annotations

import time

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config

from emapg_megatron import runtime
from emapg_megatron.algo.advantages import compute_advantages
from emapg_megatron.algo.config import LossConfig, StepConfig
from emapg_megatron.algo.policy_loss import normaliser, policy_loss_terms
from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.errors import ConfigError
from emapg_megatron.kl import sequence_kl_penalized_reward
from emapg_megatron.kl.config import KLConfig
from emapg_megatron.models.gpt import unwrap
from emapg_megatron.parallel import kl_from_policy_terms
from emapg_megatron.parallel.output_heads import LogitsHead
from emapg_megatron.rollout.engine import build_rollout_batch, logprob_mismatch
from emapg_megatron.rollout.partial import InFlight, lag_stats
from emapg_megatron.tasks.base import encode_text
from emapg_megatron.tasks.passk import default_ks, pass_at_k
from emapg_megatron.training import packing, sequence_balance
from emapg_megatron.training.collectives import (
    flags_and_any,
    gather_at,
    gather_cat,
    gather_lists,
    reduce_sum,
)
from emapg_megatron.training.microbatches import layout_of, microbatching
from emapg_megatron.training.model_and_optimizer import zero_grads
from emapg_megatron.training.optimizer_step import check_weights, step_if_finite
from emapg_megatron.training.schedule import forward_backward, forward_only

LOSS_KEYS = ("pg_loss", "kl", "clip_frac", "entropy", "rollout_is_corrected", "tokens")
EVAL_RNG_OFFSET = 10**9  # evaluation samples are keyed apart from every training step's


def shifted(per_token: torch.Tensor) -> torch.Tensor:
    """Align a per-token tensor with next-token prediction: position p predicts p+1."""
    out = torch.zeros_like(per_token)
    out[:, :-1] = per_token[:, 1:]
    return out


def training_batch(rollout, width_multiple: int = 1) -> dict:
    """The rollout as the passes read it: label-aligned, on the device, its width padded to a
    multiple of ``width_multiple`` (sequence parallelism splits it over TP)."""
    device = runtime.device()
    pad = -rollout.tokens.shape[1] % width_multiple

    def lay(t):
        return torch.nn.functional.pad(t, (0, pad)).to(device)

    return {
        "tokens": lay(rollout.tokens),
        "labels": lay(shifted(rollout.tokens)),
        "mask": lay(shifted(rollout.loss_mask)),
        "sampling_logprob": lay(shifted(rollout.sampling_logprobs)),
    }


class PolicyPasses:
    """The no-grad passes and the loss on the last pipeline stage's output, through ``head``
    (``parallel.output_heads``: the fused LM head on hidden states, or materialised logits)."""

    def __init__(self, kl: KLConfig, loss: LossConfig, vocab_size: int, head=None):
        self.kl = kl
        self.loss = loss
        self.head = head or LogitsHead(vocab_size)

    @staticmethod
    def _tp_group():
        return ps.get_tensor_model_parallel_group()

    def old(self, out, mb) -> dict:
        k = self.kl.k if self.kl.q_source == "old" else 0  # q from the (recomputed) sampling policy
        s = self.head.scores(out, mb["labels"], k, group=self._tp_group())
        return {"old_logprob": s.logprob, **({"topk_index": s.topk_ids} if k else {})}

    def anchor(self, out, mb) -> dict:
        group, labels = self._tp_group(), mb["labels"]
        if self.kl.q_source == "anchor":  # q from the anchor itself
            s = self.head.scores(out, labels, self.kl.k, group=group)
            return {"ref_logprob": s.logprob, "topk_index": s.topk_ids, "ref_logprob_topk": s.topk_logprob}
        if self.kl.uses_topk:  # the label and q in one pass over the vocabulary
            lp = self.head.scores(out, torch.cat([labels.unsqueeze(-1), mb["topk_index"]], -1), 0,
                                  group=group).logprob
            return {"ref_logprob": lp[..., 0], "ref_logprob_topk": lp[..., 1:]}
        return {"ref_logprob": self.head.scores(out, labels, 0, group=group).logprob}

    def sequence_logprob(self, out, mb):
        """Summed log-prob of the model's tokens (for the stability monitor's Fisher trace)."""
        terms = self.head.policy_terms(out, mb["labels"], None, group=self._tp_group(),
                                       with_entropy=False, loss_mask=mb["mask"])
        return (terms.logprob * mb["mask"]).sum(), {}

    def loss_terms(self, out, mb):
        """(weighted loss sum, metrics) for one micro-batch."""
        q = mb.get("topk_index") if self.kl.uses_topk else None
        terms = self.head.policy_terms(out, mb["labels"], q, group=self._tp_group(),
                                       with_entropy=True, loss_mask=mb["mask"])
        kl = kl_from_policy_terms(
            terms, mb["labels"], q, mb.get("ref_logprob_topk"), mb["ref_logprob"],
            kind=self.kl.loss_type, tail=self.kl.tail, alpha=self.kl.alpha,
            sampling_logprob=mb["sampling_logprob"], iw_clip=self.kl.iw_clip,
            reference_clamps=self.kl.reference_clamps, loss_mask=mb["mask"])
        # the per-sequence aggregation sees each sequence's tokens as the padded batch has them
        logprob, old, kl, entropy, mask, sampling = layout_of(mb).per_sequence(
            terms.logprob, mb["old_logprob"], kl * mb["mask"], terms.entropy, mb["mask"],
            mb["sampling_logprob"])
        return policy_loss_terms(logprob, old, mb["advantages"], kl, entropy, mask, self.loss,
                                 sampling_logprob=sampling)


class Trainer:
    def __init__(self, *, model_chunks, optimizer, scheduler, anchor, sampler, task, tokenizer,
                 passes: PolicyPasses, step_cfg: StepConfig, data, monitor=None,
                 monitor_sequences: int = 2, batching=None):
        self.model_chunks = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.anchor = anchor
        self.sampler = sampler
        self.task = task
        self.tokenizer = tokenizer
        self.passes = passes
        self.cfg = step_cfg
        # padded or packed micro-batches (training.microbatches); the trainer never asks which
        self.batching = batching or (microbatching(step_cfg) if step_cfg else None)
        self.data = data
        self.skipped_steps = 0
        self.monitor = monitor
        self.padding_fraction = 0.0  # of the rollout batch as the passes compute it, logged per step
        self.dp_token_imbalance = 1.0  # of the rollout batch over DP ranks, logged per step
        self.monitor_sequences = monitor_sequences
        self.prompt_texts: list[str] = []  # this DP rank's prompts of the last step
        self.samples: list[tuple[str, str, float]] = []  # its (prompt, response, reward) per sequence
        self.episode_counts: dict[str, float] = {}  # multi-turn: the environments' counts, summed
        # --partial-rollouts: the prompt groups in flight between steps, and the last step's counts
        self.in_flight = (InFlight(step_cfg.num_samples, step_cfg.rollout_batch_size,
                                   step_cfg.rollout_pool_size, step_cfg.max_staleness)
                          if step_cfg is not None and step_cfg.partial_rollouts else None)
        self.partial_stats: dict[str, float] = {}
        self.rollout_tokens = 0  # --partial-rollouts: tokens sampled by the last rollout

    # --- checkpoint state ----------------------------------------------------------------
    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model, optimizer and EMA anchor, sharded for Megatron's dist_checkpointing."""
        model_sd = unwrap(self.model_chunks[0]).sharded_state_dict()
        optim_sd = checkpointing.optimizer_sharded_state_dict(self.optimizer, model_sd, is_loading=is_loading)
        return {"model": model_sd, "optimizer": optim_sd, "ema": self.anchor.sharded_state_dict(model_sd)}

    def common_state_dict(self) -> dict:
        """The replicated state: LR schedule, the skipped-step count and, with --partial-rollouts,
        the groups in flight and the data position (the same on every rank)."""
        flight = {"in_flight": self.in_flight.state_dict()} if self.in_flight is not None else {}
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps, **flight}

    def prepare_to_load(self, path: str) -> None:
        """Check the checkpoint's EMA layout (one clear line) and create the optimizer state."""
        self.anchor.check_checkpoint(path)
        checkpointing.materialize_optimizer_state(self.model_chunks, self.optimizer)

    def load_state_dict(self, loaded: dict) -> None:
        """Take what ``checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        unwrap(self.model_chunks[0]).load_state_dict(loaded["model"])
        with torch.no_grad():  # fp32 DistOpt main params are views of the (grad-requiring) weights
            self.optimizer.load_state_dict(loaded["optimizer"])
        checkpointing.restore_adam_steps(self.optimizer, loaded["optimizer"])
        self.anchor.load_state_dict(loaded["ema"])
        self.scheduler.load_state_dict(loaded["common"]["scheduler"])
        self.skipped_steps = loaded["common"]["skipped_steps"]
        if self.in_flight is not None:
            self.load_in_flight(loaded["common"])

    def resumed_extra(self) -> str:
        """What a resume brought back besides weights and optimizer (for its log line)."""
        if self.in_flight is None:
            return ""
        return (f", with {len(self.in_flight.groups)} prompt groups in flight "
                f"({self.in_flight.carried()} sequences holding tokens)")

    def load_in_flight(self, common: dict) -> None:
        """The saved pool; a checkpoint of a run without partial rollouts has none: start at the
        data position that run's next step would take (step i takes rows i*B .. i*B+B-1)."""
        if "in_flight" in common:
            try:
                self.in_flight.load_state_dict(common["in_flight"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # a damaged file: one line
                raise ConfigError(f"corrupt checkpoint: its partial-rollout pool cannot be read ({e!r})") from None
            return
        next_step = int(common.get("iteration", 0)) + 1
        self.in_flight.load_state_dict({"cursor": next_step * self.cfg.rollout_batch_size, "groups": []})

    # --- parallel layout helpers -------------------------------------------------------
    @staticmethod
    def _dp():
        return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()

    @staticmethod
    def _is_last_stage() -> bool:
        return ps.is_pipeline_last_stage()

    # --- the step ----------------------------------------------------------------------
    def local_prompt_indices(self) -> list[int]:
        """Which of the step's B prompts this DP rank rolls out.

        Every PPO mini-batch (``mini_batch_size / n`` prompts) is split evenly over DP ranks, so
        mini-batch m holds the same global sequences at any layout.
        """
        dp, dp_rank, _ = self._dp()
        per_mini = self.cfg.mini_batch_size // self.cfg.num_samples
        share = per_mini // dp
        return [m + dp_rank * share + j for m in range(0, self.cfg.rollout_batch_size, per_mini)
                for j in range(share)]

    def rollout(self, iteration: int):
        """This DP rank's prompts x n samples: (batch, one row per sequence, response texts)."""
        self.episode_counts = {}
        if self.in_flight is not None:
            return self.partial_rollout(iteration)
        rows = self.data.rows_for_step(iteration, self.cfg.rollout_batch_size)
        mine = self.local_prompt_indices()
        local_rows = [rows[i] for i in mine]
        self.prompt_texts = [self.task.prompt(r, self.tokenizer) for r in local_rows]
        return self.sample(local_rows, mine, self.cfg.num_samples, iteration, self.prompt_texts)

    def partial_rollout(self, iteration: int):
        """--partial-rollouts: continue the groups in flight and start fresh ones until
        --rollout-batch-size groups are complete; train on those (rollout/partial.py). The pool
        is the same on every rank: each DP rank continues its share of it, the ranks agree after
        each decode step whether to stop, and the results are gathered into every copy."""
        flight, version = self.in_flight, iteration - 1  # the policy sampling now: after iteration-1 steps
        dropped = flight.begin_step(iteration)
        prompts: dict[int, list[int]] = {}

        def prompt_of(pos: int) -> list[int]:
            if pos not in prompts:
                prompts[pos] = encode_text(self.tokenizer, self.task.prompt(self.data.row_at(pos), self.tokenizer))
            return prompts[pos]

        pending = flight.pending(prompt_of)
        self.rollout_tokens, forwards = 0, 0
        if pending and flight.completed() < self.cfg.rollout_batch_size:
            self.rollout_tokens, forwards = self._continue_in_flight(pending, version)
        groups = flight.take()
        lag_mean, lag_max = lag_stats(groups, version)
        self.partial_stats = {"partial/carried": float(flight.carried()), "partial/dropped_stale": float(dropped),
                              "partial/policy_lag_mean": lag_mean, "partial/policy_lag_max": float(lag_max),
                              "partial/forwards": float(forwards)}
        return self._trained_groups([groups[i] for i in self.local_prompt_indices()], prompt_of)

    def _continue_in_flight(self, pending: list, version: int) -> tuple[int, int]:
        """Continue the pending samples (this DP rank's share: every dp-th) until enough groups
        are complete; (tokens this rank sampled, its forwards: a machine-independent measure of
        the rollout's cost)."""
        dp, dp_rank, group = self._dp()
        mine = list(range(dp_rank, len(pending), dp))
        agree = None if dp == 1 else (
            lambda flags, busy: flags_and_any(flags, mine, len(pending), busy, group))
        turns = self.sampler.continue_sequences(
            [pending[i] for i in mine], temperature=self.cfg.temperature, top_p=self.cfg.top_p,
            max_new_tokens=self.cfg.max_new_tokens, stop=self.task.stop_strings or None,
            enough=self.in_flight.enough(pending), agree=agree)
        sampled = sum(len(t.token_ids) - len(pending[i].tokens) for i, t in zip(mine, turns))
        tokens, logprobs, finish = _pool_order(turns, dp, group)
        self.in_flight.record(pending, tokens, logprobs, finish, version)
        return sampled, self.sampler.forwards()

    def _trained_groups(self, groups: list, prompt_of):
        """The complete groups as :meth:`sample` returns a rollout: (batch, rows, texts)."""
        rows = [self.data.row_at(g.pos) for g in groups]
        self.prompt_texts = [self.task.prompt(r, self.tokenizer) for r in rows]
        samples = [s for g in groups for s in g.samples]
        batch = build_rollout_batch([prompt_of(g.pos) for g in groups], [s.tokens for s in samples],
                                    [s.logprobs for s in samples], self.cfg.seq_length,
                                    self.sampler.pad_id, self.cfg.num_samples)
        seq_rows = [r for r in rows for _ in range(self.cfg.num_samples)]
        return batch, seq_rows, [self.tokenizer.decode(r) for r in batch.responses]

    def sample(self, rows: list, positions: list[int], n: int, rng_step: int, prompt_texts: list[str]):
        """``n`` responses to each of ``rows`` (at ``positions`` of the step's global batch, which
        key their samples): (batch, one row per sequence, response texts)."""
        prompts = [encode_text(self.tokenizer, text) for text in prompt_texts]
        seq_rows = [r for r in rows for _ in range(n)]
        seq_index = [i * n + k for i in positions for k in range(n)]
        common = dict(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                      max_new_tokens=self.cfg.max_new_tokens, stop=self.task.stop_strings or None,
                      rng_step=rng_step, seq_index=seq_index)
        if self.task.multi_turn:
            envs = [self.task.make_env(r, self.tokenizer) for r in seq_rows]
            batch, episodes = self.sampler.generate_episodes(prompts, n, envs,
                                                             tokenizer=self.tokenizer, **common)
            self.episode_counts = _summed([env.counts() for env in envs])
            return batch, seq_rows, [ep.response_text for ep in episodes]
        batch = self.sampler.generate(prompts, n, **common)
        return batch, seq_rows, [self.tokenizer.decode(r) for r in batch.responses]

    def evaluate(self, rows: list, n: int, iteration: int) -> dict:
        """Pass@k (k = 1, 2, 4, ..., n) on held-out ``rows``: ``n`` samples each at the run's
        sampling settings, the rows split over DP ranks; the same on every rank."""
        dp, dp_rank, _ = self._dp()
        positions = list(range(dp_rank, len(rows), dp))
        mine = [rows[i] for i in positions]
        texts = [self.task.prompt(r, self.tokenizer) for r in mine]
        _, seq_rows, responses = self.sample(mine, positions, n, EVAL_RNG_OFFSET + iteration, texts)
        correct = self.task.correct_many(responses, seq_rows)
        counts = [sum(correct[i * n:(i + 1) * n]) for i in range(len(mine))]
        sums = {f"eval/pass@{k}": sum(pass_at_k(n, c, k) for c in counts) for k in default_ks(n)}
        sums = reduce_sum({**sums, "prompts": float(len(mine))}, group=self._dp()[2])
        return {k: v / sums["prompts"] for k, v in sums.items() if k != "prompts"}

    def score(self, texts: list[str], rows) -> torch.Tensor:
        return torch.tensor(self.task.rewards(texts, rows), dtype=torch.float32, device=runtime.device())

    def shaped_rewards(self, rewards: torch.Tensor, batch: dict) -> torch.Tensor:
        """R - coef * sequence KL(pi_old || pi_ema) (the WARP baseline), where the passes ran."""
        coef = self.cfg.kl_in_reward_coef
        if not coef or "ref_logprob" not in batch:  # off, or not the last pipeline stage
            return rewards
        return sequence_kl_penalized_reward(rewards, batch["old_logprob"], batch["ref_logprob"],
                                            batch["mask"], coef).float()

    def gather_over_dp(self, local: torch.Tensor) -> torch.Tensor:
        return gather_cat(local, self._dp()[2])

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

    def sequences(self, rollout, rewards: torch.Tensor) -> dict:
        """This rank's training batch: the rollout label-aligned, each sequence's reward and its
        place in the rank-major global batch (``seq_pos``). With --sequence-packing over DP
        ranks, sequences move between ranks so each mini-batch's tokens are balanced
        (``training/sequence_balance``)."""
        dp, dp_rank, group = self._dp()
        multiple = self._width_multiple()
        batch = training_batch(rollout, multiple)
        S = batch["tokens"].shape[0]
        batch["reward"] = rewards.to(runtime.device())
        batch["seq_pos"] = torch.arange(dp_rank * S, (dp_rank + 1) * S, device=runtime.device())
        self.dp_token_imbalance = 1.0
        if dp == 1:
            return batch
        lengths = packing.sequence_lengths(batch["mask"])
        per_rank = gather_cat(torch.tensor(lengths), group).view(dp, S).tolist()
        local_mini = self.cfg.mini_batch_size // dp
        groups = [list(range(m, min(m + local_mini, S))) for m in range(0, S, local_mini)]
        dest = [[r] * S for r in range(dp)]
        if self.cfg.sequence_packing:
            dest = sequence_balance.assign(per_rank, groups)
            batch = sequence_balance.exchange(batch, per_rank, dest, rank=dp_rank, group=group,
                                              width_multiple=multiple)
        self.dp_token_imbalance = sequence_balance.imbalance(per_rank, dest, groups)
        return batch

    def _width_multiple(self) -> int:
        """What a batch's width is a multiple of: TP under sequence parallelism (it splits the
        width over TP ranks), times 8 under FP8 (its GEMMs need token counts per rank that are
        multiples of 8; rollouts are trimmed to a multiple of 8 only, and a batch re-laid after
        the DP exchange is trimmed to its own longest sequence)."""
        cfg = get_model_config(self.model_chunks[0])
        tp = ps.get_tensor_model_parallel_world_size() if cfg.sequence_parallel else 1
        return 8 * tp if cfg.fp8 else tp

    def no_grad_passes(self, batch: dict) -> dict:
        """The old-policy pass, then the anchor pass (the EMA swapped in, or the teacher): per-token outputs
        merged into ``batch``. One micro-batch plan serves both: the lengths do not change."""
        plan = self.batching.plan(batch)  # packing: a collective over DP
        self.padding_fraction = plan.padding_fraction

        def run(pass_fn, batch, chunks):
            mbs = plan.split(batch)
            return plan.merge(forward_only(chunks, mbs, pass_fn, fused_lmhead=self.passes.head.fused), mbs)

        batch = {**batch, **run(self.passes.old, batch, self.model_chunks)}
        with self.anchor.model() as anchor_chunks:  # the EMA swapped in, or the teacher
            return {**batch, **run(self.passes.anchor, batch, anchor_chunks)}  # with the old pass's top-k ids

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

        zero_grads(self.model_chunks, self.optimizer)
        # grads finalized by Megatron's hook
        outs = forward_backward(self.model_chunks, mbs, loss, fused_lmhead=self.passes.head.fused)
        sums = {k: sum(float(o[k]) for o in outs) for k in LOSS_KEYS} if outs else dict.fromkeys(LOSS_KEYS, 0.0)
        applied = step_if_finite(self.model_chunks, self.optimizer, self.scheduler, sums.values())
        return {**sums, "applied": float(applied), "norm": norm}

    def step(self, iteration: int) -> dict:
        t0 = time.monotonic()
        rollout, rows, texts = self.rollout(iteration)
        t_rollout = time.monotonic()
        rewards = self.score(texts, rows)
        self.samples = list(zip([p for p in self.prompt_texts for _ in range(self.cfg.num_samples)],
                                texts, rewards.tolist()))
        all_rewards = self.gather_over_dp(rewards)  # rank-major: sequence seq_pos at seq_pos
        batch = self.no_grad_passes(self.sequences(rollout, rewards))
        batch["advantages"] = self.advantages(batch, all_rewards)
        t_passes = time.monotonic()
        mismatch = self.rollout_mismatch(batch)
        stats = self.update(batch)
        if stats["updates_applied"]:
            check_weights(self.model_chunks, f"after step {iteration}")  # before the EMA and any save
        self.anchor.step(iteration)
        stability = self.stability(iteration, batch)
        self.sampler.update_weights(self.model_chunks)
        return {**self.step_metrics(stats, rollout, all_rewards, t0, t_rollout, t_passes),
                **mismatch, **stability, **self.sampler.metrics()}

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
                                    lr=self.optimizer.param_groups[0]["lr"],
                                    beta=self.passes.loss.kl_coef)
        return est.as_log()

    def rollout_mismatch(self, batch: dict) -> dict:
        """Rollout engine log-probs vs the trainer's recomputed old log-probs (last stage, all DP)."""
        values = {"rollout_logprob_diff": 0.0, "rollout_iw_max": 0.0}
        if self._is_last_stage():
            m = logprob_mismatch(batch["sampling_logprob"], batch["old_logprob"], batch["mask"],
                                 group=ps.get_data_parallel_group())
            if _tp_rank() == 0 and ps.get_data_parallel_rank() == 0:  # one rank reports
                values = {"rollout_logprob_diff": m["logprob_abs_diff_mean"],
                          "rollout_iw_max": m["importance_ratio_max"]}
        return reduce_sum(values)  # to every rank, including the logging rank

    def update(self, batch: dict) -> dict:
        """Lambda epochs over the PPO mini-batches; this rank's share of mini-batch m is every
        sequence it holds that the rank-major global batch places in m (``seq_pos``)."""
        dp, _, _ = self._dp()
        n_local = self.cfg.num_samples * len(self.local_prompt_indices())
        local_mini = self.cfg.mini_batch_size // dp
        which = (batch["seq_pos"] % n_local) // local_mini
        totals = dict.fromkeys(LOSS_KEYS, 0.0)
        applied = refused = 0
        for _ in range(self.cfg.ppo_epochs):
            for m in range(-(-n_local // local_mini)):
                rows = torch.nonzero(which == m).flatten()
                mini = {k: (v[rows] if v is not None else None) for k, v in batch.items()}
                out = self.train_minibatch(mini)
                applied += int(out["applied"])
                refused += int(not out["applied"])
                for k in LOSS_KEYS:
                    totals[k] += out[k]
        self.skipped_steps += int(refused > 0)
        # "skipped": no update applied, so the step changed nothing; a step with some refused
        # updates shows them in "updates_refused" (its applied updates are health-checked).
        return {**totals, "skipped": float(applied == 0), "updates_applied": applied,
                "updates_refused": refused}

    def step_metrics(self, stats: dict, rollout, rewards, t0: float, t_rollout: float,
                     t_passes: float) -> dict:
        contributes = self._is_last_stage() and _tp_rank() == 0
        local = {k: (stats[k] if contributes else 0.0) for k in LOSS_KEYS}
        local["gen_tokens"] = float(rollout.loss_mask.sum()) if contributes else 0.0
        # partial rollouts train on tokens sampled in earlier steps: the rate counts this step's
        sampled = self.rollout_tokens if self.in_flight is not None else local["gen_tokens"]
        local["sampled_tokens"] = float(sampled) if contributes else 0.0
        # the environments stepped on the model-parallel group's first rank (episodes.answer)
        stepped = _tp_rank() == 0 and ps.is_pipeline_first_stage()
        local.update({k: (v if stepped else 0.0) for k, v in self.episode_counts.items()})
        g = reduce_sum(local)
        tokens = max(g["tokens"], 1.0)
        elapsed = time.monotonic() - t0
        return {
            # in fp64: exact for float32 rewards, so independent of the DP gather order
            "reward_mean": float(rewards.double().mean()),
            "reward_std": float(rewards.double().std()),
            **self._zero_std_group_frac(rewards),
            "kl": g["kl"] / tokens,
            "entropy": g["entropy"] / tokens,
            "clip_frac": g["clip_frac"] / tokens,
            # share of response tokens truncated (tis) or masked (mis); 0 without --rollout-is
            "rollout_is_corrected_frac": g["rollout_is_corrected"] / tokens,
            "pg_loss": g["pg_loss"] / tokens,
            **self.anchor.metrics(),  # ema_lag, or the teacher pass's seconds
            "response_len": g["gen_tokens"] / rewards.numel(),
            "tokens_per_s": g["gen_tokens"] / elapsed,
            "rollout_time_s": t_rollout - t0,
            **self._rollout_rate(g["sampled_tokens"], t_rollout - t0),
            "step_time_s": elapsed,
            "update_time_s": time.monotonic() - t_passes,
            "lr": self.optimizer.param_groups[0]["lr"],
            "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,  # 0 in CPU mode
            # share of the token slots the passes compute that are padding (this rank's rollout batch)
            "padding_frac": self.padding_fraction,
            # per mini-batch, the busiest DP rank's tokens over the mean; the worst (1: balanced)
            "dp_token_imbalance": self.dp_token_imbalance,
            "skipped": stats["skipped"],
            "updates_refused": stats["updates_refused"],
            **self._episode_metrics(g, rewards.numel()),
            **self.partial_stats,
        }

    def _rollout_rate(self, sampled: float, seconds: float) -> dict:
        """Tokens sampled per second of rollout; none for a partial-rollout step that sampled
        nothing (enough complete groups were waiting): it has no rate."""
        if self.in_flight is not None and not sampled:
            return {}
        return {"rollout_tokens_per_s": sampled / max(seconds, 1e-9)}

    def _zero_std_group_frac(self, rewards: torch.Tensor) -> dict:
        """Groups whose samples all got one reward: no advantage, so no policy gradient from them
        (nothing to say without the task's reward in the advantages)."""
        if not self.cfg.task_reward:
            return {}
        same = rewards.view(-1, self.cfg.num_samples).std(dim=1) == 0
        return {"zero_std_group_frac": float(same.double().mean())}

    def _episode_metrics(self, sums: dict, episodes: int) -> dict:
        """Multi-turn tasks: the environments' counts per episode, and the share of valid turns."""
        if not self.episode_counts:
            return {}
        out = {k: sums[k] / episodes for k in self.episode_counts}
        if "search/turns" in out:
            out["search/valid_action_rate"] = 1.0 - out.pop("search/invalid_turns") / max(out["search/turns"], 1e-9)
        return out


def _pool_order(turns: list, dp: int, group) -> tuple[list, list, list]:
    """Every DP rank's continued turns (rank ``r`` holds pool entries ``r, r + dp, ...``) in pool
    order: their token ids, log-probs and finish reasons."""
    if dp == 1:
        return [t.token_ids for t in turns], [t.logprobs for t in turns], [t.finish_reason or "" for t in turns]
    reasons = ("", "stop", "length")  # "": unfinished (a turn's None)
    codes = gather_lists([[reasons.index(t.finish_reason or "") for t in turns]], group, torch.long)  # per rank
    tokens = gather_lists([t.token_ids for t in turns], group, torch.long)
    logprobs = gather_lists([t.logprobs for t in turns], group)
    finish = [reasons[int(c)] for rank in codes for c in rank]
    order = [r + j * dp for r, rank in enumerate(codes) for j in range(len(rank))]  # pool index of each
    back = sorted(range(len(order)), key=order.__getitem__)
    return [tokens[i] for i in back], [logprobs[i] for i in back], [finish[i] for i in back]


def _summed(dicts: list[dict]) -> dict:
    return {k: sum(d[k] for d in dicts) for k in (dicts[0] if dicts else {})}


def _tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank()
