"""Multi-turn episodes shared by the rollout engines (the search-agent task).

An engine only has to continue token-id histories by one model turn
(``continue_fn(histories, budgets, active, turn) -> list[Turn]``); :func:`run_episodes`
drives the environments, keeps the sampled ids and log-probs of model turns (loss mask 1)
and the observation tokens (mask 0), and packs the result as a :class:`RolloutBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from emapg_megatron.rollout.engine import (
    RolloutBatch,
    build_rollout_batch,
)
from emapg_megatron.tasks.base import encode_text


@dataclass
class Turn:
    """One sampled continuation: the ids, their sampling log-probs and the decoded text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None
    routes: Any = None
    """The experts the engine routed the request's tokens to, when it returns them (vLLM, R3)."""


class Episode:
    """One multi-turn trajectory after its prompt: model turns (loss mask 1) interleaved with
    environment observations (mask 0), kept as ids, mask and sampling log-probs.

    The environment may cut a turn after its first closing action tag; when the kept model
    segment is a prefix of the sampled ids, those ids and their log-probs are kept. If the
    environment had to re-encode the text instead, the re-encoded tokens were not sampled, so
    they get mask 0 (counted in ``unaligned_tokens``). Everything is cut at ``max_len`` tokens
    including the prompt (``truncated``).
    """

    def __init__(self, prompt_ids: Sequence[int], env, tokenizer, max_len: int):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.env = env
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.unaligned_tokens = 0
        self.truncated = False
        self.agreed_text: str | None = None  # set by an engine that broadcasts another rank's batch
        self.agreed_env: dict | None = None  # the source rank's env state, set by :func:`answer`

    @property
    def response_text(self) -> str:
        """What the reward scores: the environment's text, or, when the engine replaced this
        episode's tokens by its model-parallel group's source rank's, that rank's text."""
        return self.env.response_text if self.agreed_text is None else self.agreed_text

    def room(self) -> int:
        return self.max_len - len(self.prompt_ids) - len(self.ids)

    def _env(self, name: str):
        return getattr(self.env, name) if self.agreed_env is None else self.agreed_env[name]

    @property
    def done(self) -> bool:
        return self._env("done") or self.room() < 1

    def history(self) -> list[int]:
        return self.prompt_ids + self.ids

    def turn_budget(self, default: int) -> int:
        return max(0, min(self._env("max_turn_tokens") or default, self.room()))

    def add_turn(self, turn: Turn) -> None:
        before = len(self.env.segments)
        self.env.step(turn.text, token_ids=turn.token_ids)
        new = self.env.segments[before:]
        model = new[0]
        kept = None if model.token_ids is None else [int(i) for i in model.token_ids]
        if kept is not None and kept == list(turn.token_ids[:len(kept)]):
            self._extend(kept, 1, list(turn.logprobs[:len(kept)]))
        else:
            ids = encode_text(self.tokenizer, model.text)
            self.unaligned_tokens += len(ids)
            self._extend(ids, 0, [0.0] * len(ids))
        for seg in new[1:]:
            ids = seg.token_ids if seg.token_ids is not None else encode_text(self.tokenizer, seg.text)
            self._extend([int(i) for i in ids], 0, [0.0] * len(ids))

    def _extend(self, ids: list[int], mask: int, logprobs: list[float]) -> None:
        keep = max(0, self.room())
        if len(ids) > keep:
            self.truncated = True
            ids, logprobs = ids[:keep], logprobs[:keep]
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs


_AGREED = ("ids", "mask", "logprobs", "unaligned_tokens", "truncated")


def answer(episodes: Sequence[Episode], turns: Sequence[Turn], group=None) -> None:
    """Let the environments of ``episodes`` answer ``turns``. With a model-parallel ``group``,
    only its first rank steps them (one retriever call per sequence, not one per rank; copies
    could also answer differently, e.g. a retriever failing on one rank) and every rank takes its
    outcome: the group's ranks must feed the same tokens to the same forwards and train on the
    same batch."""
    shared = group is not None and dist.get_world_size(group) > 1
    if not shared:
        for ep, turn in zip(episodes, turns):
            ep.add_turn(turn)
        return
    src = dist.get_process_group_ranks(group)[0]
    payload: list = [None]
    if dist.get_rank() == src:
        try:
            for ep, turn in zip(episodes, turns):
                ep.add_turn(turn)
            payload = [[({k: getattr(ep, k) for k in _AGREED}, {"done": ep.env.done,
                         "max_turn_tokens": ep.env.max_turn_tokens}, ep.response_text)
                        for ep in episodes]]
        except Exception as e:  # the other ranks wait for this broadcast: tell them, then raise
            dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=src, group=group)
            raise
    dist.broadcast_object_list(payload, src=src, group=group)  # our own ranks' lists, not user data
    if isinstance(payload[0], str):
        raise RuntimeError(f"an environment failed on rank {src} of this model-parallel group: {payload[0]}")
    if dist.get_rank() == src:
        return
    for ep, (fields, env, text) in zip(episodes, payload[0]):
        for k, v in fields.items():
            setattr(ep, k, v)
        ep.agreed_env, ep.agreed_text = env, text


def pack_episodes(episodes: Sequence[Episode], n: int, seq_length: int, pad_id: int) -> RolloutBatch:
    """Prompt-major episodes (``n`` per prompt) as a RolloutBatch with the episodes' masks."""
    prompts = [episodes[i].prompt_ids for i in range(0, len(episodes), n)]
    batch = build_rollout_batch(prompts, [e.ids for e in episodes], [e.logprobs for e in episodes],
                                seq_length, pad_id, n)
    for s, ep in enumerate(episodes):
        start = len(ep.prompt_ids)
        batch.loss_mask[s, start:start + len(ep.mask)] = torch.tensor(ep.mask, dtype=batch.loss_mask.dtype)
    return batch


def start_episodes(prompts: Sequence[Sequence[int]], n: int, envs: Sequence[Any], *, tokenizer,
                   top_p: float, seq_length: int) -> list[Episode]:
    """One :class:`Episode` per environment (prompt-major, ``n`` per prompt)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt: every sequence needs at least one token to continue")
    if len(envs) != len(prompts) * n:
        raise ValueError(f"{len(envs)} environments for {len(prompts)} prompts x {n} samples")
    return [Episode(prompts[s // n], envs[s], tokenizer, seq_length) for s in range(len(envs))]


def run_episodes(continue_fn: Callable[..., list[Turn]], prompts: Sequence[Sequence[int]], n: int,
                 envs: Sequence[Any], *, tokenizer, top_p: float, max_new_tokens: int,
                 seq_length: int, pad_id: int, group=None) -> tuple[RolloutBatch, list[Episode]]:
    """``envs`` holds one fresh environment per sequence (prompt-major).

    Each round continues every unfinished episode by one model turn (at most the env's
    ``max_turn_tokens``, else ``max_new_tokens``, and never past ``seq_length``), then lets
    its environment answer (:func:`answer`: on ``group``'s first rank only). The batch's loss
    mask is 0 on observations.
    """
    episodes = start_episodes(prompts, n, envs, tokenizer=tokenizer, top_p=top_p, seq_length=seq_length)
    turn = 0
    while active := [s for s, ep in enumerate(episodes) if not ep.done]:
        turns = continue_fn([episodes[s].history() for s in active],
                            [episodes[s].turn_budget(max_new_tokens) for s in active], active, turn)
        answer([episodes[s] for s in active], turns, group)
        turn += 1
    return pack_episodes(episodes, n, seq_length, pad_id), episodes
