"""Estimator wiring: per-token KL / f-divergence from :class:`~.policy_terms.PolicyTerms`.

The loss type comes from the registry (:mod:`emapg_megatron.kl.registry`); its estimator, the
single-device library's ``*_from_gathered`` or :func:`~emapg_megatron.kl.sampled_kl`, runs as plain
autograd on ``[..., k]`` / ``[...]`` tensors that the vocab-parallel op gathered. No distributed
code and no RL here.
"""

from __future__ import annotations

from typing import Optional

import torch

from emapg_megatron.kl import (
    ALL_DIVERGENCES,
    LOSS_TYPE_NAMES,
    LOSS_TYPES,
    SAMPLED,
    TOPK_KL,
    TOPK_TAILS,
    KLLossType,
    check_unique_indices,
    has_sampled_term,
    importance_weight,
    loss_type,
    token_in_topk,
    topk_fdiv_type,
)
from emapg_megatron.kl._common import IWClip, _check_name, compute_dtype, upcast

from .policy_terms import PolicyTerms

__all__ = ["TOPK_KL_KINDS", "KL_KINDS", "kl_from_policy_terms"]

#: The Top-k KL names and their directions (derived from the registry).
TOPK_KL_KINDS = {name: t.selector for name, t in LOSS_TYPES.items() if t.family == TOPK_KL}
#: Every ``kind`` :func:`kl_from_policy_terms` accepts: the registry names (the CLI choices,
#: ``emapg_megatron.kl.LOSS_TYPE_NAMES``) and the bare generator names of the Top-k f-divergence.
KL_KINDS = LOSS_TYPE_NAMES + ALL_DIVERGENCES


def kl_from_policy_terms(
    terms: PolicyTerms,
    tokens: torch.Tensor,
    topk_index: Optional[torch.Tensor],
    ref_logprob_topk: Optional[torch.Tensor],
    ref_logprob_token: torch.Tensor,
    *,
    kind: str,
    tail: str = "unbiased",
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
    alpha: Optional[float] = None,
    loss_mask: Optional[torch.Tensor] = None,
    reference_clamps: bool = False,
) -> torch.Tensor:
    """Per-token divergence estimate ``[...]``, differentiable through ``terms``.

    ``kind``: a registry name (``emapg_megatron.kl.LOSS_TYPE_NAMES``: ``k1``..``k5``/``k3++``
    from ``terms.logprob`` only, ``tail`` unused; ``topk-reverse`` / ``topk-forward``;
    ``topk-<f>`` for the f-divergences, ``alpha`` required for ``topk-alpha`` only). A bare
    generator name from ``ALL_DIVERGENCES`` means :func:`~emapg_megatron.kl.topk_fdiv_type` of it
    (not a CLI choice). Arguments are those of :func:`emapg_megatron.kl.topk_kl`; the result
    equals it on the gathered logits, for every ``tail`` (``renorm`` takes the anchor's mass on q
    from ``ref_logprob_topk``, so it needs nothing beyond the gathered quantities; the tails without
    a sampled term ignore ``sampling_logprob`` and ``iw_clip``). ``topk_index``,
    ``terms.logprob_topk`` and ``ref_logprob_topk`` all ``None`` means k = 0 (the Top-k loss is its
    sampled tail alone, 0 for the tails without one).
    ``loss_mask`` zeroes masked tokens (whose inputs may be padding) and restricts the
    duplicate-id check on q to the unmasked ones. ``reference_clamps`` applies the reference code's
    clamps (``--kl-reference-clamps``): to the importance weight for every kind, and to the K3 /
    K3++ / K5 estimates (sampled ``k3``, ``k3++``, ``k5``, the ``topk-forward`` tail).
    """
    entry = topk_fdiv_type(kind) if kind in ALL_DIVERGENCES else loss_type(kind)
    kwargs = entry.kwargs(alpha)
    valid = None if loss_mask is None else loss_mask.to(torch.bool)
    ref_y = _masked(ref_logprob_token, valid)
    samp = None if sampling_logprob is None else _masked(sampling_logprob, valid)
    if entry.family == SAMPLED:
        out = entry.estimator(terms.logprob, ref_y, sampling_logprob=samp, iw_clip=iw_clip,
                              reference_clamps=reference_clamps, **kwargs)
        return _masked(out, valid)
    _check_name(tail, TOPK_TAILS, "Top-k tail")
    dt = compute_dtype(terms.logprob, ref_logprob_topk, ref_logprob_token, sampling_logprob)
    lp_y = upcast(terms.logprob, dt)
    q, lp_q, ref_q = _index_set(entry, terms, tokens, topk_index, ref_logprob_topk, valid, dt)
    iw = None
    if has_sampled_term(tail) and (samp is not None or iw_clip is not None):
        iw = importance_weight(lp_y, upcast(samp, dt), iw_clip, reference_clamps)
    if entry.family == TOPK_KL:  # the f-divergence tails have no reference counterpart
        kwargs["reference_clamps"] = reference_clamps
    out = entry.estimator(lp_q, lp_y, ref_q, upcast(ref_y, dt), token_in_topk(tokens, q), tail=tail, iw=iw,
                          **kwargs)
    return _masked(out, valid)


def _index_set(entry: KLLossType, terms, tokens, topk_index, ref_logprob_topk, valid, dt) -> tuple:
    """``(q, log pi(q), log ref(q))`` in the compute dtype; empty ``[..., 0]`` ones for k = 0."""
    given = [x is not None for x in (topk_index, terms.logprob_topk, ref_logprob_topk)]
    if not any(given):
        empty = terms.logprob.new_zeros(terms.logprob.shape + (0,), dtype=dt)
        return tokens.new_zeros(tokens.shape + (0,)), empty, empty
    if not all(given):
        raise ValueError(f"KL kind {entry.name!r} needs topk_index, terms.logprob_topk and ref_logprob_topk "
                         "(all three, or none of them for k = 0)")
    check_unique_indices(topk_index if valid is None else topk_index[valid])
    return topk_index, upcast(terms.logprob_topk, dt), upcast(_masked(ref_logprob_topk, valid), dt)


def _masked(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """0 on masked tokens (keeps padding values such as -inf or NaN out of the loss)."""
    if valid is None:
        return x
    v = valid if x.dim() == valid.dim() else valid.unsqueeze(-1)
    return torch.where(v, x, torch.zeros((), dtype=x.dtype, device=x.device))
