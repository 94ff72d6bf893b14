"""Sequence packing: micro-batches of whole sequences under a token budget, no compute on padding.

A padded batch (``[S, L]`` per-token tensors, ``[S]`` per-sequence ones, right padding) is split
by :func:`plan` into micro-batches of sequences whose token counts stay under a budget, with the
same number of micro-batches on every DP rank (Megatron's schedule runs them in lockstep) and
token loads balanced between them. :func:`pack` lays each micro-batch out as one token row
``[1, T]`` with per-sequence positions; the model sees the sequence boundaries through

* Transformer Engine: ``PackedSeqParams`` (THD layout, ``cu_seqlens``): Megatron's own path,
  attention and RoPE restart at every boundary;
* the local spec (CPU): a block-diagonal causal mask, and RoPE taken at the per-sequence positions
  (GPTModel ignores ``position_ids`` under RoPE, see :func:`rope_at`): the same arithmetic.

:meth:`PackedRow.model_inputs` picks one from the model. Per-token outputs come back to ``[S, L]``
with :func:`unpack`; inside a loss, :meth:`PackedRow.per_sequence` lays packed per-token values out
per sequence so every aggregation (token-mean, seq-mean-token-sum, ...) is the padded one.
Normalisers stay those of the padded batch: packing only moves tokens between micro-batches.
:class:`PackedBatches` is this module as a micro-batching strategy (``training.microbatches``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams

from emapg_megatron.models.gpt import has_local_attention, unwrap
from emapg_megatron.training.collectives import gather_ragged

ROW_MULTIPLE = 8
"""Packed rows are a multiple of this x TP tokens: sequence parallelism splits a row over TP, and
FP8 GEMMs need token counts that are multiples of 8."""


@dataclass
class PackedRow:
    """The layout of a packed micro-batch: where its sequences lie in its ``[1, T]`` row (``rows``:
    their indices in the batch) and what the model must be told of their boundaries."""

    rows: list[int]
    lengths: list[int]

    @property
    def used(self) -> int:
        return sum(self.lengths)

    def model_inputs(self, model, mb: dict) -> dict:
        """Keyword args of ``schedule.model_output``: THD params for Transformer Engine, a block
        mask for the local spec; per-sequence positions for both."""
        if not has_local_attention(model):
            return {"position_ids": mb["position_ids"], "packed_seq_params": thd_params(mb["cu_seqlens"])}
        return {"position_ids": mb["position_ids"],
                "attention_mask": block_causal_mask(mb["cu_seqlens"], mb["tokens"].shape[1])}

    def per_sequence(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Packed ``[1, T, ...]`` per-token values as ``[n, max_len, ...]`` (differentiable, zero
        padded, None kept): for the per-sequence aggregation of the loss. Per-token scalars are
        cheap to move, while the vocabulary-sized work stays on packed tokens."""
        width = max(self.lengths, default=1)
        device = next(t.device for t in tensors if t is not None)
        dst = token_index(list(range(len(self.rows))), self.lengths, width, device)

        def one(t):
            if t is None:
                return None
            src = t[0, :self.used]
            flat = src.new_zeros(len(self.rows) * width, *src.shape[1:]).index_copy(0, dst, src)
            return flat.view(len(self.rows), width, *src.shape[1:])

        return tuple(one(t) for t in tensors)


@dataclass
class PackPlan:
    """This rank's micro-batches (lists of batch rows) and the shapes they are packed to."""

    groups: list[list[int]]
    lengths: list[int]
    """Tokens of each of the batch's sequences (what the model must see)."""
    shape: tuple[int, int]
    """``(S, L)`` of the padded batch."""
    row_tokens: list[int]
    """Packed row length of each micro-batch (all equal under pipeline parallelism)."""

    @property
    def padding_fraction(self) -> float:
        """Share of the packed rows' token slots that hold no sequence token."""
        real = sum(self.lengths[i] for g in self.groups for i in g)
        return 1.0 - real / max(sum(self.row_tokens), 1)

    def split(self, batch: dict) -> list[dict]:
        return pack(batch, self)

    def merge(self, outputs: list[dict], microbatches: list[dict]) -> dict:
        return unpack(outputs, microbatches, self.shape)


@dataclass
class PackedBatches:
    """``--sequence-packing``: whole sequences packed into rows of at most ``token_budget`` tokens."""

    token_budget: int

    def plan(self, batch: dict) -> PackPlan:
        return plan(batch, self.token_budget)


