"""KV-cached decoding for the built-in sampler, on Megatron-Core's static inference path.

Megatron-Core keeps the cache: a :class:`StaticInferenceContext` holds every layer's keys and
values, its attention layers append to it, and :class:`GPTInferenceWrapper` runs the forward
(pipeline stages exchange hidden states through ``inference.communication_utils``; TP ranks
get gathered logits). Nothing here computes attention or stores keys.

The static context has one write offset for the whole batch, so the sequences advance in
lockstep, as in Megatron's own static text generation: the first forward prefills the
shortest history, then each forward appends ``c`` tokens to every row, where a row's next
tokens are the rest of its history (prompt, observations) when it has one, else the token it
just sampled. Every token thus sits at its own position (no padding, no attention mask), so
the logits are those of the cache-free recompute up to rounding. ``c`` is the smallest number
of known tokens any row has left (a chunk), or 1 when a row is decoding; chunks after the
prefill need an explicit causal mask, which only Megatron's local attention takes (TE's drops
it at a non-zero offset), so under TE they go one token at a time.

A row whose sequence is finished leaves the batch at once: the live rows' cache entries move
to the front of Megatron's cache, in place, so only they are fed.

The static cache is allocated whole (every row, every position up to ``--seq-length``), so a
rank's sequences go through it in waves of :func:`cache_rows`: ``--inference-max-requests``
(Megatron-LM's flag) when given, else as many as fit in free GPU memory (all of them on CPU).
Waves change nothing sampled: a sequence's uniforms are keyed by its global index. A forward of
more than ``--inference-batch-times-seqlen-threshold`` tokens (a long prefill of many rows) runs
in micro-batches of rows, each written to its own rows of the cache, so its activations stay
bounded (:meth:`CachedForward.forward_in_row_batches`; Megatron-Core 0.19 has no such path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from emapg_megatron import mcore_compat, runtime
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.gpt import has_local_attention
from emapg_megatron.models.routing_replay import recording_routers, router_replays
from emapg_megatron.rollout.episodes import Turn
from emapg_megatron.rollout.route_recording import RouteTrace, recorded_routes, write_rows

#: Share of the free GPU memory the cache of one wave may take (the rest: activations, logits).
CACHE_MEMORY_FRACTION = 0.8

# What an ``advance`` callback says about each row after its sampled token.
CONTINUE, DONE, RESTART = "continue", "done", "restart"


@dataclass
class Stream:
    """One sequence being continued: ``known`` holds its history and the tokens it sampled;
    the first ``fed`` of them (the cohort's offset) are in the cache."""

    key: int  # the caller's index of the sequence
    known: list[int]
    budget: int
    uniforms: list[float]  # the current turn's uniforms, one per token
    turn: Turn = field(default_factory=lambda: Turn([], [], ""))
    turn_index: int = 0
    trace: RouteTrace = field(default_factory=RouteTrace)  # the routes it was fed with (MoE)


def cache_supported(model_chunks) -> str | None:
    """Why the cached path cannot run this model (None when it can)."""
    if len(model_chunks) != 1:
        return "virtual pipeline stages (Megatron's inference wrapper takes one model chunk)"
    if get_model_config(model_chunks[0]).sequence_parallel:
        return "sequence parallelism (Megatron's static inference does not support it)"
    return None


def cache_bytes_per_row(model, max_len: int) -> int:
    """Bytes of Megatron's static cache per sequence on this rank: keys and values of this
    stage's layers at ``max_len`` positions, as ``Attention._allocate_memory`` sizes them."""
    cfg = get_model_config(model)
    layers = len(get_attr_wrapped_model(model, "decoder").layers)
    groups = (cfg.num_query_groups or cfg.num_attention_heads) // ps.get_tensor_model_parallel_world_size()
    itemsize = torch.empty((), dtype=cfg.params_dtype).element_size()
    return 2 * layers * max_len * groups * cfg.kv_channels * itemsize


def rows_per_cache(rows: int, max_requests: int | None = None, fit: int | None = None) -> int:
    """Sequences per cache: ``max_requests`` when set, else ``fit`` (None: no limit), never more
    than ``rows``."""
    rows = max(rows, 1)
    if max_requests:
        return min(rows, max_requests)
    return rows if fit is None else min(rows, fit)


def rows_that_fit(bytes_per_row: int, free_bytes: int) -> int:
    """Caches of this many sequences take at most :data:`CACHE_MEMORY_FRACTION` of ``free_bytes``."""
    return int(free_bytes * CACHE_MEMORY_FRACTION) // bytes_per_row


def free_device_bytes() -> int | None:
    """Free GPU memory, counting what PyTorch's allocator holds unused; None on CPU."""
    if runtime.hardware() != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def cache_rows(model, rows: int, max_len: int, max_requests: int | None = None) -> int:
    """:func:`rows_per_cache` for this rank. Sized by free memory, it is the smallest fit over the
    model-parallel group (its ranks run the same forwards), and when one rank has no room for a
    single sequence every rank raises (none is left waiting in a collective)."""
    free = None if max_requests else free_device_bytes()
    if free is None:
        return rows_per_cache(rows, max_requests)
    per_row = cache_bytes_per_row(model, max_len)
    fit = own = rows_that_fit(per_row, free)
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        t = torch.tensor([fit], device=runtime.device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        fit = int(t.item())
    if fit < 1:
        where = "" if own < 1 else " on another rank of this model-parallel group"
        raise ConfigError(
            f"the KV cache of one sequence ({per_row / 2**30:.2f} GiB up to --seq-length) does not "
            f"fit in {CACHE_MEMORY_FRACTION:.0%} of the free GPU memory{where} (here "
            f"{free / 2**30:.2f} GiB): lower --seq-length, add tensor or pipeline parallelism, or "
            f"sample with --no-rollout-kv-cache or --rollout-engine vllm")
    return rows_per_cache(rows, fit=fit)


class CachedForward:
    """Forwards through one Megatron static inference context (the cache) of ``max_batch``
    rows and ``max_len`` positions; returns the last position's full-vocabulary logits on the
    last pipeline stage, None elsewhere, and with ``route_dtype`` the routes a MoE model's
    routers took for every fed token, ``[rows, width, layers, k]`` (else None)."""

    def __init__(self, model, max_batch: int, max_len: int, max_forward_tokens: int | None = None,
                 route_dtype: torch.dtype | None = None):
        cfg = get_model_config(model)
        self.max_forward_tokens = max_forward_tokens  # rows x width above it: row micro-batches
        self.context = StaticInferenceContext(max_batch, max_len)
        # Megatron's DDP wrapper adds nothing to a forward without grad, and lacks the
        # set_input_tensor that the wrapper calls on its model.
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        self.wrapper = mcore_compat.gpt_inference_wrapper(inner, self.context, cfg, _output_size(model))
        # TE drops a mask at an offset; Megatron's fused masked softmax takes only square scores.
        local = has_local_attention(model)
        self.chunks_after_prefill = local and not cfg.masked_softmax_fusion
        # A one-position forward at a row offset gives TE a contiguous cache slice that does not
        # start its storage, which TE's layout check refuses ("qkv memory layout is not
        # supported", seen on an H100): under TE such forwards (one position per row) run whole.
        self.split_single_positions = local
        self.rows_fed: list[int] = []  # rows per forward: finished rows cost nothing
        self.replays = router_replays(inner) if route_dtype is not None else []
        self.route_dtype = route_dtype

    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        offset, width = self.context.sequence_len_offset, tokens.shape[1]
        device = runtime.device()
        mask = None
        if offset > 0 and width > 1:  # a chunk after the prefill: causal within the chunk
            mask = torch.ones(width, offset + width, dtype=torch.bool, device=device)
            mask = mask.triu(offset + 1).view(1, 1, width, offset + width)  # True = hidden
        positions = torch.arange(offset, offset + width, device=device).expand_as(tokens)
        inputs = {"tokens": tokens.to(device), "position_ids": positions, "attention_mask": mask}
        self.rows_fed.append(tokens.shape[0])
        # The wrapper's run_one_forward_step runs under inference_mode; plain no_grad keeps the
        # cache and Megatron's shared attention buffer ordinary tensors for the training passes.
        # With PP=1 these forwards have no pipeline neighbours. A prefill of many rows runs in
        # micro-batches of rows, which bounds its activation memory.
        if self.max_forward_tokens and tokens.numel() > self.max_forward_tokens and (
                offset + width > 1 or self.split_single_positions):
            return self.forward_in_row_batches(inputs)
        return self._last_logits(inputs)

    def _last_logits(self, inputs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward: the last position's logits (last stage) and the routes it took."""
        with recording_routers(self.replays):  # nothing to record: a no-op
            logits = mcore_compat.forward_whole_batch(self.wrapper, inputs)
            routes = recorded_routes(self.replays, *inputs["tokens"].shape, self.route_dtype) \
                if self.replays else None
        return None if logits is None else logits[:, -1], routes

    def forward_in_row_batches(self, inputs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`__call__` in micro-batches of as many rows as fit in ``max_forward_tokens``
        (at least one). Each writes its rows of the cache (the context's batch offset) at the
        same positions; the pipeline stages run the micro-batches one after another."""
        tokens, offset = inputs["tokens"], self.context.sequence_len_offset
        rows = max(1, self.max_forward_tokens // tokens.shape[1])
        last = []
        for start in range(0, tokens.shape[0], rows):
            self.context.sequence_len_offset, self.context.batch_size_offset = offset, start
            part = {key: value if key == "attention_mask" else value[start:start + rows]
                    for key, value in inputs.items()}  # one mask for every row
            last.append(self._last_logits(part))
        self.context.batch_size_offset = 0  # the offset stays advanced past this forward
        logits, routes = zip(*last)
        return (None if logits[0] is None else torch.cat(logits),
                None if routes[0] is None else torch.cat(routes))

    def keep_rows(self, keep: list[int]) -> None:
        """Move cache rows ``keep`` (live rows, ascending) to the front, in order.

        Megatron's ``swap_key_value_dict`` permutes the whole static cache (every position of
        every row) at each finishing step; only the live rows' filled positions are ever read
        again, so only those move, in place in Megatron's own cache tensors.
        """
        if not keep or keep == list(range(len(keep))) or not self.context.key_value_memory_dict:
            return  # the live rows already lead: rows past them are never read
        rows = torch.as_tensor(keep, device=runtime.device())
        filled = self.context.sequence_len_offset
        for cache in self.context.key_value_memory_dict.values():
            for t in cache:  # keys, values: [positions, batch, heads, head_dim]
                t[:filled, :len(keep)] = t[:filled, rows]  # the right side is a copy: no overlap


def _output_size(model) -> int:
    return get_attr_wrapped_model(model, "vocab_size")


def decode_lockstep(model, streams: list[Stream], max_len: int,
                    sample: Callable[[torch.Tensor | None, list[Stream]], tuple[list[int], list[float]]],
                    advance: Callable[[list[Stream], list[int], list[float]], list[str]], *,
                    rows_fed: list[int] | None = None, max_forward_tokens: int | None = None,
                    halted: Callable[[], bool] | None = None,
                    route_dtype: torch.dtype | None = None) -> list[Stream]:
    """Continue ``streams`` in one cache until every one is done.

    ``sample(logits_or_None, due)`` draws the next token of each row in ``due`` (the same
    answer on every rank); ``advance(due, tokens, logprobs)`` records them, all of one step at
    once (a multi-turn caller lets the environments of every turn that ended answer together),
    and says of each row whether it continues (its ``known`` may grow by a whole observation),
    is done, or must restart in a fresh cache because its new history rewrites tokens already
    cached. Returns the latter. ``halted()`` True after a step stops the decoding there (partial
    rollouts: the rows left keep what they sampled). With ``route_dtype`` a MoE model's routes
    of every fed token go into its stream's ``trace`` (``rollout.route_recording``).
    """
    if not streams:
        return []
    forward = CachedForward(model, len(streams), max_len, max_forward_tokens, route_dtype)
    was_training = model.training
    forward.wrapper.prep_model_for_inference()  # eval mode (inference attention), context reset
    active, restart, fed = list(streams), [], 0
    try:
        with torch.no_grad():
            while active and not (halted and halted()):
                tokens = _next_tokens(active, fed, forward.chunks_after_prefill)
                logits, routes = forward(tokens)
                if routes is not None:  # lockstep: every row fed its tokens at the same offset
                    write_rows([s.trace for s in active], [fed] * len(active), [tokens.shape[1]] * len(active),
                               routes)
                fed = forward.context.sequence_len_offset
                status = _advance_due(active, fed, logits, sample, advance)
                restart += [s for s, st in zip(active, status) if st == RESTART]
                keep = [i for i, st in enumerate(status) if st == CONTINUE]
                forward.keep_rows(keep)
                active = [active[i] for i in keep]
    finally:
        model.train(was_training)
    if rows_fed is not None:
        rows_fed += forward.rows_fed
    return restart


def _next_tokens(active: list[Stream], fed: int, chunks_ok: bool) -> torch.Tensor:
    """Every row's next ``width`` known tokens: all rows have at least one (a row that sampled
    has its token to feed), a whole chunk when they all have more history left."""
    left = min(len(s.known) - fed for s in active)
    width = left if fed == 0 or chunks_ok else 1
    return torch.tensor([s.known[fed:fed + width] for s in active], dtype=torch.long)


def _advance_due(active: list[Stream], fed: int, logits, sample, advance) -> list[str]:
    """Sample the rows whose known tokens are all cached; the others keep feeding history."""
    status = [CONTINUE] * len(active)
    due = [i for i, s in enumerate(active) if len(s.known) == fed]
    if not due:
        return status
    rows = [active[i] for i in due]
    ids, lps = sample(None if logits is None else logits[due], rows)
    known = [s.known for s in rows]  # advance appends to them, or replaces them at a turn's end
    for i, row, before, st in zip(due, rows, known, advance(rows, ids, lps)):
        status[i] = RESTART if st == CONTINUE and _needs_restart(before, row.known, fed) else st
    return status


def _needs_restart(before: list[int], after: list[int], fed: int) -> bool:
    """Whether a row's new history cannot continue its cache: it rewrote tokens the cache holds
    (the environment cut a turn after fed tokens), or it has no token left to feed. Compared
    only when the history was replaced: an append keeps the cached prefix (no O(L) copy per
    token)."""
    return len(after) <= fed or (after is not before and after[:fed] != before[:fed])
