"""The fused, differentiable policy-terms op on vocab-sharded logits.

Every token-level quantity the policy loss needs is a function of a few numbers per token:
log pi(y) (PG ratio, sampled KL estimators, the Top-k tail), log pi at the k ids of q (the exact
part of Top-k KL; the mass m = sum exp) and, optionally, the entropy. :func:`vocab_parallel_policy_terms`
returns exactly those, ``PolicyTerms(logprob [...], logprob_topk [..., k], entropy [...])``, with an
exact backward to the logit shard; the KL maths then runs as plain autograd on ``[..., k]`` tensors
with the single-device library (:mod:`.estimators`).

Cost: forward, one pass over the shard chunk by chunk and ONE all-gather of O(TP (k + 3)) floats
per token for the whole call (see :mod:`.vocab_parallel`); backward, one pass and no collective.
Every gradient term is local to the shard that owns the column::

    d logp_i / dz_v = 1[v = i] - p_v            d H / dz_v = -p_v (log p_v + H)
    =>  dz_v = sum_i g_i 1[v = i] - p_v (G + g_H (log p_v + H)),   G = sum_i g_i

so backward needs p_v on its own shard (the dense term), the upstream gradients of the k + 1 picked
log-probs (a ``scatter_add_`` of ``g`` at owned columns: duplicate ids add up correctly) and the
per-token log-normaliser and ``H``. Two ways to have p backward, both saving one ``[T, V/TP]`` row per
token in the logits' dtype:

* ``inplace_backward=False`` (default): save the logits (a reference, no copy) and recompute
  ``p = exp((z - M) - lse_M)`` per chunk in fp32, with the global max ``M`` and ``lse_M`` relative to
  it (two saved floats per token): never ``z - lse`` with the absolute lse, whose fp32 rounding
  grows with the logits (~5e-4 at 1e4) and would scale every p by ``1 + 5e-4``.
* ``inplace_backward=True``: overwrite the logits in forward with ``e = exp(z - local max)`` (in
  their dtype; ``p = e exp(local max - M - lse_M)``, the factor is one saved float per token) and ``e``
  with the gradient in backward, like Megatron's cross-entropy: no recompute, and backward is one
  multiply per element. The caller must not use the logits afterwards, and the graph can be
  backpropagated once. When ``e`` is stored in bf16 the columns of the k + 1 picked ids are
  corrected from their exact fp32 log-probs, so the gradient of a confident token (p near 1,
  where ``g - G p`` cancels) stays at fp32 accuracy; elsewhere the error is one bf16 rounding of p.

Gradients are written in the logits' dtype (fp32 work per chunk). Loss-masked tokens are skipped
(no compute, zero gradient) and padding columns get zero gradient; so do masked (-inf, or any
logit whose p underflows to 0) columns, in every variant, unless one of the k + 1 ids is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .vocab_parallel import (
    LogitRows,
    VocabShard,
    check_ids,
    chunk_rows,
    compute_dtype,
    floor_log_underflow_,
    forward_pass,
    iter_chunks,
    owned_columns,
    probs_scale,
    put_rows,
    take_rows,
    vocab_shard,
)

__all__ = ["PolicyTerms", "vocab_parallel_policy_terms"]


class PolicyTerms(NamedTuple):
    """Per-token outputs, replicated on every TP rank, fp32 (fp64 for fp64 logits).

    ``logprob_topk`` is ``None`` when no index set was given; ``entropy`` when not requested.
    Masked tokens hold 0.
    """

    logprob: torch.Tensor
    logprob_topk: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]


@dataclass(frozen=True)
class _Plan:
    shard: VocabShard
    group: object
    rows_per_chunk: int
    entropy: bool
    inplace: bool


def _first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """``[r, n]`` bool: the slot is the first in its row holding its id (O(n^2), n = k + 1)."""
    n = ids.shape[-1]
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)  # [r, n, n]
    earlier = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)
    return ~(same & earlier).any(dim=-1)


class _PolicyTermsFn(torch.autograd.Function):
    """Outputs ``logprob_all [N, n]`` (column 0: the token, then q) and ``entropy [N]`` (or empty).

    Everything saved is per selected (unmasked) row, in selection order.
    """

    @staticmethod
    def forward(ctx, logits, ids2d, valid, plan: _Plan):
        sh = plan.shard
        if not logits.is_contiguous():  # a copy: in-place writes must reach the saved tensor
            logits = logits.contiguous()
        logits2d = logits.view(-1, sh.width)
        row_index, ids_sel = select_rows(ids2d, valid)
        write = plan.inplace  # only set when a backward will follow
        res = forward_pass(LogitRows(logits2d, sh), ids_sel, sh, plan.group, rows_per_chunk=plan.rows_per_chunk,
                           row_index=row_index, entropy=plan.entropy, write_exp=write)
        logprob, ent = to_all_rows(res.logprob, row_index, ids2d.shape[0]), to_all_rows(res.entropy, row_index,
                                                                                     ids2d.shape[0])
        # bf16 probabilities: keep the exact fp32 log-probs of the picked ids to correct them.
        exact = res.logprob if write and logits2d.dtype != compute_dtype(logits2d) else None
        ctx.plan, ctx.logits_shape, ctx.write, ctx.used = plan, logits.shape, write, False
        # Save the input itself, not a view of it: a view made under no_grad cannot be saved.
        # p backward, relative to the global max M (never via the absolute lse, whose rounding grows with
        # the logits): recompute needs (M, lse_M); the stored e = exp(z - m_r) needs exp(m_r - M - lse_M).
        scale = probs_scale(res.local_max, res.shift, res.lse_rel) if write else None
        ctx.save_for_backward(logits, ids_sel, valid, None if write else res.shift, None if write else res.lse_rel,
                              res.entropy, exact, scale)
        ctx.set_materialize_grads(False)
        return logprob, empty_if_none(ent, res.lse_rel)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        plan, sh = ctx.plan, ctx.plan.shard
        if ctx.write and ctx.used:
            raise RuntimeError("inplace_backward=True overwrote its saved state: backward runs once")
        ctx.used = True
        logits, ids, valid, shift, lse, ent, exact, scale = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None
        logits2d = logits.view(-1, sh.width)
        row_index = row_index_of(valid)
        grad2d = logits2d if ctx.write else torch.empty_like(logits2d)
        if sh.n_real < sh.width:
            grad2d[:, sh.n_real:].zero_()
        if valid is not None:
            grad2d.index_fill_(0, (~valid).nonzero().squeeze(-1), 0)
        if sh.n_real == 0:
            return grad2d.view(ctx.logits_shape), None, None, None
        # Per selected row, all at once: upstream gradients, the dense coefficients, the sparse part.
        cdt = compute_dtype(logits2d)
        up = upstream_grads(g_lp, g_ent, ids, row_index, sh, cdt)
        fix = None
        if exact is not None:
            fix = (up.owned & _first_occurrence(ids), _dense_term(exact.exp(), up.big_g, up.g_h, ent))
        real_in, real_out = logits2d[:, : sh.n_real], grad2d[:, : sh.n_real]
        for sel, rows in iter_chunks(ids.shape[0], plan.rows_per_chunk, row_index):
            src = take_rows(real_in, rows)
            shared = isinstance(rows, slice) and src.dtype == cdt  # work in the output's storage
            if ctx.write:
                w = src if shared else src.to(cdt)  # exp(z - local max)
                w = _dense_from_probs(w, scale[sel], up.big_g[sel], _rows(up.g_h, sel), _rows(ent, sel))
                add = up.sparse[sel]
                if fix is not None:  # overwrite the dense term of the picked columns by its fp32 value
                    first, dense = fix
                    add = add + torch.where(first[sel], dense[sel] - w.gather(-1, up.lid[sel]), torch.zeros_like(add))
                w.scatter_add_(-1, up.lid[sel], add)
            else:
                w = recompute_logit_grad(src, real_out[rows] if shared else None, up, sel, shift, lse, ent)
            if not shared:
                put_rows(real_out, rows, w)
        return grad2d.view(ctx.logits_shape), None, None, None


def _select(x: torch.Tensor, row_index: Optional[torch.Tensor]) -> torch.Tensor:
    return x if row_index is None else x.index_select(0, row_index)


def _rows(x: Optional[torch.Tensor], sel: slice) -> Optional[torch.Tensor]:
    return None if x is None else x[sel].unsqueeze(-1)


def row_index_of(valid: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The selected rows: all (``None``) or the unmasked ones."""
    return None if valid is None else valid.nonzero().squeeze(-1)