# --- the planner (pure) -----------------------------------------------------------------------
def sequence_lengths(mask: torch.Tensor) -> list[int]:
    """Tokens a sequence needs: up to the label of its last loss position (``mask`` is the
    label-aligned loss mask, so position p predicts token p + 1). Later tokens (padding, a final
    observation) change no loss term: attention is causal."""
    S, L = mask.shape
    pos = torch.arange(L, device=mask.device).expand(S, L)
    last = torch.where(mask != 0, pos, torch.full_like(pos, -1)).max(dim=1).values
    return (last + 2).clamp(1, L).tolist()


def balanced_bins(lengths: list[int], n_bins: int, budget: int) -> list[list[int]] | None:
    """Longest-first into the least-loaded bin that fits ``budget``; None if one does not fit.

    Balancing the loads (not only filling bins) keeps pipeline micro-batches alike: the schedule
    runs them in lockstep and pads them to one shape.
    """
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(n_bins) if loads[b] + lengths[i] <= budget]
        if not fits:
            return None
        b = min(fits, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def plan_microbatches(lengths_by_rank: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Per DP rank, the same number of micro-batches (lists of that rank's sequence indices), each
    at most ``max_tokens`` tokens (a longer sequence gets a micro-batch of its own), fewest first.

    Deterministic in its input, so every rank computes the same plan from the gathered lengths.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    budget = max([max_tokens, *(n for ls in lengths_by_rank for n in ls)])
    n = max([1, *(math.ceil(sum(ls) / budget) for ls in lengths_by_rank)])
    while True:  # ends: with one bin per sequence everything fits
        plans = [balanced_bins(ls, n, budget) for ls in lengths_by_rank]
        if all(p is not None for p in plans):
            return plans
        n += 1


def row_tokens(loads: list[int], multiple: int, uniform: bool) -> list[int]:
    """Packed row lengths: each load rounded up to ``multiple``, or all the largest (``uniform``)."""
    rows = [max(multiple, -(-n // multiple) * multiple) for n in loads]
    return [max(rows)] * len(rows) if uniform and rows else rows


# --- planning on the ranks ----------------------------------------------------------------------
def plan(batch: dict, max_tokens: int, *, lengths: list[int] | None = None) -> PackPlan:
    """This rank's plan for ``batch`` (this DP rank's padded batch; collective over DP).

    DP ranks may hold different numbers of sequences and pass different budgets: the plan uses
    the largest budget, so every rank computes the same plan. Rows are padded to one length
    under pipeline parallelism, where the schedule sends one activation shape.
    """
    S, L = batch["tokens"].shape
    lengths = sequence_lengths(batch["mask"]) if lengths is None else list(lengths)
    per_rank = [t.tolist() for t in gather_ragged(torch.tensor([max_tokens, *lengths], dtype=torch.int64),
                                                  ps.get_data_parallel_group())]
    budget, per_rank = max(r[0] for r in per_rank), [r[1:] for r in per_rank]
    plans = plan_microbatches(per_rank, budget)
    loads = [sum(ls[i] for i in g) for ls, p in zip(per_rank, plans) for g in p]
    multiple = ROW_MULTIPLE * ps.get_tensor_model_parallel_world_size()
    uniform = ps.get_pipeline_model_parallel_world_size() > 1
    rows = row_tokens(loads, multiple, uniform)
    mine = ps.get_data_parallel_rank()
    n = len(plans[mine])
    return PackPlan(groups=plans[mine], lengths=lengths, shape=(S, L),
                    row_tokens=rows[mine * n:(mine + 1) * n])


# --- packing and unpacking ---------------------------------------------------------------------
def token_index(rows: list[int], lengths: list[int], L: int, device) -> torch.Tensor:
    """Flat indices into ``[S * L]`` of the first ``lengths[k]`` entries of each row ``rows[k]``,
    in that order: a micro-batch's tokens in packed order."""
    parts = [r * L + torch.arange(n, device=device) for r, n in zip(rows, lengths)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _segments(layout: PackedRow, T: int) -> list[int]:
    """Segment lengths of a packed row: the sequences, then the padding as one more segment."""
    return layout.lengths + ([T - layout.used] if T > layout.used else [])


def pack_one(batch: dict, layout: PackedRow, T: int) -> dict:
    """One micro-batch as a ``[1, T]`` row: per-token ``[S, L, ...]`` values packed (zero padding),
    per-sequence ``[S, ...]`` values selected, None kept; plus ``position_ids``, ``cu_seqlens``
    (padding is a last segment of its own) and its ``layout``."""
    S, L = batch["tokens"].shape
    device = batch["tokens"].device
    idx = token_index(layout.rows, layout.lengths, L, device)
    rows = torch.tensor(layout.rows, dtype=torch.long, device=device)
    mb = {}
    for k, v in batch.items():
        if v is None:
            mb[k] = None
        elif v.dim() >= 2 and tuple(v.shape[:2]) == (S, L):
            flat = v.reshape(S * L, *v.shape[2:])[idx]
            mb[k] = torch.cat([flat, flat.new_zeros(T - len(idx), *v.shape[2:])]).unsqueeze(0)
        else:
            mb[k] = v[rows]
    seg = _segments(layout, T)
    mb["position_ids"] = torch.cat([torch.arange(n, device=device) for n in seg]).unsqueeze(0)
    mb["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(seg)], dtype=torch.int32, device=device)
    mb["layout"] = layout
    return mb


def pack(batch: dict, p: PackPlan) -> list[dict]:
    """The plan's micro-batches of ``batch``, ready for ``forward_only`` / ``forward_backward``."""
    return [pack_one(batch, PackedRow(g, [p.lengths[i] for i in g]), T)
            for g, T in zip(p.groups, p.row_tokens)]


def unpack(outputs: list[dict], microbatches: list[dict], shape: tuple[int, int]) -> dict:
    """Per-token outputs ``[1, T, ...]`` of packed micro-batches back to ``[S, L, ...]`` (zero where
    no token was computed). ``{}`` off the last pipeline stage, where there are no outputs."""
    if not outputs:
        return {}
    S, L = shape
    out = {}
    for k, first in outputs[0].items():
        full = first.new_zeros(S * L, *first.shape[2:])
        for o, mb in zip(outputs, microbatches):
            layout = mb["layout"]
            full[token_index(layout.rows, layout.lengths, L, full.device)] = o[k][0, :layout.used]
        out[k] = full.view(S, L, *first.shape[2:])
    return out


# --- what the model is given ----------------------------------------------------------------------
def block_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is masked: causal within each segment only."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                  (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    pos = torch.arange(T, device=cu_seqlens.device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, T, T)


def thd_params(cu_seqlens: torch.Tensor):
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def slow_thd_attention(cudnn_version: int | None, flash_attn: bool, gqa: bool) -> str | None:
    """Why Transformer Engine would run packed (THD) attention on its unfused backend, which pads
    every segment to the longest (slow, memory-hungry), or None. TE's cuDNN backend takes THD with
    a padding mask from cuDNN 9.1, and with GQA from 9.6 (9.10.0 and 9.10.1 are excluded);
    FlashAttention takes THD with GQA when installed (TE 2.11, ``get_attention_backend``)."""
    if flash_attn:
        return None
    need = 90600 if gqa else 90100
    v = cudnn_version or 0
    if v >= need and v not in (91000, 91001):
        return None
    found = f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100}" if v else "no cuDNN"
    return (f"--sequence-packing on Transformer Engine: {found} and no flash-attn, so TE runs packed "
            f"attention unfused (padded per segment, slow); install cuDNN >= "
            f"{'9.6' if gqa else '9.1'} (not 9.10.0/9.10.1) or flash-attn")


def local_attention_cost(budget: int, micro_batch_size: int, seq_length: int) -> str | None:
    """Why packing on the local spec may run out of memory, or None. Its attention over a packed
    row of T tokens holds a [T, T] mask and [heads, T, T] scores: T² per row, where a padded
    micro-batch holds ``micro_batch_size`` x ``seq_length``² (TE's THD path holds neither)."""
    ratio = budget**2 / (micro_batch_size * seq_length**2)
    if ratio <= 1:
        return None
    return (f"--sequence-packing on the local spec: a packed row of {budget} tokens attends through "
            f"a [T, T] block mask and scores, {ratio:.0f}x the attention memory of a padded "
            f"micro-batch; use Transformer Engine (THD) or a smaller --max-tokens-per-microbatch")


@contextlib.contextmanager
def rope_at(model, position_ids: torch.Tensor | None):
    """Rotary embeddings taken at ``position_ids`` (one row) instead of ``0..T-1``.

    GPTModel builds RoPE from the sequence length alone and uses ``position_ids`` only for learned
    position embeddings; THD packing restarts RoPE per segment inside TE, the local spec needs this.
    """
    rope = getattr(unwrap(model), "rotary_pos_emb", None)
    if position_ids is None or rope is None:
        yield
        return
    index = position_ids[0]
    handle = rope.register_forward_hook(lambda module, args, freqs: freqs[index])
    try:
        yield
    finally:
        handle.remove()
