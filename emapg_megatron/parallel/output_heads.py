"""What the passes compute on the last pipeline stage, from either kind of model output (no RL).

* :class:`LogitsHead`: the model ran its output layer; the output is the ``[B, S, V/TP]`` logits
  shard and the vocab-parallel ops of :mod:`.vocab_parallel` / :mod:`.policy_terms` read it.
* :class:`FusedLMHead`: the output layer was bypassed (``models.hidden_output``); the output is a
  :class:`HiddenAndWeight` and the ops of :mod:`.lmhead_terms` form the logits chunk by chunk,
  never holding them (issue 19: O(hidden + k) saved bytes per token, independent of V).

Both answer the same two questions with the same shapes, so the trainer's passes are written once.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .lmhead_terms import lmhead_policy_terms, lmhead_scores
from .policy_terms import PolicyTerms, vocab_parallel_policy_terms
from .vocab_parallel import vocab_parallel_logprobs_at, vocab_parallel_topk


class HiddenAndWeight(NamedTuple):
    """The last stage's output with the output layer bypassed."""

    hidden: torch.Tensor
    """``[S, B, H]`` final hidden states (``[S/TP, B, H]`` under sequence parallelism)."""
    weight: torch.Tensor
    """``[V/TP, H]`` this rank's output-layer rows (the word embedding's when tied)."""


class Scores(NamedTuple):
    """No-grad log-probs for the old-policy and anchor passes, ``[B, S, ...]``."""

    logprob: torch.Tensor
    """Log-probs at the requested ids (shaped like them)."""
    topk_ids: Optional[torch.Tensor]
    """``[B, S, k]`` global top-k ids (None when k = 0)."""
    topk_logprob: Optional[torch.Tensor]
    """``[B, S, k]`` their log-probs (None when k = 0)."""


class LogitsHead:
    """Ops on the vocab-sharded logits the output layer produced."""

    fused = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def scores(self, out: torch.Tensor, ids: torch.Tensor, k: int, *, group) -> Scores:
        lp = vocab_parallel_logprobs_at(out, ids, group=group, vocab_size=self.vocab_size)
        if not k:
            return Scores(lp, None, None)
        top_ids, top_lp = vocab_parallel_topk(out, k, vocab_size=self.vocab_size, group=group)
        return Scores(lp, top_ids, top_lp)

    def policy_terms(self, out: torch.Tensor, labels, q, *, group, with_entropy: bool,
                     loss_mask) -> PolicyTerms:
        return vocab_parallel_policy_terms(out, labels, q, group=group, vocab_size=self.vocab_size,
                                           with_entropy=with_entropy, loss_mask=loss_mask)


class FusedLMHead:
    """Ops on the final hidden states and the output weight: the logits exist one chunk at a time."""

    fused = True

    def __init__(self, vocab_size: int, sequence_parallel: bool = False):
        self.vocab_size = vocab_size
        self.sequence_parallel = sequence_parallel

    def scores(self, out: HiddenAndWeight, ids: torch.Tensor, k: int, *, group) -> Scores:
        s = lmhead_scores(out.hidden, out.weight, ids, k, group=group, vocab_size=self.vocab_size,
                          sequence_parallel=self.sequence_parallel)  # one pass: ids and top-k
        return Scores(s.logprob, s.topk_ids if k else None, s.topk_logprob if k else None)

    def policy_terms(self, out: HiddenAndWeight, labels, q, *, group, with_entropy: bool,
                     loss_mask) -> PolicyTerms:
        return lmhead_policy_terms(out.hidden, out.weight, labels, q, group=group,
                                   vocab_size=self.vocab_size, with_entropy=with_entropy,
                                   loss_mask=loss_mask, sequence_parallel=self.sequence_parallel)


def output_head(vocab_size: int, *, fused: bool, sequence_parallel: bool = False):
    """The head the passes use: fused (the default of the trainer) or on materialised logits."""
    return FusedLMHead(vocab_size, sequence_parallel) if fused else LogitsHead(vocab_size)
