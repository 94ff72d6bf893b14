"""Exact per-token KL over the full vocabulary (O(V) memory): the reference the estimators target.

``exact_kl(logits, ref_logprobs_full, "reverse")`` = sum_j pi(j) [log pi(j) - log ref(j)] = KL(pi||ref)
``exact_kl(logits, ref_logprobs_full, "forward")`` = sum_j ref(j) [log ref(j) - log pi(j)] = KL(ref||pi)

Entries where both distributions have zero mass (``-inf`` logits / log-probs, e.g. Megatron's
vocabulary padding) contribute exactly 0 with zero gradient; see :mod:`.divergences`.
"""

from __future__ import annotations

import torch

from ._common import _check_name, compute_dtype, upcast
from .catalog import KL_DIRECTIONS
from .divergences import divergence_terms

__all__ = ["KL_DIRECTIONS", "KL_GENERATOR", "exact_kl", "kl_terms"]


#: Each direction's f-divergence generator name (:mod:`.divergences`).
KL_GENERATOR = {"reverse": "reverse_kl", "forward": "forward_kl"}


def kl_terms(logprob: torch.Tensor, ref_logprob: torch.Tensor, direction: str) -> torch.Tensor:
    """Elementwise KL contributions: ``pi (log pi - log ref)`` (reverse) or ``ref (log ref - log pi)``
    (forward). Same-shaped log-prob tensors in the compute dtype; zero-mass safe."""
    _check_name(direction, KL_DIRECTIONS, "KL direction")
    return divergence_terms(logprob, ref_logprob, KL_GENERATOR[direction])


def exact_kl(logits: torch.Tensor, ref_logprobs_full: torch.Tensor, direction: str) -> torch.Tensor:
    """Exact per-token KL.

    Args:
        logits: ``[..., V]`` policy logits (differentiable; bf16 is upcast).
        ref_logprobs_full: ``[..., V]`` anchor log-probabilities (normalised; treated as constant).
        direction: ``"reverse"`` for KL(pi||ref) or ``"forward"`` for KL(ref||pi).

    Returns:
        ``[...]`` KL in the compute dtype.
    """
    dt = compute_dtype(logits, ref_logprobs_full)
    logp = torch.log_softmax(upcast(logits, dt), dim=-1)
    lr = upcast(ref_logprobs_full, dt).detach()
    return kl_terms(logp, lr, direction).sum(dim=-1)
