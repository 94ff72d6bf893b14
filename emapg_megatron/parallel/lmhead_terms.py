"""The output layer fused into the policy-terms op: from the final hidden states, never the logits.

Megatron's output layer turns the final hidden states ``h`` (after the final norm) into vocab-sharded
logits ``z = h W^T``, ``W [V/TP, H]`` this rank's rows of the output weight (of the word embedding
when tied). Here the logits exist one chunk of tokens at a time: a chunk is formed (``h_c W^T`` in
the weight's dtype, as the output layer computes it), goes through the chunk maths of the logits
ops (:func:`.vocab_parallel.forward_pass`: log-probs at the token and at q, top-k, entropy,
log-normaliser, ONE all-gather per call) and is dropped. Backward recomputes each chunk's logits,
forms their gradient as :mod:`.policy_terms` does, then ``dh_c = dz_c W`` and ``dW += dz_c^T h_c``
(``dz`` in the weight's dtype, as the unfused output layer sees it; ``dW`` summed over chunks in fp32).

Saved for backward: the hidden states (the weight is a parameter, alive anyway), the ids (k + 1
int64), the global max, the log-normaliser and the entropy: ``H elt + 8 k + 21`` bytes per token
whatever V (the logits op saves a ``[V/TP]`` logits row per token on top of the output layer's own).
The price is one more ``h W^T`` GEMM (the recompute).

Tensor parallelism, as ColumnParallelLinear: ``dh`` is a partial sum over this rank's columns, summed
over the group by Megatron's mappings, ``copy_to_tensor_model_parallel_region`` (all-reduce in
backward) or, under sequence parallelism (``h`` sharded along the sequence),
``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward). ``dW`` is
complete on each rank. Tied weights need nothing here: the gradient lands in the embedding weight,
and Megatron's ``finalize_model_grads`` sums it over the first and last pipeline stages.

Layout: ``h [T, H]`` with per-token inputs and outputs ``[T, ...]``, or Megatron's ``[S, B, H]`` with
per-token inputs and outputs ``[B, S, ...]`` (the layout of the logits GPTModel returns); under
sequence parallelism ``h`` is this rank's ``[S/TP, B, H]`` / ``[T/TP, H]``. See
:mod:`emapg_megatron.models.hidden_output` for getting ``h`` and ``W`` out of GPTModel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .policy_terms import (
    PolicyTerms,
    empty_if_none,
    policy_terms_of,
    recompute_logit_grad,
    row_index_of,
    select_rows,
    to_all_rows,
    token_ids,
    upstream_grads,
)
from .vocab_parallel import (
    VocabShard,
    check_k,
    chunk_rows,
    compute_dtype,
    forward_pass,
    iter_chunks,
    picked_ids,
    put_rows,
    shard_of,
    take_rows,
)

# Tokens per chunk at least, by default: each chunk is an M-row GEMM, and below a few hundred rows it
# loses efficiency (CPU, 1 thread: 65-row chunks, the logits ops' default at V = 32000, cost ~30% more
# per FLOP); the chunk's fp32 work buffer is then larger than the logits ops' budget.
_MIN_GEMM_ROWS = 256

__all__ = ["LMHeadScores", "lmhead_policy_terms", "lmhead_scores"]


class LMHeadScores(NamedTuple):
    """No-grad outputs, replicated on every TP rank (fp32; fp64 for fp64 inputs)."""

    logprob: Optional[torch.Tensor]  # at the given ids, their shape; -inf at padding ids
    topk_ids: Optional[torch.Tensor]  # [..., k] int64, by decreasing log-prob
    topk_logprob: Optional[torch.Tensor]  # [..., k]
    lse: torch.Tensor  # [...] log-normaliser over the real vocabulary


def output_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h W^T`` as ColumnParallelLinear computes it (its dtype: the logits the unfused path sees)."""
    return torch.matmul(h, w.t())


