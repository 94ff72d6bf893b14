"""Partial rollouts: the prompt groups in flight between trainer steps (host bookkeeping only).

A step keeps ``pool_size`` prompt groups (``n`` samples each) in flight: the groups carried from
the last step first, then fresh prompts from the data order. Generation stops as soon as
``batch_size`` groups are complete (every sample finished); the step trains on the first
``batch_size`` complete groups in pool order, whole (advantages need whole groups), and keeps
the rest. An unfinished sample keeps its tokens, the sampler's log-prob of each and the policy
version that produced each, and is continued first in the next step, under the new weights.

Versions: the policy that samples at step ``i`` is version ``i - 1`` (the updates of the steps
before it), the one the step trains from. A token of version ``v`` trained at step ``i`` lags
``i - 1 - v`` versions. Before a step generates, every sample holding a token that would lag more
than ``max_staleness`` is dropped and restarts from its prompt (its group stays whole), so no
trained token ever lags more.

A sample's randomness is keyed by (the step it started at, ``pos * n + k``) where ``pos`` is its
prompt's position in the data order and ``k`` its index in the group: the same sample draws the
same uniforms whichever step continues it, so a sequence continued under unchanged weights
equals the one generated in one go.

A pool read back from a checkpoint is checked against these invariants first
(:meth:`InFlight.check_state`): whole groups of ``n`` samples at drawn data positions, token ids
in the vocabulary, one finite log-prob and one policy version per token, versions no later than
the checkpoint's step allows (a version from the future would never go stale).

Nothing here imports Megatron: the maths is tested on its own (tests/rollout/test_partial.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from emapg_megatron.errors import shown

FINISH_REASONS = ("", "stop", "length")  # "": unfinished
#: A sampled token's log-probability is <= 0; this much above is rounding.
_LOGPROB_SLACK = 1e-3


@dataclass
class Sample:
    """One sequence of a group; ``finish_reason`` is "" while it is unfinished."""

    start_step: int  # keys its uniforms (with its row); a restart takes the restart's step
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    finish_reason: str = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def restart(self, step: int) -> None:
        self.start_step, self.finish_reason = step, ""
        self.tokens, self.logprobs, self.versions = [], [], []


@dataclass
class Group:
    """A prompt's ``n`` samples; ``pos`` is the prompt's position in the data order."""

    pos: int
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class Pending:
    """What the sampler needs to continue one unfinished sample (``row`` keys its uniforms)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    rng_step: int
    row: int
    sample: Sample
    group: int  # the group's index in the pool


def is_stale(versions: list[int], version: int, max_staleness: int) -> bool:
    """Whether a token of ``versions`` would lag more than ``max_staleness`` behind ``version``."""
    return bool(versions) and version - min(versions) > max_staleness


def lag_stats(groups: list[Group], version: int) -> tuple[float, int]:
    """Mean and max lag (``version`` minus each token's version) over the groups' tokens."""
    lags = [version - v for g in groups for s in g.samples for v in s.versions]
    return (sum(lags) / len(lags) if lags else 0.0), max(lags, default=0)


