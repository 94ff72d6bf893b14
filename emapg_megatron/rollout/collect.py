"""Rollout collection: a step's prompts turned into the rollout it trains on, as one record.

Two collectors behind one interface (:class:`Collector`), one chosen by ``build.py``:

* :class:`FreshRollouts`: step ``i`` takes the next ``B`` prompts of the data order; each
  data-parallel rank samples its share of them, ``n`` responses each.
* :class:`PartialRollouts` (``--partial-rollouts``): the prompt groups in flight between steps
  (:mod:`.partial`, pure bookkeeping) are continued until ``B`` groups are complete; the step
  trains on those and the rest stay in flight, in the collector's checkpoint state.

Either returns a :class:`Rollout` record (batch, rows, texts, counts, metrics) and owns its
checkpoint state; the trainer reads no rollout setting and never asks which collector runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch
from megatron.core import parallel_state as ps

from emapg_megatron.errors import ConfigError, agreed
from emapg_megatron.rollout.engine import RolloutBatch, build_rollout_batch
from emapg_megatron.rollout.partial import InFlight, Pending, lag_stats
from emapg_megatron.rollout.route_recording import lay_routes
from emapg_megatron.tasks.base import encode_text
from emapg_megatron.training.collectives import flags_and_any, gather_lists, gather_ragged

#: The rollout metrics a partial-rollout step logs (partial/...), alike on every rank.
PARTIAL_KEYS = ("partial/carried", "partial/dropped_stale", "partial/policy_lag_mean",
                "partial/policy_lag_max", "partial/forwards")


@dataclass(frozen=True)
class SamplingSettings:
    """What every sampled turn is asked for: the run's temperature, top-p, response budget and the
    task's stop strings."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...] | None = None

    def kwargs(self) -> dict:
        return dict(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                    stop=list(self.stop) if self.stop else None)


@dataclass(frozen=True)
class StepShape:
    """How a step's prompts are laid out: ``B`` prompts, ``n`` samples each, PPO mini-batches of
    ``mini_batch_size`` sequences."""

    batch_size: int
    n: int
    mini_batch_size: int

    def local_prompts(self, dp: int, dp_rank: int) -> list[int]:
        """Which of the step's B prompts data-parallel rank ``dp_rank`` rolls out: every PPO
        mini-batch's prompts are split evenly over the ranks, so mini-batch m holds the same
        global sequences at any layout."""
        per_mini = self.mini_batch_size // self.n
        share = per_mini // dp
        return [m + dp_rank * share + j for m in range(0, self.batch_size, per_mini) for j in range(share)]


@dataclass
class Rollout:
    """One step's rollout on this data-parallel rank."""

    batch: RolloutBatch
    """This rank's sequences, prompt-major (prompt i's n samples are rows i*n .. i*n+n-1)."""
    rows: list
    """The data row of each sequence."""
    prompts: list[str]
    """The rendered prompt of each group."""
    responses: list[str]
    """The response text of each sequence (what the task scores)."""
    sampled_tokens: float
    """Tokens the engine sampled this step on this rank (partial rollouts train on tokens sampled
    in earlier steps too)."""
    counts: dict[str, float] = field(default_factory=dict)
    """Multi-turn tasks: the environments' counts, summed over this rank's episodes."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The collector's per-step metrics, alike on every rank (partial/...)."""
    decode: dict[str, float] = field(default_factory=dict)
    """What the engine's decoding cost this step (rollout_cache_waves, ...: zero counts on a step
    that sampled nothing)."""

    def samples(self, rewards: list[float]) -> list[tuple[str, str, float]]:
        """``(prompt, response, reward)`` of each sequence, for rollout dumps."""
        n = len(self.responses) // max(len(self.prompts), 1)
        return list(zip([p for p in self.prompts for _ in range(n)], self.responses, rewards))


