"""Estimator wiring: per-token KL / f-divergence from :class:`~.policy_terms.PolicyTerms`.

The maths is the single-device library's (:mod:`emapg_megatron.kl`) ``*_from_gathered`` and
:func:`~emapg_megatron.kl.sampled_kl`, run as plain autograd on ``[..., k]`` / ``[...]`` tensors; the
vocab-parallel op supplies the gathered log-probs. No distributed code and no RL here.
"""

from __future__ import annotations

from typing import Optional

import torch

from emapg_megatron.kl import (
    ALL_DIVERGENCES,
    SAMPLED_ESTIMATORS,
    TOPK_TAILS,
    check_unique_indices,
    importance_weight,
    sampled_kl,
    token_in_topk,
    topk_fdiv_from_gathered,
    topk_kl_from_gathered,
)
from emapg_megatron.kl._common import IWClip, compute_dtype, upcast

from .policy_terms import PolicyTerms

__all__ = ["TOPK_KL_KINDS", "KL_KINDS", "kl_from_policy_terms"]

#: Top-k KL in either direction (Algorithms 1/2), with a ``tail`` from :data:`~emapg_megatron.kl.TOPK_TAILS`.
TOPK_KL_KINDS = {"topk-reverse": "reverse", "topk-forward": "forward"}
#: Every ``kind`` :func:`kl_from_policy_terms` accepts (for CLI ``choices=``): the sampled
#: estimators, the two Top-k KLs and the Top-k f-divergences.
KL_KINDS = tuple(SAMPLED_ESTIMATORS) + tuple(TOPK_KL_KINDS) + tuple(ALL_DIVERGENCES)


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
) -> torch.Tensor:
    """Per-token divergence estimate ``[...]``, differentiable through ``terms``.

    ``kind``: ``k1``..``k5``/``k3++`` (sampled, from ``terms.logprob`` only; ``tail`` unused),
    ``topk-reverse`` / ``topk-forward`` (Top-k KL, q from pi_old / the anchor) or an f-divergence
    name from :data:`~emapg_megatron.kl.ALL_DIVERGENCES` (Top-k f-divergence; ``alpha`` for
    ``"alpha"``). Arguments are those of :func:`emapg_megatron.kl.topk_kl`; the result equals it
    on the gathered logits. ``loss_mask`` zeroes masked tokens (whose inputs may be padding) and
    restricts the duplicate-id check on q to the unmasked ones.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
    valid = None if loss_mask is None else loss_mask.to(torch.bool)
    ref_y = _masked(ref_logprob_token, valid)
    samp = None if sampling_logprob is None else _masked(sampling_logprob, valid)
    if kind in SAMPLED_ESTIMATORS:
        out = sampled_kl(terms.logprob, ref_y, kind, sampling_logprob=samp, iw_clip=iw_clip)
        return _masked(out, valid)
    if tail not in TOPK_TAILS:
        raise ValueError(f"unknown Top-k tail {tail!r}; expected one of {TOPK_TAILS}")
    if topk_index is None or terms.logprob_topk is None or ref_logprob_topk is None:
        raise ValueError(f"KL kind {kind!r} needs topk_index, terms.logprob_topk and ref_logprob_topk")
    check_unique_indices(topk_index if valid is None else topk_index[valid])
    dt = compute_dtype(terms.logprob, ref_logprob_topk, ref_logprob_token, sampling_logprob)
    lp_y = upcast(terms.logprob, dt)
    lp_q = upcast(terms.logprob_topk, dt)
    ref_q = upcast(_masked(ref_logprob_topk, valid), dt)
    ref_y = upcast(ref_y, dt)
    iw = None
    if tail != "none" and (samp is not None or iw_clip is not None):
        iw = importance_weight(lp_y, upcast(samp, dt), iw_clip)
    in_q = token_in_topk(tokens, topk_index)
    if kind in TOPK_KL_KINDS:
        out = topk_kl_from_gathered(lp_q, lp_y, ref_q, ref_y, in_q, direction=TOPK_KL_KINDS[kind], tail=tail, iw=iw)
    else:
        out = topk_fdiv_from_gathered(lp_q, lp_y, ref_q, ref_y, in_q, divergence=kind, alpha=alpha, tail=tail, iw=iw)
    return _masked(out, valid)


def _masked(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """0 on masked tokens (keeps padding values such as -inf or NaN out of the loss)."""
    if valid is None:
        return x
    v = valid if x.dim() == valid.dim() else valid.unsqueeze(-1)
    return torch.where(v, x, torch.zeros((), dtype=x.dtype, device=x.device))