class InFlight:
    """The pool of prompt groups and the data position (``cursor``: prompts drawn so far)."""

    def __init__(self, n: int, batch_size: int, pool_size: int, max_staleness: int):
        if pool_size < batch_size:
            raise ValueError(f"pool of {pool_size} groups below the batch of {batch_size}")
        self.n, self.batch_size, self.pool_size = n, batch_size, pool_size
        self.max_staleness = max_staleness
        self.cursor = 0
        self.groups: list[Group] = []

    def begin_step(self, step: int) -> int:
        """Drop the stale samples (they restart at ``step``), then fill the pool with fresh
        prompts; returns how many samples were dropped."""
        dropped = 0
        for g in self.groups:
            for s in g.samples:
                if is_stale(s.versions, step - 1, self.max_staleness):
                    s.restart(step)
                    dropped += 1
        while len(self.groups) < self.pool_size:
            self.groups.append(Group(self.cursor, [Sample(step) for _ in range(self.n)]))
            self.cursor += 1
        return dropped

    def pending(self, prompt_of) -> list[Pending]:
        """The unfinished samples in pool order; ``prompt_of(pos)``: a prompt's token ids."""
        return [Pending(prompt_of(g.pos), s.tokens, s.logprobs, s.start_step, g.pos * self.n + k, s, i)
                for i, g in enumerate(self.groups) for k, s in enumerate(g.samples) if not s.finished]

    def completed(self) -> int:
        return sum(g.complete for g in self.groups)

    def enough(self, pending: list[Pending]):
        """A predicate on the pending samples' finished flags: whether ``batch_size`` groups are
        complete (the sampler asks it after each decode step)."""
        waiting = [sum(not s.finished for s in g.samples) for g in self.groups]

        def predicate(done: list[bool]) -> bool:
            left = list(waiting)
            for p, d in zip(pending, done):
                left[p.group] -= d
            return sum(w == 0 for w in left) >= self.batch_size

        return predicate

    @staticmethod
    def record(pending: list[Pending], tokens: list[list[int]], logprobs: list[list[float]],
               finish: list[str], version: int) -> int:
        """Store each pending sample's tokens after generation (``tokens[i]`` includes what it
        had); returns the tokens generated."""
        new = 0
        for p, toks, lps, why in zip(pending, tokens, logprobs, finish):
            s, added = p.sample, len(toks) - len(p.sample.tokens)
            s.tokens, s.logprobs = list(toks), list(lps)
            s.versions = s.versions + [version] * added
            s.finish_reason = why
            new += added
        return new

    def take(self) -> list[Group]:
        """The first ``batch_size`` complete groups in pool order, removed from the pool."""
        chosen = [g for g in self.groups if g.complete][:self.batch_size]
        if len(chosen) < self.batch_size:
            raise RuntimeError(f"{len(chosen)} complete groups of the {self.batch_size} needed")
        ids = {id(g) for g in chosen}
        self.groups = [g for g in self.groups if id(g) not in ids]
        return chosen

    def carried(self) -> int:
        """Unfinished samples left in flight that hold tokens (continued next step)."""
        return sum(bool(s.tokens) and not s.finished for g in self.groups for s in g.samples)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor,
                "groups": [{"pos": g.pos, "samples": [vars(s).copy() for s in g.samples]}
                           for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.groups = [Group(int(g["pos"]), [Sample(**s) for s in g["samples"]]) for g in state["groups"]]

    def check_state(self, state, *, iteration: int, vocab_size: int | None, max_tokens: int | None) -> None:
        """Refuse a :meth:`state_dict` (of a checkpoint of step ``iteration``) that breaks the
        pool's invariants: ValueError naming the group and sample and what is wrong. A bound
        given as None (the vocabulary, the tokens a sample may hold) is not checked."""
        if not isinstance(state, dict) or not isinstance(state.get("groups"), list):
            raise ValueError(f"it is {shown(state)}, not a cursor and a list of groups")
        cursor = _int(state.get("cursor"), 0, 1 << 62, "its cursor")
        if len(state["groups"]) > self.pool_size:
            raise ValueError(f"{len(state['groups'])} groups, more than the pool's {self.pool_size}")
        seen = set()
        for i, g in enumerate(state["groups"]):
            where = f"group {i}"
            if not isinstance(g, dict) or not isinstance(g.get("samples"), list):
                raise ValueError(f"{where} is {shown(g)}, not a position and a list of samples")
            pos = _int(g.get("pos"), 0, cursor - 1, f"{where}: its data position")
            if pos in seen:
                raise ValueError(f"{where}: data position {pos} is in flight twice")
            seen.add(pos)
            where += f" (data position {pos})"
            if len(g["samples"]) != self.n:
                raise ValueError(f"{where} holds {len(g['samples'])} samples, not --num-samples-per-prompt {self.n}")
            for k, sample in enumerate(g["samples"]):
                _check_sample(sample, f"{where}, sample {k}", iteration, vocab_size, max_tokens)


_SAMPLE_FIELDS = {f.name for f in fields(Sample)}


def _int(value, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what} is {shown(value)}, not an integer from {low} to {high}")
    return value


def _check_sample(sample, where: str, iteration: int, vocab_size: int | None, max_tokens: int | None) -> None:
    """One sample's invariants (see :meth:`InFlight.check_state`)."""
    if not isinstance(sample, dict) or set(sample) != _SAMPLE_FIELDS:
        raise ValueError(f"{where} is {shown(sample)}, not a sample ({', '.join(sorted(_SAMPLE_FIELDS))})")
    start = _int(sample["start_step"], 1, iteration, f"{where}: its start step")
    tokens, logprobs, versions = sample["tokens"], sample["logprobs"], sample["versions"]
    if not all(isinstance(x, list) for x in (tokens, logprobs, versions)):
        raise ValueError(f"{where}: its tokens, log-probs and versions are not lists")
    if not len(tokens) == len(logprobs) == len(versions):
        raise ValueError(f"{where}: {len(tokens)} tokens, {len(logprobs)} log-probs and {len(versions)} "
                         "versions (one of each per token)")
    if max_tokens is not None and len(tokens) > max_tokens:
        raise ValueError(f"{where}: {len(tokens)} tokens, more than --seq-length allows ({max_tokens})")
    ids = range(vocab_size) if vocab_size is not None else range(1 << 62)
    bad = next((t for t in tokens if type(t) is not int or t not in ids), None)
    if bad is not None:
        raise ValueError(f"{where}: token {shown(bad)} is not an id of the vocabulary (0 to {ids[-1]})")
    if any(type(x) not in (int, float) or not math.isfinite(x) or x > _LOGPROB_SLACK for x in logprobs):
        raise ValueError(f"{where}: a log-prob is not a finite number <= 0")
    # the policy that samples at step s is version s - 1: from the sample's start to the checkpoint's step
    if any(type(v) is not int or not start - 1 <= v <= iteration - 1 for v in versions) or versions != sorted(versions):
        raise ValueError(f"{where}: its policy versions {shown(versions)} are not in order from {start - 1} "
                         f"(its start step - 1) to {iteration - 1} (the checkpoint's step - 1)")
    if sample["finish_reason"] not in FINISH_REASONS:
        raise ValueError(f"{where}: finish reason {shown(sample['finish_reason'])} is not one of "
                         f"{', '.join(map(repr, FINISH_REASONS))}")
