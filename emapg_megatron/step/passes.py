"""What the old-policy, anchor and loss passes compute on the last pipeline stage's output.

Between passes a token carries O(k) state (top-k ids, anchor log-probs at them, three scalars);
full logits exist only inside one micro-batch's forward pass, and only where the output head
materialises them (``parallel.output_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from emapg_megatron.algo.config import LossConfig
from emapg_megatron.algo.policy_loss import policy_loss_terms
from emapg_megatron.kl.config import KLConfig
from emapg_megatron.parallel import kl_from_policy_terms
from emapg_megatron.parallel.output_heads import LogitsHead
from emapg_megatron.training.microbatches import layout_of


@dataclass(frozen=True)
class TopkPlan:
    """Who picks the top-k ids q of a Top-k estimator, decided once from the KL config: the
    old-policy pass (q from the recomputed sampling policy), the anchor pass (q from the anchor
    itself), or nobody (a sampled estimator: no q)."""

    k: int
    picked_by: str | None  # "old", "anchor" or None

    @classmethod
    def of(cls, kl: KLConfig) -> TopkPlan:
        return cls(kl.topk_tokens, kl.q_source)

    @property
    def used(self) -> bool:
        return self.picked_by is not None

    def k_in(self, pass_name: str) -> int:
        """The k the ``pass_name`` pass ("old" or "anchor") takes its top-k with (0: none)."""
        return self.k if self.picked_by == pass_name else 0


class PolicyPasses:
    """The no-grad passes and the loss on the last pipeline stage's output, through ``head``
    (``parallel.output_heads``: the fused LM head on hidden states, or materialised logits)."""

    def __init__(self, kl: KLConfig, loss: LossConfig, vocab_size: int, head=None):
        self.kl = kl
        self.loss = loss
        self.topk = TopkPlan.of(kl)
        self.head = head or LogitsHead(vocab_size)

    @staticmethod
    def _tp_group():
        return ps.get_tensor_model_parallel_group()

    def old(self, out, mb) -> dict:
        k = self.topk.k_in("old")
        s = self.head.scores(out, mb["labels"], k, group=self._tp_group())
        return {"old_logprob": s.logprob, **({"topk_index": s.topk_ids} if k else {})}

    def anchor(self, out, mb) -> dict:
        group, labels = self._tp_group(), mb["labels"]
        if self.topk.k_in("anchor"):
            s = self.head.scores(out, labels, self.topk.k, group=group)
            return {"ref_logprob": s.logprob, "topk_index": s.topk_ids, "ref_logprob_topk": s.topk_logprob}
        if self.topk.used:  # the label and the old pass's q in one pass over the vocabulary
            lp = self.head.scores(out, torch.cat([labels.unsqueeze(-1), mb["topk_index"]], -1), 0,
                                  group=group).logprob
            return {"ref_logprob": lp[..., 0], "ref_logprob_topk": lp[..., 1:]}
        return {"ref_logprob": self.head.scores(out, labels, 0, group=group).logprob}

    def sequence_logprob(self, out, mb):
        """Summed log-prob of the model's tokens (for the stability monitor's Fisher trace)."""
        terms = self.head.policy_terms(out, mb["labels"], None, group=self._tp_group(),
                                       with_entropy=False, loss_mask=mb["mask"])
        return (terms.logprob * mb["mask"]).sum(), {}

    def loss_terms(self, out, mb):
        """(weighted loss sum, metrics) for one micro-batch."""
        q = mb.get("topk_index") if self.topk.used else None
        terms = self.head.policy_terms(out, mb["labels"], q, group=self._tp_group(),
                                       with_entropy=True, loss_mask=mb["mask"])
        kl = kl_from_policy_terms(
            terms, mb["labels"], q, mb.get("ref_logprob_topk"), mb["ref_logprob"],
            kind=self.kl.loss_type, tail=self.kl.tail, alpha=self.kl.alpha,
            sampling_logprob=mb["sampling_logprob"], iw_clip=self.kl.iw_clip,
            reference_clamps=self.kl.reference_clamps, loss_mask=mb["mask"])
        # the per-sequence aggregation sees each sequence's tokens as the padded batch has them
        logprob, old, kl, entropy, mask, sampling = layout_of(mb).per_sequence(
            terms.logprob, mb["old_logprob"], kl * mb["mask"], terms.entropy, mb["mask"],
            mb["sampling_logprob"])
        return policy_loss_terms(logprob, old, mb["advantages"], kl, entropy, mask, self.loss,
                                 sampling_logprob=sampling)
