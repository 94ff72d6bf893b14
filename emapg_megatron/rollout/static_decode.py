"""Fixed-shape decoding: a static KV cache of ``[slots, max_len]`` per layer, for the built-in
sampler (``--inference-fixed-shape-decode``).

Megatron-Core's static inference context slices its cache to the current length at every step,
so the shapes of a decode step change with each token and no step can be captured as a CUDA
graph; and it has one write offset for the whole batch, so its rows advance in lockstep. Here
each slot has its own length, held on the device with the tokens to feed, and a decode step
always has the same shapes: every slot of a bucket feeds one token at its own position, attends
over the whole cache under a length mask (torch SDPA), and samples on the device. Nothing in a
step synchronises with the host, so on a GPU the step of each bucket is captured once as a CUDA
graph and replayed (:class:`DecodeGraphs`).

The forward is Megatron's own modules of the model (embedding, each layer's norms, QKV and
output projections, q/k norms, MLP, bias-dropout-add, the final norm and the output layer with
its TP gather), run by hand around the attention: only the cache and the attention kernel are
ours, so the local and the Transformer Engine specs run alike (under TE the norms are fused into
the linear layers and ``input_layernorm`` is the identity). Pipeline stages pass hidden states
with Megatron's inference send/recv; the sampled tokens go from the last stage to every stage.

A slot's history (prompt, later an observation of a multi-turn episode, or a partial rollout's
carried sequence) is fed eagerly, every slot that waits for one in the same forward
(:meth:`StaticDecoder.extend`, right-padded), at any offset in its own cache row, with a causal
mask: this is the prefill of continuous batching (:mod:`.continuous_batching`), and it stays
outside the graphs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.inference.communication_utils import (
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from emapg_megatron import runtime
from emapg_megatron.models.routing_replay import layers_to_routes, router_replays
from emapg_megatron.rollout.route_recording import fill_routes
from emapg_megatron.rollout.sampling import sample_from_logits

UNUSED_UNIFORM = 0.5  # what an empty slot of a bucket samples with (its token is never read)


def bucket_sizes(slots: int) -> list[int]:
    """Batch sizes a decode step runs at: powers of two below ``slots``, and ``slots``. A step
    covers the slots below the highest live one, rounded up to a bucket, so a shrinking tail of
    live sequences costs less without a shape per count."""
    return sorted({2**i for i in range(max(slots - 1, 0).bit_length()) if 2**i < slots} | {slots})


def bucket_for(highest_live: int, buckets: list[int]) -> int:
    """The smallest bucket covering slots ``0..highest_live``."""
    return next(b for b in buckets if b > highest_live)


def length_mask(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[b, 1, s, max_len]`` SDPA mask (True = attend): the query at position ``p`` sees cache
    positions ``0..p``. For a decode step that is the slot's length; for a fed chunk, causal."""
    keys = torch.arange(max_len, device=positions.device)
    return (keys <= positions.unsqueeze(-1)).unsqueeze(1)


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary angles ``[s, b, 1, dim]`` of ``[b, s]`` positions from Megatron's ``[L, 1, 1, dim]``
    table: each row at its own position, gathered on the device."""
    return table[positions.t()].squeeze(-2)


class StaticKVCache:
    """Keys and values of this stage's layers: ``[slots, max_len, groups, head_dim]`` each,
    allocated once (zeros: masked positions must hold finite numbers, since SDPA multiplies them
    by a zero weight)."""

    def __init__(self, layers: int, slots: int, max_len: int, groups: int, head_dim: int, dtype, device):
        shape = (slots, max_len, groups, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def store(self, layer: int, rows, positions: torch.Tensor, key, value, span: int):
        """Write ``[s, b, groups, dim]`` keys/values at each row's positions; returns the rows'
        first ``span`` cache positions as SDPA takes them, ``[b, groups, span, dim]``. ``rows``: a
        slice (a decode step's bucket, a view) or a tensor of slots (a batched prefill, a gather)."""
        out = []
        for cache, new in ((self.keys[layer], key), (self.values[layer], value)):
            if isinstance(rows, slice):
                view = cache[rows]
                index = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
                view[index, positions] = new.transpose(0, 1)
            else:
                cache[rows.unsqueeze(1), positions] = new.transpose(0, 1)
                view = cache[rows]
            out.append(view[:, :span].transpose(1, 2))
        return out


class StaticDecoder:
    """Fixed-shape decoding through one model chunk (this rank's stage) over ``slots`` cache rows.

    Device state: ``tokens`` (each slot's sampled token, fed by the next step), ``lengths``
    (tokens cached), ``live`` (1 where a sequence occupies the slot) and ``uniforms``. The host
    keeps ``fed``, its copy of ``lengths``. ``extend`` feeds a slot's history, ``step`` runs one
    decode step over a bucket; both sample and return host ids and log-probs (every rank).

    With ``route_dtype`` (a MoE model whose routers record: ``routing_replay.recording_routers``
    around the decoder's life, its graph capture included) every forward also writes the routes
    of each fed token into ``route_cache`` ``[slots, max_len, layers, k]`` at the token's slot and
    position, on the device (inside the graphs too); :meth:`routes_of` reads a slot's back.
    """

    def __init__(self, model, slots: int, max_len: int, vocab_size: int, temperature: float,
                 top_p: float, *, cuda_graphs: bool = False, route_dtype: torch.dtype | None = None):
        self.gpt = get_attr_wrapped_model(model, "decoder", return_model_obj=True)
        self.cfg = get_model_config(model)
        self.layers = list(self.gpt.decoder.layers)
        self.slots, self.max_len, self.vocab_size = slots, max_len, vocab_size
        self.temperature, self.top_p = temperature, top_p
        self.buckets = bucket_sizes(slots)
        # Eager steps attend over the cache up to the longest live sequence, rounded up to one of
        # these spans (attention over the whole cache would dominate a long budget's early
        # steps); a CUDA graph attends over the whole cache, one shape per batch bucket.
        self.spans = bucket_sizes(max_len)
        device = runtime.device()
        groups = (self.cfg.num_query_groups or self.cfg.num_attention_heads) // \
            ps.get_tensor_model_parallel_world_size()
        self.cache = StaticKVCache(len(self.layers), slots, max_len, groups, self.cfg.kv_channels,
                                   self.cfg.params_dtype, device)
        self.rope = self.gpt.rotary_pos_emb(max_len).to(device)  # [max_len, 1, 1, dim]
        self.scale = self.cfg.softmax_scale or 1 / math.sqrt(self.cfg.kv_channels)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.long, device=device)
        self.uniforms = torch.full((slots,), UNUSED_UNIFORM, device=device)
        self.out = torch.zeros(2, slots, dtype=torch.float64, device=device)  # ids, log-probs
        self.fed = [0] * slots
        self.replays = router_replays(model) if route_dtype is not None else []
        self.route_cache = fill_routes(max_len, len(self.replays), self.cfg.moe_router_topk, route_dtype) \
            .expand(slots, -1, -1, -1).to(device).contiguous() if self.replays else None
        self.graphs = DecodeGraphs(self._decode_step, self.buckets) if cuda_graphs else None

    # --- the forward -----------------------------------------------------------------------
    def _attention(self, index: int, attn, x, rows, positions, rope, mask):
        query, key, value = attn.get_query_key_value_tensors(x)  # [s, b, heads, dim]; q/k norms
        query = apply_rotary_pos_emb(query, rope, config=self.cfg)
        key = apply_rotary_pos_emb(key, rope, config=self.cfg)
        keys, values = self.cache.store(index, rows, positions, key, value, mask.shape[-1])
        ctx = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)  # [b, heads, s, dim]
        s, b = x.shape[:2]
        return attn.linear_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _layer(self, index: int, layer, h, rows, positions, rope, mask):
        """One transformer layer, as Megatron's ``TransformerLayer`` composes it (inference)."""
        fused = self.cfg.bias_dropout_fusion
        out = self._attention(index, layer.self_attention, layer.input_layernorm(h), rows, positions,
                              rope, mask)
        h = layer.self_attn_bda(False, fused)(out, h, layer.hidden_dropout)
        out = layer.mlp(layer.pre_mlp_layernorm(h))
        return layer.mlp_bda(False, fused)(out, h, layer.hidden_dropout)

    def _stage(self, tokens: torch.Tensor, rows, positions: torch.Tensor, span: int,
               last: torch.Tensor | None = None):
        """This stage's part of a forward of ``[b, s]`` tokens at ``[b, s]`` positions into cache
        rows ``rows``, attending over the first ``span`` cache positions: the logits of each row's
        position ``last`` (default: the last one) over the real vocabulary on the last stage
        (TP-gathered), None elsewhere."""
        if self.gpt.pre_process:
            h = self.gpt.embedding(input_ids=tokens, position_ids=None)
        else:
            h = torch.empty(*positions.t().shape, self.cfg.hidden_size, dtype=self.cfg.params_dtype,
                            device=positions.device)
            recv_from_prev_pipeline_rank_(h)
        rope, mask = rope_at(self.rope, positions), length_mask(positions, span)
        for index, layer in enumerate(self.layers):
            h = self._layer(index, layer, h, rows, positions, rope, mask)
        if self.route_cache is not None:
            self._store_routes(rows, positions)
        if not self.gpt.post_process:
            send_to_next_pipeline_rank(h)
            return None
        # the norm and the head act per position: only each row's last is needed
        h = h[-1:] if last is None else h[last, torch.arange(h.shape[1], device=h.device)].unsqueeze(0)
        if self.gpt.decoder.final_layernorm is not None:
            h = self.gpt.decoder.final_layernorm(h)
        weight = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights \
            else None
        logits, _ = self.gpt.output_layer(h, weight=weight, runtime_gather_output=True)
        return logits[0, :, :self.vocab_size]

    def _store_routes(self, rows, positions: torch.Tensor) -> None:
        """The routes the forward just took, at each fed token's slot and position (a pad
        query's land past its row's length, where nothing reads them)."""
        b, s = positions.shape
        routes = layers_to_routes([r.get_recorded_indices() for r in self.replays], b, s,
                                  self.route_cache.dtype)
        if isinstance(rows, slice):
            index = torch.arange(b, device=positions.device).unsqueeze(1)
            self.route_cache[rows][index, positions] = routes
        else:
            self.route_cache[rows.unsqueeze(1), positions] = routes

    def routes_of(self, slot: int) -> torch.Tensor | None:
        """``[fed, layers, k]``: the routes of the slot's cached tokens (None: not recording)."""
        return None if self.route_cache is None else self.route_cache[slot, :self.fed[slot]].cpu()

    def _sample(self, logits, uniforms: torch.Tensor) -> torch.Tensor:
        """``[2, b]`` float64 (ids, log-probs; exact for both) on every rank: sampled on the last
        stage, broadcast to the others (the first stage feeds the ids next)."""
        if logits is None:
            both = torch.zeros(2, uniforms.shape[0], dtype=torch.float64, device=uniforms.device)
        else:
            ids, lps = sample_from_logits(logits, uniforms, self.temperature, self.top_p)
            both = torch.stack([ids.double(), lps.double()])
        if ps.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(both, src=ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        return both

    def _decode_step(self, n: int, span: int | None = None) -> None:
        """Slots ``0..n-1`` each feed their token at their own length and sample the next,
        attending over the first ``span`` positions (default: the whole cache): fixed shapes,
        device tensors only (what a CUDA graph captures). Empty slots compute too; their length
        does not move (their position is clamped into the cache) and nothing reads them."""
        positions = self.lengths[:n].clamp_max(self.max_len - 1).unsqueeze(1)
        both = self._sample(self._stage(self.tokens[:n].unsqueeze(1), slice(0, n), positions,
                                        span or self.max_len), self.uniforms[:n])
        self.tokens[:n].copy_(both[0].long())
        self.lengths[:n] += self.live[:n]
        self.out[:, :n].copy_(both)

    # --- the host side ---------------------------------------------------------------------
    def extend(self, slots: list[int], histories: list[list[int]], starts: list[int],
               uniforms: list[float]) -> tuple[list[int], list[float]]:
        """Feed each ``histories[i]`` into ``slots[i]`` at positions ``starts[i]..`` (the slot's
        cache before that is kept), occupy the slots, and sample the token after each: one
        forward, right-padded to the longest history. A pad query writes keys past its row's
        length, which the length mask hides and the next decode step overwrites; rows whose pad
        would run off the cache are fed on their own."""
        width = max(len(h) for h in histories)
        fits = [i for i, (h, st) in enumerate(zip(histories, starts)) if st + width <= self.max_len]
        if len(fits) < len(slots):
            alone = [i for i in range(len(slots)) if i not in set(fits)]
            groups = ([fits] if fits else []) + [[i] for i in alone]
            got = {}
            for g in groups:
                ids, lps = self.extend(*([seq[i] for i in g] for seq in (slots, histories, starts, uniforms)))
                got.update(zip(g, zip(ids, lps)))
            return [got[i][0] for i in range(len(slots))], [got[i][1] for i in range(len(slots))]
        device = self.tokens.device
        tokens = torch.tensor([h + [0] * (width - len(h)) for h in histories], device=device)
        positions = torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(width, device=device)
        lengths = torch.tensor([len(h) for h in histories], device=device)
        index = torch.tensor(slots, device=device)
        span = bucket_for(max(st + len(h) for h, st in zip(histories, starts)) - 1, self.spans)
        logits = self._stage(tokens, index, positions, span, last=lengths - 1)
        both = self._sample(logits, torch.tensor(uniforms, device=device))
        ends = torch.tensor(starts, device=device) + lengths
        self.tokens[index] = both[0].long()
        self.lengths[index] = ends
        self.live[index] = 1
        for slot, end in zip(slots, ends.tolist()):
            self.fed[slot] = end
        ids, lps = both.cpu()
        return ids.long().tolist(), lps.float().tolist()

    def free(self, slot: int) -> None:
        self.live[slot] = 0

    def reset(self) -> None:
        """Free every slot: the decoder, its cache and its captured graphs serve another generate
        call (the graphs read the weights where they are, so an in-place update is seen)."""
        self.live.zero_()
        self.lengths.zero_()
        self.fed = [0] * self.slots

    def step(self, live: list[int], uniforms: list[float]) -> tuple[list[int], list[float]]:
        """One decode step of the live slots (ascending): their sampled ids and log-probs."""
        n = bucket_for(live[-1], self.buckets)
        u = torch.full((n,), UNUSED_UNIFORM)
        u[live] = torch.tensor(uniforms)
        self.uniforms[:n].copy_(u, non_blocking=True)
        if self.graphs is not None:
            self.graphs.replay(n)
        else:
            self._decode_step(n, bucket_for(max(self.fed[slot] for slot in live), self.spans))
        for slot in live:
            self.fed[slot] += 1
        out = self.out[:, :n].cpu()  # the one device-to-host copy of a step, after it
        return out[0, live].long().tolist(), out[1, live].float().tolist()


class DecodeGraphs:
    """The decode step of each bucket, captured once as a CUDA graph (prefill stays eager).

    Captured before any slot is live, largest bucket first, into one memory pool. A capture
    records the addresses of the weights and of the decoder's buffers: the trainer's optimizer
    and the EMA swap write the weights in place, and a decoder lives for one generate call, so
    the graphs stay valid for as long as they are replayed. ``memory_bytes``: what capture
    reserved (the graphs' activations), for the step's metrics.
    """

    def __init__(self, step, buckets: list[int]):
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        # capture empties the allocator's cache first: measure from and to an empty cache (else
        # the figure can come out negative, as it did on an H100)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for n in buckets:
                step(n)
        torch.cuda.current_stream().wait_stream(side)
        for n in sorted(buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                step(n)
            self.graphs[n] = graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved() - before

    def replay(self, n: int) -> None:
        self.graphs[n].replay()
