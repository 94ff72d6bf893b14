"""The built-in sampler: autoregressive generation on the Megatron model itself.

Single-turn generation, multi-turn episodes and partial rollouts' continuations are written once,
over :class:`~emapg_megatron.rollout.kv_cache_decoding.Stream` s; how the streams are decoded is
one of three paths chosen once from the sampler's config (:mod:`.decoders`): Megatron-Core's KV
cache in lockstep (the default), the fixed-shape step, or the cache-free recompute reference the
others are tested against. All run at any TP/PP/DP layout. Meant for CPU runs, tests and GPU runs
without vLLM.

Randomness is one uniform number per (sequence, turn, token), drawn from a generator keyed by
(seed, step, turn, the sequence's place in the *global* batch), so the same global batch
samples the same tokens at any TP/PP/DP layout and on every path: the basis of the
layout-equivalence tests.

Given a ``route_dtype`` (a MoE policy whose routes the trainer can lay per sequence), a generate
(single-turn or multi-turn episodes) also returns the experts every token was routed to
(``RolloutBatch.routes``, :mod:`.route_recording`): R3 replays them, and the trainer compares them
with its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from emapg_megatron import runtime
from emapg_megatron.models.gpt import refresh_quantized_weights
from emapg_megatron.rollout import kv_cache_decoding as kv
from emapg_megatron.rollout.config import SamplerConfig
from emapg_megatron.rollout.decoders import (
    DecodeStats,
    Sampling,
    decode_path,
    whole_history_forward,
)
from emapg_megatron.rollout.engine import (
    RolloutBatch,
    build_rollout_batch,
)
from emapg_megatron.rollout.episodes import Turn, answer, pack_episodes, start_episodes
from emapg_megatron.rollout.route_recording import batch_routes
from emapg_megatron.rollout.sampling import sample_from_logits


@dataclass
class Continued:
    """Partial rollouts: each continued sequence's turn (its tokens and log-probs, old and new;
    finish reason "" while unfinished) and what the decoding cost."""

    turns: list[Turn]
    stats: DecodeStats
    routes: list | None = None
    """With a MoE policy's routes recorded: each sequence's ``[positions fed, layers, k]`` routes
    of this call's forwards (its prompt and carried tokens were prefilled again: all of them),
    None for a sequence not fed; None without recording."""


class MegatronSampler:
    def __init__(self, model_chunks, cfg: SamplerConfig, *, vocab_size: int, eos_id: int | None,
                 pad_id: int, seq_length: int, micro_batch_size: int, seed: int, tokenizer=None,
                 route_dtype=None):
        """``cfg`` resolved (:meth:`SamplerConfig.resolved`): the decode path is chosen here, once.
        ``route_dtype``: record a MoE policy's routes in that dtype (None: none)."""
        self.model_chunks = model_chunks
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.seed = seed
        self.tokenizer = tokenizer  # decodes turns for stop strings and environments
        self.route_dtype = route_dtype
        self.micro_batch_size = micro_batch_size
        self.decoder = decode_path(cfg, model_chunks, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                   vocab_size=vocab_size, pad_id=pad_id, draw=self._draw,
                                   route_dtype=route_dtype)

    def update_weights(self, model_chunks) -> None:
        """The live model's weights moved (an update, a load): nothing to copy, but TE's FP8 layers
        must cast them again before this sampler's forwards, which run outside Megatron's schedule."""
        self.model_chunks = model_chunks
        refresh_quantized_weights(model_chunks)

    def metrics(self) -> dict:
        return {}  # no weight sync; each generate's decoding cost comes back with its batch

    def idle_stats(self) -> DecodeStats:
        """What a step that decodes nothing costs (partial rollouts: enough groups were complete)."""
        return self.decoder.new_stats()

    # --- drawing tokens ------------------------------------------------------------------
    def _uniforms(self, rng_step: int, turn: int, row: int, width: int) -> list[float]:
        """``width`` host uniforms keyed by the global sequence index ``row``: one host generator
        per row (the same numbers on any device), whose draws do not depend on how many are taken,
        so the same numbers for any layout or batch width."""
        key = ((self.seed * 1_000_003 + rng_step) * 1009 + turn) * 1_000_033 + row
        return torch.rand(width, generator=torch.Generator().manual_seed(key % 2**63)).tolist()

    def _draw(self, logits, due: list[kv.Stream], sampling: Sampling):
        """Ids and sampler log-probs of the due rows' ``[S, V]`` logits on the last stage, on
        every stage's host."""
        device = runtime.device()
        # host floats, one transfer per step (a device tensor per row would cost an op each)
        uniforms = torch.tensor([s.uniforms[len(s.turn.token_ids)] for s in due], device=device)
        ids = torch.zeros(len(due), dtype=torch.long, device=device)
        lp = torch.zeros(len(due), device=device)
        if logits is not None:  # only the real vocabulary, never Megatron's padding ids
            ids, lp = sample_from_logits(logits[:, :self.vocab_size], uniforms, sampling.temperature,
                                         sampling.top_p)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            for t in (ids, lp):
                dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
        both = torch.stack([ids.double(), lp.double()]).cpu()  # one device-to-host copy (exact)
        return both[0].long().tolist(), both[1].float().tolist()

    # --- a turn's bookkeeping ------------------------------------------------------------
    def _record_step(self, due: list[kv.Stream], tokens: list[int], lps: list[float], stop) -> list[bool]:
        """Append each stream's sampled token to its history and its turn; True where the turn
        is finished (eos, a stop string, which is kept, or its budget)."""
        ended = []
        for s, token, lp in zip(due, tokens, lps):
            s.known.append(int(token))
            s.turn.token_ids.append(int(token))
            s.turn.logprobs.append(float(lp))
            ended.append(self._finished(s.turn, s.budget, stop))
        return ended

    def _finished(self, turn: Turn, budget: int, stop) -> bool:
        if self.eos_id is not None and turn.token_ids[-1] == self.eos_id:
            turn.finish_reason = "stop"
            return True
        if stop and self.tokenizer is not None:
            text = self.tokenizer.decode(turn.token_ids)
            if any(text.endswith(s) for s in stop):
                turn.finish_reason = "stop"
                return True
        if len(turn.token_ids) >= budget:
            turn.finish_reason = "length"
            return True
        return False

    def _close(self, turn: Turn) -> Turn:
        turn.text = self.tokenizer.decode(turn.token_ids) if self.tokenizer else ""
        return turn

    def _check_room(self, histories, budgets: list[int]) -> None:
        if any(len(h) == 0 for h in histories):
            raise ValueError("an empty prompt: every sequence needs at least one token to continue")
        if max((len(h) + b for h, b in zip(histories, budgets)), default=0) > self.seq_length:
            raise ValueError(f"prompt + new tokens exceed --seq-length {self.seq_length}")

    def _run(self, streams: list[kv.Stream], advance, sampling: Sampling, stats: DecodeStats,
             halted=None) -> list[kv.Stream]:
        return self.decoder.run(self.model_chunks, streams, advance, sampling, stats, halted)

    # --- the engine's calls --------------------------------------------------------------
    def generate(self, prompts, n: int, temperature: float, top_p: float, max_new_tokens: int,
                 *, stop: Sequence[str] | None = None, rng_step: int = 0,
                 seq_index: Sequence[int] | None = None) -> RolloutBatch:
        """``n`` samples of each prompt (prompt-major); ``seq_index``: each sequence's index in the
        global batch (keys its randomness). The batch's ``stats`` say what decoding cost."""
        S = len(prompts) * n
        rows = list(seq_index) if seq_index is not None else list(range(S))
        streams, stats = self._decode([prompts[s // n] for s in range(S)], [max_new_tokens] * S, rows,
                                      Sampling(temperature, top_p), rng_step=rng_step, stop=stop)
        turns = [s.turn for s in streams]
        batch = build_rollout_batch(prompts, [t.token_ids for t in turns], [t.logprobs for t in turns],
                                    self.seq_length, self.pad_id, n)
        batch.stats = stats
        # a sequence's history is its batch row from position 0: its trace lies where its tokens do
        batch.routes = batch_routes([s.trace for s in streams], batch.tokens.shape[1])
        return batch

    def decode_turns(self, histories, budgets: list[int], rows: list[int], sampling: Sampling, *,
                     rng_step: int = 0, stop: Sequence[str] | None = None) -> tuple[list[Turn], DecodeStats]:
        """One turn per history, each up to its own budget, its uniforms keyed by its global index
        in ``rows``: the single-turn decoding :meth:`generate` runs; and what it cost."""
        streams, stats = self._decode(histories, budgets, rows, sampling, rng_step=rng_step, stop=stop)
        return [s.turn for s in streams], stats

    def _decode(self, histories, budgets: list[int], rows: list[int], sampling: Sampling, *,
                rng_step: int = 0, stop: Sequence[str] | None = None) -> tuple[list[kv.Stream], DecodeStats]:
        """:meth:`decode_turns`' streams (each with its turn closed and its route trace)."""
        self._check_room(histories, budgets)
        streams = [kv.Stream(s, list(h), b, self._uniforms(rng_step, 0, row, b))
                   for s, (h, b, row) in enumerate(zip(histories, budgets, rows))]

        def advance(due, tokens, lps):
            return [kv.DONE if end else kv.CONTINUE for end in self._record_step(due, tokens, lps, stop)]

        stats = self.decoder.new_stats()
        self._run([s for s in streams if s.budget > 0], advance, sampling, stats)
        for s in streams:
            self._close(s.turn)
        return streams, stats

    def continue_sequences(self, seqs, *, temperature: float, top_p: float, max_new_tokens: int,
                           stop: Sequence[str] | None = None, enough=None, agree=None) -> Continued:
        """Partial rollouts: continue each of ``seqs`` (``.prompt``, the ``.tokens`` and
        ``.logprobs`` it has, ``.rng_step`` and ``.row`` keying its uniforms) up to
        ``max_new_tokens`` tokens in all (a continued sequence is prefilled again with its prompt
        and tokens). With ``enough(finished)`` (a flag per sequence) the decoding stops after the
        first step where it is True; a turn left unfinished has finish reason "".

        Across data-parallel ranks (each continuing its share of one pool), ``agree(finished,
        busy)`` returns the pool's flags and whether any rank has sequences left, and ``enough``
        judges the pool's flags: every rank stops after the same step (the fixed-shape path).

        A sequence's token t always takes uniform t of its key, so continuing it under unchanged
        weights samples what one uninterrupted generate of it would.
        """
        if self.decoder.name == "recompute":
            raise ValueError("partial rollouts continue sequences through the KV-cached paths only")
        self._check_room([list(q.prompt) for q in seqs], [max_new_tokens] * len(seqs))
        streams = [kv.Stream(i, list(q.prompt) + list(q.tokens), max_new_tokens,
                             self._uniforms(q.rng_step, 0, q.row, max_new_tokens),
                             Turn(list(q.tokens), list(q.logprobs), ""))
                   for i, q in enumerate(seqs)]
        finished = [False] * len(streams)

        def advance(due, tokens, lps):
            ended = self._record_step(due, tokens, lps, stop)
            for s, end in zip(due, ended):
                finished[s.key] = end
            return [kv.DONE if end else kv.CONTINUE for end in ended]

        def halted(busy: bool) -> bool:
            flags, anyone = (finished, busy) if agree is None else agree(finished, busy)
            return not anyone or (enough is not None and enough(flags))

        stats = self.decoder.new_stats()
        live = [s for s in streams if len(s.turn.token_ids) < max_new_tokens]
        self._run(live, advance, Sampling(temperature, top_p), stats, halted)
        routes = [s.trace.routes() for s in streams] if self.route_dtype is not None else None
        return Continued([self._close(s.turn) for s in streams], stats, routes)

    def route_histories(self, histories) -> list[torch.Tensor]:
        """The routes one cache-free forward of each whole history takes now, ``[len(h), layers,
        k]`` each: for R3, the routes of a sequence no forward of this step fed (a partial
        rollout finished at an earlier step). A collective over the model-parallel group."""
        histories = [list(h) for h in histories]  # (split into micro-batches by the forward itself)
        _, routes = whole_history_forward(self.model_chunks, histories, seq_length=self.seq_length,
                                          micro_batch_size=self.micro_batch_size, pad_id=self.pad_id,
                                          route_dtype=self.route_dtype)
        return [routes[i, :len(h)].cpu() for i, h in enumerate(histories)]

    def generate_episodes(self, prompts, n: int, envs, *, tokenizer, temperature: float, top_p: float,
                          max_new_tokens: int, stop: Sequence[str] | None = None, rng_step: int = 0,
                          seq_index: Sequence[int] | None = None):
        """Multi-turn rollouts: ``(batch, episodes)``. Each sequence runs its own turns; its
        observation tokens are fed like its prompt (on the cached paths, the cache grows across
        turns). A turn's uniforms are keyed by its turn number and each environment sees only
        its own sequence, so the samples do not depend on the path or on which turns end together."""
        index = list(seq_index) if seq_index is not None else list(range(len(envs)))
        episodes = start_episodes(prompts, n, envs, tokenizer=tokenizer, top_p=top_p,
                                  seq_length=self.seq_length)
        group = ps.get_model_parallel_group()

        def next_turn(stream, turn_index):
            """The stream's next turn, or None when its episode is over."""
            ep = episodes[stream.key]
            while not ep.done:
                budget = ep.turn_budget(max_new_tokens)
                if budget > 0:
                    stream.known, stream.budget, stream.turn_index = ep.history(), budget, turn_index
                    stream.uniforms = self._uniforms(rng_step, turn_index, index[stream.key], budget)
                    stream.turn = Turn([], [], "")
                    return stream
                answer([ep], [self._close(Turn([], [], ""))], group)  # no room left: an empty turn
                turn_index += 1
            return None

        def advance(due, tokens, lps):
            ended = self._record_step(due, tokens, lps, stop)
            over = [s for s, end in zip(due, ended) if end]
            if over:  # the step's finished turns answer together: one agreement, same order
                answer([episodes[s.key] for s in over], [self._close(s.turn) for s in over], group)
            return [kv.CONTINUE if not end or next_turn(s, s.turn_index + 1) else kv.DONE
                    for s, end in zip(due, ended)]

        every = [kv.Stream(s, [], 0, []) for s in range(len(episodes))]
        streams = [s for s in (next_turn(s, 0) for s in every) if s is not None]
        stats, sampling = self.decoder.new_stats(), Sampling(temperature, top_p)
        while streams:  # a stream whose environment rewrote cached tokens restarts in a new cache
            streams = self._run(streams, advance, sampling, stats)
        batch = pack_episodes(episodes, n, self.seq_length, self.pad_id)
        batch.stats = stats
        # an episode's row is its history (prompt, turns, observations) from position 0, as fed; a
        # rewritten history was refed, so its trace holds the routes of the tokens the row keeps
        batch.routes = batch_routes([s.trace for s in every], batch.tokens.shape[1])
        return batch, episodes