def accumulate_wgrad(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += dz^T h``: one GEMM into ``acc`` when dtypes agree, else a GEMM in the operands' dtype
    added into the fp32 ``acc`` (each chunk rounded once, never the running sum)."""
    if acc.dtype == dz.dtype:
        acc.addmm_(dz.t(), h)
    else:
        acc.add_(dz.t() @ h)


class HiddenRows:
    """The chunk source of :func:`.vocab_parallel.forward_pass` that forms each chunk's logits from
    ``h`` and ``W`` (its real rows): always a private buffer in the compute dtype."""

    def __init__(self, hidden2d: torch.Tensor, weight: torch.Tensor, sh: VocabShard):
        self.hidden = hidden2d
        self.weight = weight[: sh.n_real]
        self.cdt = compute_dtype(hidden2d)
        self.n_rows = hidden2d.shape[0]
        self.device = hidden2d.device

    def chunk(self, rows):
        return output_logits(take_rows(self.hidden, rows), self.weight).to(self.cdt), True


@dataclass(frozen=True)
class _Plan:
    shard: VocabShard
    group: object
    rows_per_chunk: int
    entropy: bool


class _LMHeadTermsFn(torch.autograd.Function):
    """``(h [N, H], W [V/TP, H]) -> (logprob_all [N, 1 + k], entropy [N] or empty)``; saved state is
    per selected (unmasked) row, in selection order."""

    @staticmethod
    def forward(ctx, hidden2d, weight, ids2d, valid, plan: _Plan):
        row_index, ids_sel = select_rows(ids2d, valid)
        res = forward_pass(HiddenRows(hidden2d, weight, plan.shard), ids_sel, plan.shard, plan.group,
                           rows_per_chunk=plan.rows_per_chunk, row_index=row_index, entropy=plan.entropy)
        n = ids2d.shape[0]
        ctx.plan = plan
        ctx.save_for_backward(hidden2d, weight, ids_sel, valid, res.shift, res.lse_rel, res.entropy)
        ctx.set_materialize_grads(False)
        return to_all_rows(res.logprob, row_index, n), empty_if_none(to_all_rows(res.entropy, row_index, n),
                                                                     res.lse_rel)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden2d, weight, ids, valid, shift, lse, ent = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        plan, sh = ctx.plan, ctx.plan.shard
        src = HiddenRows(hidden2d, weight, sh)
        # Masked rows and padding columns keep their zero gradient.
        dh = torch.zeros_like(hidden2d) if want_h else None
        dw = torch.zeros(weight.shape, dtype=compute_dtype(weight), device=weight.device) if want_w else None
        if sh.n_real > 0:
            row_index = row_index_of(valid)
            up = upstream_grads(g_lp, g_ent, ids, row_index, sh, src.cdt)
            for sel, rows in iter_chunks(ids.shape[0], plan.rows_per_chunk, row_index):
                z, _ = src.chunk(rows)
                dz = recompute_logit_grad(z, None, up, sel, shift, lse, ent).to(weight.dtype)
                if want_h:
                    put_rows(dh, rows, dz @ src.weight)
                if want_w:
                    accumulate_wgrad(dw[: sh.n_real], dz, take_rows(hidden2d, rows))
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None


class _Rows(NamedTuple):
    """The hidden states of every token this rank scores, as rows, and how per-token tensors map to them."""

    hidden2d: torch.Tensor  # [N, H]
    lead: tuple  # per-token shape in row order: (S, B) or (T,)
    seq_first: bool  # per-token tensors come [B, S, ...] and the rows are s-major


def _chunk_rows(chunk_size: Optional[int], sh: VocabShard, device) -> int:
    rows = chunk_rows(chunk_size, sh.width, device)
    return rows if chunk_size is not None else max(rows, _MIN_GEMM_ROWS)


def _rows(hidden, weight, group, sequence_parallel: bool) -> _Rows:
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden states ({hidden.dtype}) and weight ({weight.dtype}) must share a float dtype")
    if hidden.dim() not in (2, 3) or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden states {tuple(hidden.shape)} must be [T, H] or [S, B, H] and the weight "
                         f"{tuple(weight.shape)} [V/TP, H]")
    full = _full_hidden(hidden, group, sequence_parallel)
    return _Rows(full.reshape(-1, full.shape[-1]), tuple(full.shape[:-1]), full.dim() == 3)


def _full_hidden(hidden, group, sequence_parallel: bool):
    """Megatron's mapping into the vocab-parallel region: its backward sums ``dh`` over the group."""
    if group is None or dist.get_world_size(group) == 1:
        return hidden
    if sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    return copy_to_tensor_model_parallel_region(hidden, group=group)


def _to_rows(x: Optional[torch.Tensor], seq_first: bool) -> Optional[torch.Tensor]:
    return x.transpose(0, 1) if seq_first and x is not None else x


def _from_rows(x: Optional[torch.Tensor], seq_first: bool) -> Optional[torch.Tensor]:
    return x.transpose(0, 1).contiguous() if seq_first and x is not None else x


def lmhead_policy_terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    topk_index: Optional[torch.Tensor] = None,
    *,
    group,
    vocab_size: int,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
    loss_mask: Optional[torch.Tensor] = None,
    sequence_parallel: bool = False,
) -> PolicyTerms:
    """:func:`~.policy_terms.vocab_parallel_policy_terms` of the logits ``hidden @ weight.T``, without
    them: differentiable w.r.t. ``hidden`` and ``weight``.

    Args:
        hidden: ``[T, H]`` or ``[S, B, H]`` final hidden states (``[T/TP, H]`` / ``[S/TP, B, H]``
            under ``sequence_parallel``), the weight's dtype.
        weight: ``[V/TP, H]`` this rank's output-layer (or tied embedding) rows.
        tokens, topk_index, loss_mask: as for the logits op, ``[T, ...]`` or ``[B, S, ...]`` (the
            full sequence under sequence parallelism).
        group, vocab_size, with_entropy: as for the logits op.
        chunk_size: tokens per chunk; ``None``: the logits op's device-dependent size, at least 256.
        sequence_parallel: ``hidden`` is sharded along its first dimension over ``group``.

    Returns:
        :class:`~.policy_terms.PolicyTerms` shaped like ``tokens``.
    """
    r = _rows(hidden, weight, group, sequence_parallel)
    sh = shard_of(weight.shape[0], group, vocab_size)
    ids2d, valid, k = token_ids(r.lead, _to_rows(tokens, r.seq_first), _to_rows(topk_index, r.seq_first),
                                _to_rows(loss_mask, r.seq_first), sh, "hidden states")
    plan = _Plan(sh, group, _chunk_rows(chunk_size, sh, hidden.device), with_entropy)
    terms = policy_terms_of(*_LMHeadTermsFn.apply(r.hidden2d, weight, ids2d, valid, plan), r.lead, k, with_entropy)
    return PolicyTerms(*(_from_rows(t, r.seq_first) for t in terms))