class Collector(Protocol):
    def collect(self, step: int) -> Rollout:
        """Step ``step``'s rollout on this rank (every rank calls it: it may be collective)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the collector (replicated: alike on every rank)."""

    def load_state_dict(self, common: dict) -> None:
        """Take :meth:`state_dict` back from a checkpoint's common state (which may lack it)."""

    def resume_note(self) -> str:
        """What a resume brought back besides weights and optimizer, for its log line."""


def _dp() -> tuple[int, int, object]:
    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()


def sample_rows(engine, task, tokenizer, rows: list, positions: list[int], n: int, rng_step: int,
                sampling: SamplingSettings) -> Rollout:
    """``n`` responses to each of ``rows`` (at ``positions`` of a global batch, which key their
    samples), single-turn or as the task's multi-turn episodes."""
    prompts = [task.prompt(r, tokenizer) for r in rows]
    ids = [encode_text(tokenizer, text) for text in prompts]
    seq_rows = [r for r in rows for _ in range(n)]
    common = dict(**sampling.kwargs(), rng_step=rng_step, seq_index=[i * n + k for i in positions for k in range(n)])
    counts = {}
    if task.multi_turn:
        envs = [task.make_env(r, tokenizer) for r in seq_rows]
        batch, episodes = engine.generate_episodes(ids, n, envs, tokenizer=tokenizer, **common)
        responses = [ep.response_text for ep in episodes]
        counts = _summed([env.counts() for env in envs])
    else:
        batch = engine.generate(ids, n, **common)
        responses = [tokenizer.decode(r) for r in batch.responses]
    return Rollout(batch, seq_rows, prompts, responses, float(batch.loss_mask.sum()), counts,
                   decode=_decode_metrics(batch.stats))


class FreshRollouts:
    """Step i samples prompts i*B .. i*B+B-1 of the data order (this rank's share of them)."""

    def __init__(self, engine, task, tokenizer, data, shape: StepShape, sampling: SamplingSettings):
        self.engine, self.task, self.tokenizer, self.data = engine, task, tokenizer, data
        self.shape, self.sampling = shape, sampling

    def collect(self, step: int) -> Rollout:
        rows = self.data.rows_for_step(step, self.shape.batch_size)
        mine = self.shape.local_prompts(*_dp()[:2])
        return sample_rows(self.engine, self.task, self.tokenizer, [rows[i] for i in mine], mine,
                           self.shape.n, step, self.sampling)

    def state_dict(self) -> dict:
        return {}  # the data position is the step

    def load_state_dict(self, common: dict) -> None:
        pass

    def resume_note(self) -> str:
        return ""


