"""Vocab-parallel primitives and the fused policy-terms op (no RL logic).

Under tensor parallelism Megatron's output layer leaves each rank with ``[..., V/TP]`` logits. This
package computes everything the policy loss needs from them without gathering the vocabulary:

* :func:`vocab_parallel_logsumexp`, :func:`vocab_parallel_topk`, :func:`vocab_parallel_logprobs_at`
  - no-grad primitives for the old-policy and anchor passes (:mod:`.vocab_parallel`);
* :func:`vocab_parallel_policy_terms` - the differentiable fused op: log pi(y), log pi(q), entropy
  (:mod:`.policy_terms`);
* :func:`lmhead_policy_terms`, :func:`lmhead_scores` - the same from the final hidden states and the output weight shard, the
  logits formed chunk by chunk and never kept (:mod:`.lmhead_terms`);
* :func:`kl_from_policy_terms` - wiring of those terms into the single-device KL library
  (:mod:`.estimators`);
* :class:`CollectiveCounter`, :class:`SavedTensorBytes` - collectives and saved-for-backward bytes
  (tests, benchmark).

The tensor-parallel group is always passed explicitly. See ``docs/vocab_parallel.md``.
"""

from .accounting import CollectiveCounter, SavedTensorBytes
from .estimators import KL_KINDS, TOPK_KL_KINDS, kl_from_policy_terms
from .lmhead_terms import (
    LMHeadScores,
    lmhead_policy_terms,
    lmhead_scores,
)
from .policy_terms import PolicyTerms, vocab_parallel_policy_terms
from .vocab_parallel import (
    vocab_parallel_logprobs_at,
    vocab_parallel_logsumexp,
    vocab_parallel_topk,
)

__all__ = [
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
    "vocab_parallel_logprobs_at",
    "vocab_parallel_policy_terms",
    "PolicyTerms",
    "lmhead_policy_terms",
    "lmhead_scores",
    "LMHeadScores",
    "kl_from_policy_terms",
    "KL_KINDS",
    "TOPK_KL_KINDS",
    "CollectiveCounter",
    "SavedTensorBytes",
]