def select_rows(ids2d: torch.Tensor, valid: Optional[torch.Tensor]):
    """``(row_index, ids of the selected rows)``."""
    row_index = row_index_of(valid)
    return row_index, _select(ids2d, row_index)


def to_all_rows(x: Optional[torch.Tensor], row_index: Optional[torch.Tensor], n_rows: int):
    """Per selected row -> per row, 0 on the masked ones."""
    if x is None or row_index is None:
        return x
    return torch.zeros((n_rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device).index_copy_(0, row_index, x)


def empty_if_none(x: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """autograd outputs must be tensors: an empty one stands for 'not computed'."""
    return torch.empty(0, dtype=like.dtype, device=like.device) if x is None else x


class Upstream(NamedTuple):
    """Per selected row, the upstream gradients in the form backward uses (compute dtype)."""

    lid: torch.Tensor  # [r, n] local column of each id (0 where not owned)
    owned: torch.Tensor  # [r, n] this rank owns the id
    sparse: torch.Tensor  # [r, n] g_i at owned ids, else 0: the 1[v = i] part
    big_g: torch.Tensor  # [r] G = sum_i g_i
    g_h: Optional[torch.Tensor]  # [r] entropy gradient, or None


def upstream_grads(g_lp, g_ent, ids, row_index, sh: VocabShard, cdt) -> Upstream:
    """The gradients of ``logprob_all`` / ``entropy`` (all rows) on the selected rows; -inf outputs
    (padding ids) take none."""
    g = torch.zeros(ids.shape, dtype=cdt, device=ids.device) if g_lp is None else _select(g_lp, row_index).to(cdt)
    g = torch.where(ids >= sh.vocab_size, torch.zeros_like(g), g)
    g_h = None if g_ent is None else _select(g_ent, row_index).to(cdt)
    lid, owned = owned_columns(ids, sh)
    return Upstream(lid, owned, torch.where(owned, g, torch.zeros_like(g)), g.sum(dim=-1), g_h)


def recompute_logit_grad(z, out, up: Upstream, sel: slice, shift, lse, ent) -> torch.Tensor:
    """The logit gradient of one chunk from its logits ``z`` (written into ``out`` when given, else
    in ``z`` if it is already in the compute dtype): dense term, then ``g`` at the owned ids."""
    w = _dense_recompute(z, out, _rows(shift, sel), _rows(lse, sel), up.big_g[sel], _rows(up.g_h, sel),
                         _rows(ent, sel))
    return w.scatter_add_(-1, up.lid[sel], up.sparse[sel])


def _dense_term(p, big_g, g_h, ent):
    """``-p (G + g_H (log p + H))`` for probabilities ``p`` [r, m] (per-row G, g_H, H)."""
    out = -p * big_g.unsqueeze(-1)
    if g_h is not None:
        out = out - g_h.unsqueeze(-1) * (torch.xlogy(p, p) + p * ent.unsqueeze(-1))
    return out


def _dense_from_probs(e, scale, big_g, g_h, ent):
    """The dense term from stored ``e = exp(z - local max)`` (``p = e scale``), in place in ``e``."""
    if g_h is None:
        return e.mul_(-(big_g * scale).unsqueeze(-1))  # one pass: -G p
    p = e.mul_(scale.unsqueeze(-1))
    plogp = torch.xlogy(p, p)
    return p.mul_(-(big_g.unsqueeze(-1) + g_h * ent)).sub_(plogp.mul_(g_h))


def _dense_recompute(z, out, shift, lse, big_g, g_h, ent):
    """The dense term recomputed from logits ``z`` (written into ``out`` when given, else a private
    copy in the compute dtype); ``shift``, ``lse``, ``g_h``, ``ent`` are ``[r, 1]``.

    ``log p = w - lse`` with ``w = z - M`` (one rounding of a small number); ``lse`` stays out of the
    elementwise work: ``p = exp(w) exp(-lse)``, and ``exp(-lse)`` joins the per-row constants, so the
    pass count is that of ``exp(z - lse)``.
    """
    w = torch.sub(z, shift, out=out) if out is not None else z.to(shift.dtype).sub_(shift)
    inv = torch.exp(-lse)
    if g_h is None:
        return w.exp_().mul_(-big_g.unsqueeze(-1) * inv)
    # -p (G + g_H (log p + H)) = -exp(w) exp(-lse) (g_H w + G + g_H (H - lse)); w floored so that a
    # masked logit's 0 * (g_H w) is 0, as in forward (one pass more, entropy only)
    e = floor_log_underflow_(w).exp()
    return w.mul_(-g_h * inv).sub_((big_g.unsqueeze(-1) + g_h * (ent - lse)) * inv).mul_(e)


def vocab_parallel_policy_terms(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    topk_index: Optional[torch.Tensor] = None,
    *,
    group,
    vocab_size: int,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
    inplace_backward: bool = False,
    loss_mask: Optional[torch.Tensor] = None,
) -> PolicyTerms:
    """log pi(y), log pi at q and (optionally) the entropy from vocab-sharded logits, differentiable.

    Args:
        logits_shard: ``[..., V/TP]`` this rank's logits (bf16/fp16/fp32/fp64).
        tokens: ``[...]`` global ids of the sampled tokens (``< vocab_size`` on unmasked tokens).
        topk_index: ``[..., k]`` global ids q (k may be 0), or ``None``. Ids in the padding range
            get log-prob ``-inf`` and no gradient; duplicates are allowed here.
        group: the tensor-parallel process group (``None``: the shard is the whole vocabulary).
        vocab_size: true vocabulary size; columns ``>= vocab_size`` are padding (zero probability).
        with_entropy: also return the per-token entropy (same pass, same collective).
        chunk_size: tokens per chunk; ``None`` picks a device-dependent size.
        inplace_backward: store (unnormalised) probabilities over the logits and the gradient over
            those; the logits are garbage afterwards. See the module docstring.
        loss_mask: ``[...]`` bool; masked tokens are skipped: outputs 0, zero gradient, no compute.

    Returns:
        :class:`PolicyTerms`, differentiable w.r.t. ``logits_shard``; one all-gather in forward,
        none in backward.
    """
    sh = vocab_shard(logits_shard, group, vocab_size)
    lead = logits_shard.shape[:-1]
    ids2d, valid, k = token_ids(lead, tokens, topk_index, loss_mask, sh, "logits")
    # Clobber the logits only when a backward will consume what replaces them.
    inplace = inplace_backward and torch.is_grad_enabled() and logits_shard.requires_grad
    plan = _Plan(sh, group, chunk_rows(chunk_size, sh.width, logits_shard.device), with_entropy, inplace)
    return policy_terms_of(*_PolicyTermsFn.apply(logits_shard, ids2d, valid, plan), lead, k, with_entropy)


def token_ids(lead, tokens, topk_index, loss_mask, sh: VocabShard, what: str):
    """Checks the per-token inputs against the rows' shape ``lead``; returns ``(ids2d, valid, k)``:
    the token then q per row ``[N, 1 + k]`` int64, the unmasked rows (``None``: all) and k (``None``
    without q)."""
    if tokens.shape != lead:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match {what} {tuple(lead)}")
    valid = None
    if loss_mask is not None:
        if loss_mask.shape != lead:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} does not match tokens {tuple(lead)}")
        valid = loss_mask.reshape(-1).to(torch.bool)
        if bool(valid.all()):
            valid = None
    check_ids(tokens.reshape(-1), sh.vocab_size, "tokens", valid)
    cols = [tokens.reshape(-1, 1)]
    k = None
    if topk_index is not None:
        if topk_index.dim() != len(lead) + 1 or topk_index.shape[:-1] != lead:
            raise ValueError(
                f"topk_index shape {tuple(topk_index.shape)} must be tokens shape {tuple(lead)} + (k,)"
            )
        k = topk_index.shape[-1]
        q2d = topk_index.reshape(tokens.numel(), k)
        check_ids(q2d, sh.padded_vocab_size, "topk_index", valid)
        cols.append(q2d)
    return torch.cat([c.to(torch.int64) for c in cols], dim=-1), valid, k


def policy_terms_of(logprob_all: torch.Tensor, ent: torch.Tensor, lead, k: Optional[int],
                    with_entropy: bool) -> PolicyTerms:
    """:class:`PolicyTerms` from the op's outputs ``[N, 1 + k]`` and ``[N]`` (empty without entropy)."""
    logprob_all = logprob_all.view(tuple(lead) + (logprob_all.shape[-1],))
    return PolicyTerms(
        logprob=logprob_all[..., 0],
        logprob_topk=None if k is None else logprob_all[..., 1:],
        entropy=ent.view(lead) if with_entropy else None,
    )
