"""Exact expectations of per-token estimators by enumerating every possible sampled token.

For a single position with policy logits ``z`` ``[V]`` and a sampling distribution ``mu`` ``[V]``,
``E_{y~mu}[est(y)]`` and ``E_{y~mu}[grad_z est(y)]`` are finite sums over the V tokens. Building one
batch row per token (``z`` broadcast to ``[n, V]``, tokens ``0..V-1``) gives both in one backward
pass, with no Monte-Carlo error. Used by the tests here and reusable by the vocab-parallel tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._common import compute_dtype

__all__ = ["Enumerated", "enumerate_expectation"]


@dataclass
class Enumerated:
    value: torch.Tensor  #: E_y[est(y)], scalar
    grad: torch.Tensor  #: E_y[grad_z est(y)], [V]
    tokens: torch.Tensor  #: [n] tokens with mu(y) > 0
    weights: torch.Tensor  #: [n] mu(y) for those tokens
    values: torch.Tensor  #: [n] est(y) per token
    grads: torch.Tensor  #: [n, V] grad_z est(y) per token

    @property
    def grad_second_moment(self) -> torch.Tensor:
        """E_y[||grad_z est(y)||^2]."""
        return (self.weights * (self.grads**2).sum(-1)).sum()


def enumerate_expectation(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    sampling_probs: Optional[torch.Tensor] = None,
) -> Enumerated:
    """Exact ``E_{y~mu}`` of ``fn(logits_rows, tokens)`` and of its gradient w.r.t. ``logits``.

    Args:
        fn: maps ``logits_rows`` ``[n, V]`` (each row a copy of ``logits``) and ``tokens`` ``[n]``
            to per-row estimates ``[n]``.
        logits: ``[V]`` policy logits.
        sampling_probs: ``[V]`` sampling distribution mu; ``None`` = softmax(logits) (on-policy).
            Tokens with mu(y) = 0 are skipped (never sampled).
    """
    if logits.dim() != 1:
        raise ValueError("enumerate_expectation takes one position: logits of shape [V]")
    if sampling_probs is None:
        sampling_probs = torch.softmax(logits.detach().to(compute_dtype(logits)), -1)
    tokens = torch.nonzero(sampling_probs > 0).squeeze(-1)
    weights = sampling_probs[tokens]
    rows = logits.detach().unsqueeze(0).expand(tokens.numel(), -1).clone().requires_grad_(True)
    values = fn(rows, tokens)
    (grads,) = torch.autograd.grad(values.sum(), rows)
    values = values.detach()
    w = weights.to(values.dtype)
    return Enumerated(
        value=(w * values).sum(),
        grad=(w.unsqueeze(-1) * grads.to(values.dtype)).sum(0),
        tokens=tokens,
        weights=w,
        values=values,
        grads=grads.to(values.dtype),
    )
