"""The built-in sampler's three decode paths: one is chosen once, from the sampler's config and
the model (:func:`decode_path`), and runs every generate, multi-turn episode and continuation.

Each runs a set of :class:`~emapg_megatron.rollout.kv_cache_decoding.Stream` s until every one
is done, through the same per-sequence protocol (an ``advance`` callback records a step's tokens
and says of each row whether it continues, is done or must restart in a fresh cache), so the
sampler's bookkeeping is written once:

* :class:`RecomputeDecode` feeds each live sequence whole through the forward-only pipeline
  schedule at every step (no cache): the simple reference the cached paths are tested against,
  and what sequence parallelism falls back to (``--no-rollout-kv-cache``).
* :class:`LockstepDecode` decodes through Megatron-Core's static inference context
  (:mod:`.kv_cache_decoding`) in waves of :func:`~.kv_cache_decoding.cache_rows` (the default).
* :class:`FixedShapeDecode` decodes with the fixed-shape step (:mod:`.static_decode`), its slots
  continuously batched (:mod:`.continuous_batching`), optionally replayed as CUDA graphs
  (``--inference-fixed-shape-decode``).

A path returns what its decoding cost in a :class:`DecodeStats`, never leaves it on itself.
Given a ``route_dtype`` (a MoE policy at a layout whose routes lie per sequence), every path
records the routes of each token it feeds into the token's stream (``Stream.trace``,
:mod:`.route_recording`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from emapg_megatron import runtime
from emapg_megatron.models.routing_replay import ROUTES, recording_routers, router_replays
from emapg_megatron.rollout import kv_cache_decoding as kv
from emapg_megatron.rollout.config import SamplerConfig
from emapg_megatron.rollout.continuous_batching import ScheduleStats, SlotScheduler
from emapg_megatron.rollout.route_recording import write_rows
from emapg_megatron.rollout.static_decode import StaticDecoder
from emapg_megatron.training.microbatches import split_microbatches
from emapg_megatron.training.schedule import forward_only


@dataclass
class Sampling:
    """How the next token is drawn: temperature and top-p (the uniforms come with each stream)."""

    temperature: float
    top_p: float


#: ``draw(logits or None, due streams, sampling) -> (ids, log-probs)``: the sampler's draw of one
#: token per due stream, the same on every rank (logits exist on the last pipeline stage only).
Draw = Callable[[torch.Tensor | None, list, Sampling], tuple[list[int], list[float]]]


@dataclass
class DecodeStats:
    """What one generate (or continuation) cost, in machine-independent counts."""

    path: str
    """The decode path that ran (:data:`PATHS`)."""
    rows_fed: list[int] = field(default_factory=list)
    """Rows of each forward (finished rows cost nothing on the cached paths)."""
    cache_waves: int = 0
    """Caches run (the fixed-shape path runs one)."""
    schedule: ScheduleStats | None = None
    """The fixed-shape path's decode and prefill forwards and live slots."""
    graph_memory: int = 0
    """Bytes the fixed-shape path's CUDA graphs reserved."""

    def forwards(self) -> int:
        """Model forwards: decode steps and prefills."""
        if self.schedule is not None:
            return self.schedule.decode_forwards + self.schedule.prefill_forwards
        return len(self.rows_fed)

    def metrics(self) -> dict:
        """The step's rollout metrics (none for the recompute reference)."""
        if self.path == "recompute":
            return {}
        out = {"rollout_cache_waves": self.cache_waves}
        if self.schedule is not None:
            out.update(rollout_decode_forwards=self.schedule.decode_forwards,
                       rollout_prefill_forwards=self.schedule.prefill_forwards,
                       rollout_mean_live_slots=self.schedule.mean_live_slots,
                       rollout_graph_memory_mb=self.graph_memory / 2**20)
        return out


