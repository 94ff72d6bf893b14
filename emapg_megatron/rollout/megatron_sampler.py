"""The built-in sampler: autoregressive generation on the Megatron model itself.

Two paths, the same samples. By default each step feeds only the new tokens through
Megatron-Core's KV-cache inference path (:mod:`emapg_megatron.rollout.kv_cache_decoding`);
``kv_cache=False`` recomputes the full (right-padded) sequence at every step through the
forward-only pipeline schedule, the simple reference the cached path is tested against. Both
run at any TP/PP/DP layout. Meant for CPU runs, tests and GPU runs without vLLM.

Randomness is one uniform number per (sequence, turn, token), drawn from a generator keyed by
(seed, step, turn, the sequence's place in the *global* batch), so the same global batch
samples the same tokens at any TP/PP/DP layout and on either path: the basis of the
layout-equivalence tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from emapg_megatron import runtime
from emapg_megatron.rollout import kv_cache_decoding as kv
from emapg_megatron.rollout.continuous_batching import ScheduleStats, SlotScheduler
from emapg_megatron.rollout.engine import (
    RolloutBatch,
    build_rollout_batch,
    warn_if_truncated_sampling,
)
from emapg_megatron.rollout.episodes import (
    Turn,
    answer,
    pack_episodes,
    run_episodes,
    start_episodes,
)
from emapg_megatron.rollout.sampling import sample_from_logits
from emapg_megatron.rollout.static_decode import StaticDecoder
from emapg_megatron.training.microbatches import split_microbatches
from emapg_megatron.training.schedule import forward_only


class MegatronSampler:
    def __init__(self, model_chunks, *, vocab_size: int, eos_id: int | None, pad_id: int,
                 seq_length: int, micro_batch_size: int, seed: int, tokenizer=None,
                 kv_cache: bool = True, max_requests: int | None = None,
                 max_forward_tokens: int | None = None, fixed_shape: bool | None = None,
                 cuda_graphs: bool | None = None, continuous_batching: bool = True):
        self.model_chunks = model_chunks
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.tokenizer = tokenizer  # decodes turns for stop strings and environments
        self.kv_cache = kv_cache
        self.max_requests = max_requests  # sequences per cache (None: as many as fit)
        self.max_forward_tokens = max_forward_tokens  # cached forwards above it: row micro-batches
        self.rows_fed: list[int] = []  # cached path: rows per forward, over the last generate
        self.cache_waves = 0  # cached path: caches run by the last generate
        # The fixed-shape decode step (opt-in), its CUDA graphs (None: wherever it runs on a GPU
        # at PP=1) and its schedule; see rollout/static_decode.py.
        self.fixed_shape, self.cuda_graphs = fixed_shape, cuda_graphs
        self.schedule = "continuous" if continuous_batching else "waves"
        self.schedule_stats: ScheduleStats | None = None  # fixed-shape path: the last generate's
        self.graph_memory = 0  # bytes the last generate's CUDA graphs reserved

    def update_weights(self, model_chunks) -> None:
        self.model_chunks = model_chunks  # same live model: nothing to copy

    def metrics(self) -> dict:
        if not self.kv_cache:
            return {}
        out = {"rollout_cache_waves": self.cache_waves}
        if self.schedule_stats is not None:
            out.update(rollout_decode_forwards=self.schedule_stats.decode_forwards,
                       rollout_prefill_forwards=self.schedule_stats.prefill_forwards,
                       rollout_mean_live_slots=self.schedule_stats.mean_live_slots,
                       rollout_graph_memory_mb=self.graph_memory / 2**20)
        return out

    def forwards(self) -> int:
        """Model forwards of the last cached generate (decode steps and prefills)."""
        stats = self.schedule_stats
        if self._fixed_shape_on() and stats is not None:
            return stats.decode_forwards + stats.prefill_forwards
        return len(self.rows_fed)

    def _fixed_shape_on(self) -> bool:
        return bool(self.fixed_shape)  # opt-in until it has run on a GPU

    def _graphs_on(self) -> bool:
        """CUDA graphs of the decode step: on a GPU, one pipeline stage (stages exchange hidden
        states between steps, outside any graph), unless turned off."""
        return (self.cuda_graphs is not False and runtime.hardware() == "cuda"
                and ps.get_pipeline_model_parallel_world_size() == 1)

    def _cached(self) -> bool:
        """The cached path when asked for and the model allows it (else the reference)."""
        if not self.kv_cache:
            return False
        why = kv.cache_supported(self.model_chunks)
        if why is not None:
            warnings.warn(f"KV-cached sampling is off under {why}: recomputing each step", stacklevel=3)
        return why is None

    def _next_token_logits(self, tokens: torch.Tensor, lengths: torch.Tensor):
        """Full-vocabulary logits at each sequence's last position (last PP stage only)."""
        def pick(logits_shard, mb):
            rows = torch.arange(logits_shard.shape[0], device=logits_shard.device)
            last = logits_shard[rows, mb["lengths"] - 1]
            return {"logits": gather_from_tensor_model_parallel_region(last)}

        device = runtime.device()
        S, size = tokens.shape[0], min(self.micro_batch_size, tokens.shape[0])
        extra = -S % size  # equal micro-batches: the pipeline's buffers are sized by the first
        rows = torch.cat([torch.arange(S), torch.zeros(extra, dtype=torch.long)])
        mbs = split_microbatches({"tokens": tokens[rows].to(device), "lengths": lengths[rows].to(device)},
                                 size)
        outs = forward_only(self.model_chunks, mbs, pick)
        return torch.cat([o["logits"] for o in outs])[:S] if outs else None

    def _broadcast_from_last_stage(self, *tensors):
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tensors
        src = ps.get_pipeline_model_parallel_last_rank()
        for t in tensors:
            dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
        return tensors

    def _uniforms(self, rng_step: int, turn: int, rows: list[int], width: int) -> torch.Tensor:
        """``[len(rows), width]`` host uniforms, row ``i`` keyed by global sequence index ``rows[i]``.

        One host generator per row (the same numbers on any device), and a generator's draws
        do not depend on how many are taken: the same numbers for any layout or batch width.
        """
        out = torch.empty(len(rows), width)
        for i, row in enumerate(rows):
            key = ((self.seed * 1_000_003 + rng_step) * 1009 + turn) * 1_000_033 + row
            out[i] = torch.rand(width, generator=torch.Generator().manual_seed(key % 2**63))
        return out

    def _sample(self, logits, uniforms: torch.Tensor, temperature: float, top_p: float):
        """Ids and sampler log-probs of ``[S, V]`` logits on the last stage, on every stage's host."""
        device = runtime.device()
        ids = torch.zeros(uniforms.shape[0], dtype=torch.long, device=device)
        lp = torch.zeros(uniforms.shape[0], device=device)
        if logits is not None:  # only the real vocabulary, never Megatron's padding ids
            ids, lp = sample_from_logits(logits[:, :self.vocab_size], uniforms, temperature, top_p)
        self._broadcast_from_last_stage(ids, lp)
        both = torch.stack([ids.double(), lp.double()]).cpu()  # one device-to-host copy (exact)
        return both[0].long(), both[1].float()  # the bookkeeping is per sequence, on the host

    def _record(self, turn: Turn, token: int, logprob: float, budget: int, stop) -> bool:
        """Append a sampled token to its turn; True when the turn is finished."""
        turn.token_ids.append(int(token))
        turn.logprobs.append(float(logprob))
        return self._finished(turn, budget, stop)

    def _record_step(self, due: list[kv.Stream], tokens: list[int], lps: list[float], stop) -> list[bool]:
        """Append each stream's sampled token to its history and its turn; True where the turn
        is finished."""
        for s, tok in zip(due, tokens):
            s.known.append(tok)
        return [self._record(s.turn, tok, lp, s.budget, stop) for s, tok, lp in zip(due, tokens, lps)]

    def _check_room(self, histories, budgets) -> None:
        if any(len(h) == 0 for h in histories):
            raise ValueError("an empty prompt: every sequence needs at least one token to continue")
        if max((len(h) + b for h, b in zip(histories, budgets)), default=0) > self.seq_length:
            raise ValueError(f"prompt + new tokens exceed --seq-length {self.seq_length}")

    def _decode(self, histories, budgets: list[int], uniforms: torch.Tensor, temperature: float,
                top_p: float, stop: Sequence[str] | None) -> list[Turn]:
        """Continue each history by up to its budget; stop at eos or a stop string (kept)."""
        if self._cached():
            return self._decode_cached(histories, budgets, uniforms, temperature, top_p, stop)
        self._check_room(histories, budgets)
        uniforms = uniforms.to(runtime.device())  # one transfer; a column per step
        S = len(histories)
        tokens = torch.full((S, self.seq_length), self.pad_id, dtype=torch.long)
        lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
        for s, h in enumerate(histories):
            tokens[s, :len(h)] = torch.as_tensor(h)
        turns = [Turn([], [], "") for _ in range(S)]
        done = torch.tensor([b <= 0 for b in budgets])
        for t in range(max(budgets, default=0)):
            if bool(done.all()):
                break
            ids, lp = self._sample(self._next_token_logits(tokens, lengths), uniforms[:, t],
                                   temperature, top_p)
            for s in torch.nonzero(~done).flatten().tolist():
                tokens[s, lengths[s]] = ids[s]
                lengths[s] += 1
                done[s] = self._record(turns[s], ids[s], lp[s], budgets[s], stop)
        return [self._close(turn) for turn in turns]

    def _close(self, turn: Turn) -> Turn:
        turn.text = self.tokenizer.decode(turn.token_ids) if self.tokenizer else ""
        return turn

    def _lockstep(self, streams: list[kv.Stream], advance, temperature: float, top_p: float,
                  halted=None):
        """Run ``streams`` through the KV cache, in waves of :func:`kv.cache_rows` (see
        :func:`kv.decode_lockstep`); returns the streams to restart. ``halted(busy)`` True stops
        the decoding (no later wave starts; :meth:`SlotScheduler.run` says what ``busy`` is)."""

        def sample(logits, due):
            # Host floats, one transfer per step (a device tensor per row would cost an op each).
            u = torch.tensor([s.uniforms[len(s.turn.token_ids)] for s in due], device=runtime.device())
            ids, lp = self._sample(logits, u, temperature, top_p)
            return ids.tolist(), lp.tolist()

        if self._fixed_shape_on():
            return self._slots(streams, advance, temperature, top_p, halted)
        model, restart = self.model_chunks[0], []
        size = kv.cache_rows(model, len(streams), self.seq_length, self.max_requests)
        stop = None if halted is None else (lambda: halted(True))  # one rank: it has rows left
        for start in range(0, len(streams), size):
            if stop is not None and stop():
                break
            restart += kv.decode_lockstep(model, streams[start:start + size], self.seq_length, sample,
                                          advance, rows_fed=self.rows_fed,
                                          max_forward_tokens=self.max_forward_tokens, halted=stop)
            self.cache_waves += 1
        return restart

    def _slots(self, streams: list[kv.Stream], advance, temperature: float, top_p: float, halted=None):
        """Run ``streams`` through the fixed-shape decoder's slots (sized as a wave), continuously
        batched; restarts happen in their own slot, so none is returned."""
        model = self.model_chunks[0]
        slots = kv.cache_rows(model, len(streams), self.seq_length, self.max_requests)
        self.schedule_stats, self.cache_waves = ScheduleStats(), 1
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():  # the graphs are captured here too: in eval mode, without autograd
                decoder = StaticDecoder(model, slots, self.seq_length, self.vocab_size, temperature,
                                        top_p, cuda_graphs=self._graphs_on())
                self.graph_memory = decoder.graphs.memory_bytes if decoder.graphs is not None else 0
                SlotScheduler(decoder, advance, self.schedule, self.schedule_stats).run(streams, halted)
        finally:
            model.train(was_training)
        return []

    def _decode_cached(self, histories, budgets, uniforms, temperature, top_p, stop) -> list[Turn]:
        """:meth:`_decode` through the KV cache."""
        self._check_room(histories, budgets)
        rows = uniforms.tolist()
        streams = [kv.Stream(s, list(h), b, rows[s]) for s, (h, b) in enumerate(zip(histories, budgets))]

        def advance(due, tokens, lps):
            return [kv.DONE if end else kv.CONTINUE for end in self._record_step(due, tokens, lps, stop)]

        self.rows_fed.clear()
        self.cache_waves = 0
        self._lockstep([s for s in streams if s.budget > 0], advance, temperature, top_p)
        return [self._close(s.turn) for s in streams]

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

    def generate(self, prompts, n: int, temperature: float, top_p: float, max_new_tokens: int,
                 *, stop: Sequence[str] | None = None, rng_step: int = 0,
                 seq_index: Sequence[int] | None = None) -> RolloutBatch:
        """``seq_index``: each sequence's index in the global batch (keys its randomness)."""
        warn_if_truncated_sampling(top_p)
        S = len(prompts) * n
        histories = [prompts[s // n] for s in range(S)]
        rows = list(seq_index) if seq_index is not None else list(range(S))
        uniforms = self._uniforms(rng_step, 0, rows, max_new_tokens)
        turns = self._decode(histories, [max_new_tokens] * S, uniforms, temperature, top_p, stop)
        return build_rollout_batch(prompts, [t.token_ids for t in turns], [t.logprobs for t in turns],
                                   self.seq_length, self.pad_id, n)

    def continue_sequences(self, seqs, *, temperature: float, top_p: float, max_new_tokens: int,
                           stop: Sequence[str] | None = None, enough=None, agree=None) -> list[Turn]:
        """Partial rollouts: continue each of ``seqs`` (``.prompt``, the ``.tokens`` and
        ``.logprobs`` it has, ``.rng_step`` and ``.row`` keying its uniforms) up to
        ``max_new_tokens`` tokens in all, through the KV cache (a continued sequence is
        re-prefilled with its prompt and tokens). With ``enough(finished)`` (a flag per sequence)
        the decoding stops after the first step where it is True; a turn left unfinished has
        finish reason "". Each turn holds the sequence's tokens and log-probs, old and new.

        Across data-parallel ranks (each continuing its share of one pool), ``agree(finished,
        busy)`` returns the pool's flags and whether any rank has sequences left, and ``enough``
        judges the pool's flags: every rank stops after the same step (the fixed-shape path).

        A sequence's token t always takes uniform t of its key, so continuing it under unchanged
        weights samples what one uninterrupted generate of it would.
        """
        warn_if_truncated_sampling(top_p)
        if not self._cached():
            raise ValueError("partial rollouts continue sequences through the KV-cached path only")
        streams = [kv.Stream(i, list(q.prompt) + list(q.tokens), max_new_tokens,
                             self._uniforms(q.rng_step, 0, [q.row], max_new_tokens)[0].tolist(),
                             Turn(list(q.tokens), list(q.logprobs), ""))
                   for i, q in enumerate(seqs)]
        self._check_room([list(q.prompt) for q in seqs], [max_new_tokens] * len(seqs))
        finished = [False] * len(streams)

        def advance(due, tokens, lps):
            ended = self._record_step(due, tokens, lps, stop)
            for s, end in zip(due, ended):
                finished[s.key] = end
            return [kv.DONE if end else kv.CONTINUE for end in ended]

        def halted(busy: bool) -> bool:
            flags, anyone = (finished, busy) if agree is None else agree(finished, busy)
            return not anyone or (enough is not None and enough(flags))

        self.rows_fed.clear()
        self.cache_waves = 0
        live = [s for s in streams if len(s.turn.token_ids) < max_new_tokens]
        self._lockstep(live, advance, temperature, top_p, halted=halted)
        return [self._close(s.turn) for s in streams]

    def generate_episodes(self, prompts, n: int, envs, *, tokenizer, temperature: float, top_p: float,
                          max_new_tokens: int, stop: Sequence[str] | None = None, rng_step: int = 0,
                          seq_index: Sequence[int] | None = None):
        """Multi-turn rollouts (see :func:`emapg_megatron.rollout.episodes.run_episodes`)."""
        index = list(seq_index) if seq_index is not None else list(range(len(envs)))
        if self._cached():
            return self._episodes_cached(prompts, n, envs, tokenizer, temperature, top_p,
                                         max_new_tokens, stop, rng_step, index)

        def continue_fn(histories, budgets, active, turn):
            uniforms = self._uniforms(rng_step, turn, [index[s] for s in active],
                                      max(budgets, default=1))
            return self._decode(histories, budgets, uniforms, temperature, top_p, stop)

        return run_episodes(continue_fn, prompts, n, envs, tokenizer=tokenizer, top_p=top_p,
                            max_new_tokens=max_new_tokens, seq_length=self.seq_length,
                            pad_id=self.pad_id, group=ps.get_model_parallel_group())

    def _episodes_cached(self, prompts, n, envs, tokenizer, temperature, top_p, max_new_tokens,
                         stop, rng_step, index):
        """Episodes through one KV cache: each sequence runs its own turns, its observation
        tokens are fed like its prompt, so the cache grows across turns. The same samples as
        the round-by-round reference: a turn's uniforms are keyed by its turn number and each
        environment sees only its own sequence."""
        episodes = start_episodes(prompts, n, envs, tokenizer=tokenizer, top_p=top_p,
                                  seq_length=self.seq_length)

        def next_turn(stream, turn_index):
            """The stream's next turn, or None when its episode is over."""
            ep = episodes[stream.key]
            while not ep.done:
                budget = ep.turn_budget(max_new_tokens)
                if budget > 0:
                    stream.known, stream.budget, stream.turn_index = ep.history(), budget, turn_index
                    stream.uniforms = self._uniforms(rng_step, turn_index, [index[stream.key]],
                                                     budget)[0].tolist()
                    stream.turn = Turn([], [], "")
                    return stream
                empty = self._close(Turn([], [], ""))  # as the reference: an empty turn
                answer([ep], [empty], ps.get_model_parallel_group())
                turn_index += 1
            return None

        def advance(due, tokens, lps):
            ended = self._record_step(due, tokens, lps, stop)
            over = [s for s, end in zip(due, ended) if end]
            if over:  # the step's finished turns answer together: one agreement, same order
                answer([episodes[s.key] for s in over], [self._close(s.turn) for s in over],
                       ps.get_model_parallel_group())
            return [kv.CONTINUE if not end or next_turn(s, s.turn_index + 1) else kv.DONE
                    for s, end in zip(due, ended)]

        streams = [next_turn(kv.Stream(s, [], 0, []), 0) for s in range(len(episodes))]
        streams = [s for s in streams if s is not None]
        self.rows_fed.clear()
        self.cache_waves = 0
        while streams:  # a stream whose environment rewrote cached tokens restarts in a new cache
            streams = self._lockstep(streams, advance, temperature, top_p)
        return pack_episodes(episodes, n, self.seq_length, self.pad_id), episodes