class PartialRollouts:
    """--partial-rollouts: continue the groups in flight and start fresh ones until ``B`` groups
    are complete; train on those. The pool is the same on every rank: each data-parallel rank
    continues its share of it (every dp-th pending sample), the ranks agree after each decode step
    whether to stop, and the results are gathered into every copy."""

    def __init__(self, engine, task, tokenizer, data, shape: StepShape, sampling: SamplingSettings,
                 pool: InFlight):
        self.engine, self.task, self.tokenizer, self.data = engine, task, tokenizer, data
        self.shape, self.sampling, self.pool = shape, sampling, pool

    def collect(self, step: int) -> Rollout:
        pool, version = self.pool, step - 1  # the policy sampling now: after step-1 updates
        dropped = pool.begin_step(step)
        prompt_of = _PromptIds(self.task, self.tokenizer, self.data)
        pending = pool.pending(prompt_of)
        sampled, stats, routed = 0, self.engine.idle_stats(), {}
        if pending and pool.completed() < self.shape.batch_size:
            sampled, stats, routed = self._continue(pending, version)
        groups = pool.take()
        lag_mean, lag_max = lag_stats(groups, version)
        metrics = dict(zip(PARTIAL_KEYS, (float(pool.carried()), float(dropped), lag_mean, float(lag_max),
                                          float(stats.forwards()))))
        mine = [groups[i] for i in self.shape.local_prompts(*_dp()[:2])]
        rows = [self.data.row_at(g.pos) for g in mine]
        samples = [s for g in mine for s in g.samples]
        batch = build_rollout_batch([prompt_of(g.pos) for g in mine], [s.tokens for s in samples],
                                    [s.logprobs for s in samples], self.engine.seq_length,
                                    self.engine.pad_id, self.shape.n)
        if self._records_routes:
            histories = [prompt_of(g.pos) + s.tokens for g in mine for s in g.samples]
            batch.routes = lay_routes(self._routes(samples, histories, routed), batch.tokens.shape[1])
        return Rollout(batch, [r for r in rows for _ in range(self.shape.n)],
                       [self.task.prompt(r, self.tokenizer) for r in rows],
                       [self.tokenizer.decode(r) for r in batch.responses], float(sampled),
                       metrics=metrics, decode=_decode_metrics(stats))

    @property
    def _records_routes(self) -> bool:
        """Whether the engine records a MoE policy's routes (R3): the batch then carries them."""
        return getattr(self.engine, "route_dtype", None) is not None

    def _continue(self, pending: list[Pending], version: int):
        """Continue this rank's share of the pending samples until enough groups are complete;
        (tokens this rank sampled, the decoding's stats, the routes each sample finished now was
        fed with, by ``id`` of its sample, gathered from every rank)."""
        dp, dp_rank, group = _dp()
        mine = list(range(dp_rank, len(pending), dp))
        agree = None if dp == 1 else (lambda flags, busy: flags_and_any(flags, mine, len(pending), busy, group))
        done = self.engine.continue_sequences([pending[i] for i in mine], **self.sampling.kwargs(),
                                              enough=self.pool.enough(pending), agree=agree)
        sampled = sum(len(t.token_ids) - len(pending[i].tokens) for i, t in zip(mine, done.turns))
        self.pool.record(pending, *_pool_order(done.turns, dp, group), version)
        routed = {}
        if done.routes is not None:
            finished = [r if t.finish_reason else None for t, r in zip(done.turns, done.routes)]
            routed = {id(p.sample): r for p, r in zip(pending, _routes_in_pool_order(finished, dp, group, self.engine.route_dtype))
                      if r is not None}
        return sampled, done.stats, routed

    def _routes(self, samples: list, histories: list[list[int]], routed: dict) -> list:
        """Each trained sample's routes (R3): those its continuation at this step was fed with
        (its prompt and carried tokens prefilled again, then each new token), else, for a sample
        that finished at an earlier step, those of a forward of it now: either way the routes of
        this step's weights, which the old-policy pass replays."""
        missing = [i for i, s in enumerate(samples) if id(s) not in routed]
        refed = self.engine.route_histories([histories[i] for i in missing]) if missing else []
        out = [routed.get(id(s)) for s in samples]
        for i, r in zip(missing, refed):
            out[i] = r
        return out

    def state_dict(self) -> dict:
        return {"in_flight": self.pool.state_dict()}

    def load_state_dict(self, common: dict) -> None:
        """The saved pool; a checkpoint of a run without partial rollouts has none: start at the
        data position that run's next step would take (step i takes rows i*B .. i*B+B-1)."""
        if "in_flight" in common:
            # (an engine that states no vocabulary or length, a test double, leaves those unchecked)
            vocab, length = getattr(self.engine, "vocab_size", None), getattr(self.engine, "seq_length", None)
            try:  # a damaged or foreign pool: one line, before any rank continues it
                self.pool.check_state(common["in_flight"], iteration=int(common.get("iteration", 0)),
                                      vocab_size=vocab, max_tokens=None if length is None else length - 1)
            except (TypeError, ValueError) as e:  # every rank reads the same pool: said once
                raise agreed(ConfigError(f"corrupt checkpoint: its partial-rollout pool: {e}")) from None
            self.pool.load_state_dict(common["in_flight"])
            return
        next_step = int(common.get("iteration", 0)) + 1
        self.pool.load_state_dict({"cursor": next_step * self.shape.batch_size, "groups": []})

    def resume_note(self) -> str:
        return (f", with {len(self.pool.groups)} prompt groups in flight "
                f"({self.pool.carried()} sequences holding tokens)")