class DecodePath(Protocol):
    name: str

    def new_stats(self) -> DecodeStats:
        """Nothing decoded yet, in this path's counters."""

    def run(self, chunks: list, streams: list[kv.Stream], advance, sampling: Sampling,
            stats: DecodeStats, halted=None) -> list[kv.Stream]:
        """Decode ``streams`` until each is done (``advance`` says DONE), adding the cost to
        ``stats``; returns the streams that must restart in a fresh cache. ``halted(busy)`` True
        stops the decoding (partial rollouts: what was sampled stays; ``busy``: whether this
        rank has streams left)."""


class RecomputeDecode:
    """Every step feeds each live sequence whole (right-padded to ``--seq-length``) through the
    forward-only pipeline schedule and samples its next token: no cache, no restarts."""

    name = "recompute"

    def new_stats(self) -> DecodeStats:
        return DecodeStats(self.name)

    def __init__(self, *, seq_length: int, micro_batch_size: int, pad_id: int, draw: Draw,
                 route_dtype: torch.dtype | None = None):
        self.seq_length, self.micro_batch_size, self.pad_id = seq_length, micro_batch_size, pad_id
        self.draw, self.route_dtype = draw, route_dtype

    def run(self, chunks, streams, advance, sampling, stats, halted=None):
        active = list(streams)
        while active and not (halted is not None and halted(True)):
            histories = [s.known for s in active]
            logits, routes = self._next_token_logits(chunks, histories)
            if routes is not None:  # each step routes every history whole: the last one wins
                write_rows([s.trace for s in active], [0] * len(active), [len(h) for h in histories], routes)
            stats.rows_fed.append(len(active))
            ids, lps = self.draw(logits, active, sampling)
            status = advance(active, ids, lps)  # a new turn's history is fed whole next step
            active = [s for s, st in zip(active, status) if st != kv.DONE]
        return []

    def _next_token_logits(self, chunks, histories: list[list[int]]):
        return whole_history_forward(chunks, histories, seq_length=self.seq_length,
                                     micro_batch_size=self.micro_batch_size, pad_id=self.pad_id,
                                     route_dtype=self.route_dtype)


def whole_history_forward(chunks, histories: list[list[int]], *, seq_length: int, micro_batch_size: int,
                          pad_id: int, route_dtype: torch.dtype | None = None):
    """One cache-free forward of each history, right-padded to ``seq_length``: the full-vocabulary
    logits at its last position (last PP stage only, else None), and with ``route_dtype`` the
    routes of every position, ``[S, seq_length, layers, k]`` (else None)."""
    def pick(logits_shard, mb):
        rows = torch.arange(logits_shard.shape[0], device=logits_shard.device)
        return {"logits": gather_from_tensor_model_parallel_region(logits_shard[rows, mb["lengths"] - 1])}

    S, size = len(histories), min(micro_batch_size, len(histories))
    tokens = torch.full((S, seq_length), pad_id, dtype=torch.long)
    for s, h in enumerate(histories):
        tokens[s, :len(h)] = torch.as_tensor(h)
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    rows = torch.cat([torch.arange(S), torch.zeros(-S % size, dtype=torch.long)])  # equal micro-batches
    device = runtime.device()
    mbs = split_microbatches({"tokens": tokens[rows].to(device), "lengths": lengths[rows].to(device)}, size)
    outs = forward_only(chunks, mbs, pick, record_routes=route_dtype)
    if not outs:
        return None, None
    routes = torch.cat([o[ROUTES] for o in outs])[:S] if route_dtype is not None else None
    return torch.cat([o["logits"] for o in outs])[:S], routes


class LockstepDecode:
    """Megatron-Core's static inference context, in waves of cache rows (see
    :mod:`.kv_cache_decoding`)."""

    name = "lockstep"

    def new_stats(self) -> DecodeStats:
        return DecodeStats(self.name)

    def __init__(self, *, seq_length: int, max_requests: int | None, max_forward_tokens: int | None,
                 draw: Draw, route_dtype: torch.dtype | None = None):
        self.seq_length, self.max_requests = seq_length, max_requests
        self.max_forward_tokens, self.draw, self.route_dtype = max_forward_tokens, draw, route_dtype

    def run(self, chunks, streams, advance, sampling, stats, halted=None):
        model, restart = chunks[0], []
        size = kv.cache_rows(model, len(streams), self.seq_length, self.max_requests)
        stop = None if halted is None else (lambda: halted(True))  # one rank: it has rows left
        for start in range(0, len(streams), size):
            if stop is not None and stop():
                break
            restart += kv.decode_lockstep(model, streams[start:start + size], self.seq_length,
                                          lambda logits, due: self.draw(logits, due, sampling), advance,
                                          rows_fed=stats.rows_fed, max_forward_tokens=self.max_forward_tokens,
                                          halted=stop, route_dtype=self.route_dtype)
            stats.cache_waves += 1
        return restart