@torch.no_grad()
def lmhead_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: Optional[torch.Tensor] = None,
    k: int = 0,
    *,
    group,
    vocab_size: Optional[int],
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
) -> LMHeadScores:
    """Log-probs at ``ids`` (``[...]`` one per token or ``[..., n]``), the top-``k`` and the
    log-normaliser of ``hidden @ weight.T`` in ONE pass over the vocabulary (one GEMM per chunk, one
    all-gather): what the old-policy and anchor passes need. No gradient. Arguments as
    :func:`lmhead_policy_terms`; the results equal :func:`~.vocab_parallel.vocab_parallel_logprobs_at`,
    :func:`~.vocab_parallel.vocab_parallel_topk` and :func:`~.vocab_parallel.vocab_parallel_logsumexp`
    on those logits."""
    r = _rows(hidden, weight, group, sequence_parallel)
    sh = shard_of(weight.shape[0], group, vocab_size)
    check_k(k, sh)
    ids_r = _to_rows(ids, r.seq_first)
    ids2d = None if ids is None else picked_ids(ids_r, r.lead, sh, "hidden states")
    res = forward_pass(HiddenRows(r.hidden2d, weight, sh), ids2d, sh, group,
                       rows_per_chunk=_chunk_rows(chunk_size, sh, hidden.device), topk=k)
    top_ids, top_lp = res.topk_ids, res.topk_logprob
    if k == 0:  # shaped like vocab_parallel_topk's empty answer
        top_ids, top_lp = res.logprob.new_empty(r.hidden2d.shape[0], 0, dtype=torch.int64), res.logprob[:, :0]
    return LMHeadScores(
        logprob=None if ids is None else _from_rows(res.logprob.view(ids_r.shape), r.seq_first),
        topk_ids=_from_rows(top_ids.view(r.lead + (k,)), r.seq_first),
        topk_logprob=_from_rows(top_lp.view(r.lead + (k,)), r.seq_first),
        lse=_from_rows(res.lse.view(r.lead), r.seq_first),
    )