class _PromptIds:
    """A prompt's token ids by its position in the data order, each rendered once per step."""

    def __init__(self, task, tokenizer, data):
        self.task, self.tokenizer, self.data, self.ids = task, tokenizer, data, {}

    def __call__(self, pos: int) -> list[int]:
        if pos not in self.ids:
            self.ids[pos] = encode_text(self.tokenizer, self.task.prompt(self.data.row_at(pos), self.tokenizer))
        return self.ids[pos]


def _in_pool_order(per_rank: list[list], dp: int) -> list:
    """What each DP rank holds of the pool (rank ``r``: entries ``r, r + dp, ...``), in pool order."""
    order = [r + j * dp for r, items in enumerate(per_rank) for j in range(len(items))]  # pool index of each
    flat = [x for items in per_rank for x in items]
    return [flat[i] for i in sorted(range(len(order)), key=order.__getitem__)]


def _pool_order(turns: list, dp: int, group) -> tuple[list, list, list]:
    """Every DP rank's continued turns in pool order: their token ids, log-probs and finish
    reasons."""
    if dp == 1:
        return [t.token_ids for t in turns], [t.logprobs for t in turns], [t.finish_reason or "" for t in turns]
    reasons = ("", "stop", "length")  # "": unfinished (a turn's None)
    codes = gather_lists([[reasons.index(t.finish_reason or "") for t in turns]], group, torch.long)  # per rank
    tokens = gather_lists([t.token_ids for t in turns], group, torch.long)
    logprobs = gather_lists([t.logprobs for t in turns], group)
    split = list(itertools.accumulate(len(rank) for rank in codes))

    def per_rank(flat):
        return [flat[end - len(rank):end] for rank, end in zip(codes, split)]

    finish = [[reasons[int(c)] for c in rank] for rank in codes]
    return (_in_pool_order(per_rank(tokens), dp), _in_pool_order(per_rank(logprobs), dp),
            _in_pool_order(finish, dp))


def _routes_in_pool_order(routes: list, dp: int, group, dtype: torch.dtype) -> list:
    """Every DP rank's continued sequences' routes (``[positions, layers, k]`` each, None where
    unrecorded) in pool order: two packed gathers (each rank's sizes, then its route values as
    int32), no Python list of the values."""
    if dp == 1:
        return list(routes)
    shape = next((tuple(r.shape[1:]) for r in routes if r is not None), (0, 0))
    sizes = torch.tensor([*shape, *(0 if r is None else r.shape[0] for r in routes)], dtype=torch.long)
    values = [r.reshape(-1).to(torch.int32) for r in routes if r is not None]
    every_sizes = gather_ragged(sizes, group)
    every_values = gather_ragged(torch.cat(values) if values else torch.zeros(0, dtype=torch.int32), group)
    layers, k = next((tuple(s[:2].tolist()) for s in every_sizes if s[0] > 0), (0, 0))
    per_rank = []
    for rank_sizes, rank_values in zip(every_sizes, every_values):
        rank_values, at, items = rank_values.cpu(), 0, []
        for n in rank_sizes[2:].tolist():
            items.append(rank_values[at:at + n * layers * k].view(n, layers, k).to(dtype) if n else None)
            at += n * layers * k
        per_rank.append(items)
    return _in_pool_order(per_rank, dp)


def _decode_metrics(stats) -> dict:
    return stats.metrics() if stats is not None else {}


def _summed(dicts: list[dict]) -> dict:
    return {k: sum(d[k] for d in dicts) for k in (dicts[0] if dicts else {})}