class FixedShapeDecode:
    """The fixed-shape step's slots (as many as a wave's cache rows), continuously batched;
    a restart happens in its own slot, so none is returned."""

    name = "fixed-shape"

    def new_stats(self) -> DecodeStats:
        return DecodeStats(self.name, cache_waves=1, schedule=ScheduleStats())

    def __init__(self, *, seq_length: int, vocab_size: int, max_requests: int | None,
                 cuda_graphs: bool, schedule: str, route_dtype: torch.dtype | None = None):
        self.seq_length, self.vocab_size, self.max_requests = seq_length, vocab_size, max_requests
        self.cuda_graphs, self.schedule, self.route_dtype = cuda_graphs, schedule, route_dtype

    def run(self, chunks, streams, advance, sampling, stats, halted=None):
        model = chunks[0]
        slots = kv.cache_rows(model, len(streams), self.seq_length, self.max_requests)
        was_training = model.training
        model.eval()
        # the routers record from before the graphs' capture: the captured steps copy their routes
        replays = router_replays(model) if self.route_dtype is not None else []
        try:
            with torch.no_grad(), recording_routers(replays):  # graphs too: eval mode, no autograd
                decoder = StaticDecoder(model, slots, self.seq_length, self.vocab_size, sampling.temperature,
                                        sampling.top_p, cuda_graphs=self.cuda_graphs, route_dtype=self.route_dtype)
                stats.graph_memory = decoder.graphs.memory_bytes if decoder.graphs is not None else 0
                SlotScheduler(decoder, advance, self.schedule, stats.schedule).run(streams, halted)
        finally:
            model.train(was_training)
        return []


PATHS = (RecomputeDecode.name, LockstepDecode.name, FixedShapeDecode.name)


def decode_path(cfg: SamplerConfig, chunks, *, seq_length: int, micro_batch_size: int, vocab_size: int,
                pad_id: int, draw: Draw, route_dtype: torch.dtype | None = None) -> DecodePath:
    """The path ``cfg`` (resolved: :meth:`SamplerConfig.resolved`) asks for, where the model
    allows it: without a KV cache, or under what the cached forward does not support (it says
    why, once), the recompute reference. ``route_dtype``: record a MoE model's routes in it."""
    why = kv.cache_supported(chunks) if cfg.kv_cache else None
    if why is not None:
        warnings.warn(f"KV-cached sampling is off under {why}: recomputing each step", stacklevel=2)
    if not cfg.kv_cache or why is not None:
        return RecomputeDecode(seq_length=seq_length, micro_batch_size=micro_batch_size, pad_id=pad_id,
                               draw=draw, route_dtype=route_dtype)
    if cfg.fixed_shape:
        return FixedShapeDecode(seq_length=seq_length, vocab_size=vocab_size, max_requests=cfg.max_requests,
                                cuda_graphs=graphs_on(cfg), schedule=cfg.schedule, route_dtype=route_dtype)
    return LockstepDecode(seq_length=seq_length, max_requests=cfg.max_requests,
                          max_forward_tokens=cfg.forward_token_limit, draw=draw, route_dtype=route_dtype)


def graphs_on(cfg: SamplerConfig) -> bool:
    """CUDA graphs of the fixed-shape step: on a GPU, one pipeline stage (stages exchange hidden
    states between steps, outside any graph), unless turned off."""
    return (cfg.cuda_graphs is not False and runtime.hardware() == "cuda"
            and ps.get_pipeline_model_parallel_world_size() == 1)
