"""Top-k KL estimators (§5.3, Algorithms 1 and 2, Appendix A): exact KL on an index set q plus a
masked sampled-KL tail, O(k) memory per token.

Estimator (per token; y is the sampled token, q a fixed set of k distinct vocabulary ids, the
policy's mass on q is ``m = sum_{j in q} pi_theta(j)``, ``s`` the stop-gradient importance weight
``clip(sg(pi_theta(y)/pi_sampling(y)), s_min, s_max)``)::

    reverse:  sum_{j in q} pi(j) [log pi(j) - log ref(j)]  + s 1(y not in q) K4(y)  [ - (m - sg(m)) ]
    forward:  sum_{j in q} ref(j) [log ref(j) - log pi(j)] + s 1(y not in q) K5(y)  [ + (m - sg(m)) ]

q comes from the sampling policy for ``reverse`` (Alg. 1; the top-k of pi_old) and from the anchor
for ``forward`` (Alg. 2; the top-k of pi_ref). Unbiasedness never needs q to be a top-k set, only
that q does not depend on the sampled token nor on theta.

Tail variants (``tail=``, see :data:`TOPK_TAILS`)
--------------------------------------------------
``"unbiased"`` (default)
    Algorithms 1/2 plus the bracketed correction. The correction has value exactly 0 and gradient
    ``-grad m`` (reverse) / ``+grad m`` (forward), which makes the expected gradient exact:
    ``E[value] = KL`` and ``E[grad] = grad KL`` for every 0 <= k <= V.
``"paper"``
    Algorithms 1/2 as the paper's reference code runs them (``compute_memory_efficient_kl``),
    including its clamp of log w to [-20, 20] inside the forward K5 tail
    (:data:`PAPER_K5_LOG_W_CLAMP`; its K4 tail has none). Inside the clamp the value is unbiased
    but, for 0 < k < V, the expected gradient is biased:

    * reverse (K4 tail): ``E[grad] = grad KL(pi||ref) + grad m``
    * forward (K5 tail): ``E[grad] = grad KL(ref||pi) - grad m``

    Cause: K4 = r sg(-log w) and K5 = sg(w) log w + log r are the unbiased Kf++ estimators
    ``r (-log w)`` and ``sg(w) log w`` with a baseline added: K4 drops the gradient
    ``grad log pi(y)`` of ``-log w``, K5 adds ``grad log pi(y)`` through ``log r``. Over the whole
    vocabulary ``E_y[grad log pi(y)] = grad 1 = 0``, so the baselines are free; restricted to the
    tail, ``E_y[1(y not in q) grad log pi(y)] = grad (1 - m) = -grad m``, which is exactly the bias
    above (with opposite signs for the dropped / added baseline). At k = 0 (m = 0) and k = V
    (m = 1) the bias vanishes. The ``"unbiased"`` tail keeps the low-variance baselines and removes
    their tail-restricted mean deterministically through ``m``.
``"none"``, also named ``"truncate"``
    Truncated KL: the exact term on q only, no tail and no importance weight. Biased in value and
    gradient (it omits the tail), zero variance; the reference's ``kl_use_tail_sampling=false`` and
    verl's top-k forward-KL distillation loss. Bias: ``E[value] - KL = -(the tail terms)``, e.g.
    ``-sum_{j not in q} pi(j) log(pi(j)/ref(j))`` for reverse, and the gradient of that.
``"renorm"``
    The KL between the policy and the anchor both renormalised over q, ``p^ = pi/m`` and
    ``r^ = ref/m_ref`` with ``m_ref = sum_{j in q} ref(j)`` (NeMo-RL's top-k distillation loss)::

        reverse:  sum_{j in q} p^(j) [log p^(j) - log r^(j)] = T/m - log m + log m_ref
        forward:  sum_{j in q} r^(j) [log r^(j) - log p^(j)] = T/m_ref - log m_ref + log m

    T the ``"none"`` value. No tail, no importance weight, zero variance given q; biased in value
    and gradient for 0 < k < V (the bias is the right-hand side minus the KL), exact at k = V
    (m = m_ref = 1). Its gradient never reaches a logit outside q (p^ is the softmax of the logits
    at q). At k = 0 it is the empty sum, 0.

``"none"``, ``"truncate"`` and ``"renorm"`` are the peers' biased estimators, kept to compare with
(on-policy distillation: the anchor is a teacher); ``docs/kl_estimators.md`` "Distillation tails"
proves their bias by enumeration.

Reference clamps: ``reference_clamps=True`` adds the reference code's other clamps to any tail:
log w to [-20, 20] in the K5 tail (as ``"paper"`` always does) and log s to [-20, 20] in the
importance weight before ``exp``. Biased wherever they bind; off by default.

Extreme ratios: the ``"unbiased"`` tail is exact while its value fits the compute dtype with
e^24 to spare; beyond that (K5: log w > 64.7 in fp32, > 685.8 in fp64, see
:func:`~emapg_megatron.kl.divergences.log_w_range`; K4 never overflows) log w is clamped, so
values and gradients stay finite. See ``docs/kl_estimators.md``.

Special cases: k = 0 (``topk_index`` of shape ``[..., 0]``) gives the sampled estimator (K4 for
reverse, K5 for forward, times s) for the sampled tails, 0 for the others; k = V gives the exact
KL, value and gradient, for every token and every tail.

Factoring for a vocab-parallel implementation
---------------------------------------------
:func:`topk_kl` only (1) takes ``log_softmax`` of the logits, (2) gathers the policy log-probs at q
and at y, (3) checks whether y is in q and computes the importance weight, and then calls
:func:`topk_kl_from_gathered`, which is pure per-token maths on ``[..., k]`` and ``[...]`` tensors and
never sees the vocabulary. A vocab-parallel op provides the same gathered quantities (with its own
distributed log-softmax / gather autograd) and calls :func:`topk_kl_from_gathered` unchanged; the
mass m is ``exp(logprob_topk).sum(-1)``, so it needs no extra reduction. The same holds for
:func:`emapg_megatron.kl.fdiv.topk_fdiv_from_gathered`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from ._common import (
    NO_CLAMP,
    REFERENCE_LOG_CLAMP,
    IWClip,
    LogWRange,
    _check_name,
    check_unique_indices,
    compute_dtype,
    gather_last,
    importance_weight,
    log_renormalize,
    sg,
    token_in_topk,
    upcast,
)
from .catalog import SAMPLED_TAILS, TOPK_TAILS
from .divergences import log_w_range
from .exact import KL_DIRECTIONS, KL_GENERATOR, kl_terms
from .sampled import sampled_kl_unweighted

__all__ = [
    "TOPK_TAILS",
    "SAMPLED_TAILS",
    "PAPER_K5_LOG_W_CLAMP",
    "has_sampled_term",
    "on_q_term",
    "topk_kl",
    "topk_kl_from_gathered",
]


#: The reference code clamps log w to [-20, 20] in its K5 ("numerical stability"), both in the
#: Top-k forward tail and in its sampled ``k5``; ``tail="paper"`` reproduces it.
PAPER_K5_LOG_W_CLAMP = REFERENCE_LOG_CLAMP

_TAIL_ESTIMATOR = {"reverse": "k4", "forward": "k5"}


def _tail_log_w_range(direction: str, tail: str, dtype: torch.dtype, reference_clamps: bool) -> LogWRange:
    """The clamp of log w in the K4/K5 tail: the reference code's for ``paper`` or with
    ``reference_clamps`` (K5 only), else the dtype's overflow range (K5 grows like the forward-KL
    Kf++; K4 needs none)."""
    if tail == "paper" or reference_clamps:
        return PAPER_K5_LOG_W_CLAMP if direction == "forward" else NO_CLAMP
    return log_w_range(KL_GENERATOR[direction], None, dtype)


def has_sampled_term(tail: str) -> bool:
    """Whether ``tail`` adds the sampled term on y not in q, the only term the importance weight
    (and so the sampling log-prob and ``iw_clip``) acts on."""
    return tail in SAMPLED_TAILS


def on_q_term(terms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logprob_topk: torch.Tensor,
              ref_logprob_topk: torch.Tensor, tail: str) -> torch.Tensor:
    """The exact part on q, ``[...]``: ``sum_{j in q} terms(log pi(j), log ref(j))``, of the two
    distributions renormalised over q for ``tail="renorm"`` (the anchor's mass on q comes from
    its log-probs at q, so no vocabulary-wide quantity is needed). ``terms`` is the elementwise
    KL or f-divergence term."""
    if tail == "renorm":
        logprob_topk, ref_logprob_topk = log_renormalize(logprob_topk), log_renormalize(ref_logprob_topk)
    return terms(logprob_topk, ref_logprob_topk).sum(dim=-1)


def topk_kl_from_gathered(
    logprob_topk: torch.Tensor,
    logprob_token: torch.Tensor,
    ref_logprob_topk: torch.Tensor,
    ref_logprob_token: torch.Tensor,
    token_in_q: torch.Tensor,
    *,
    direction: str,
    tail: str = "unbiased",
    iw: Optional[torch.Tensor] = None,
    reference_clamps: bool = False,
) -> torch.Tensor:
    """Top-k KL from per-token gathered quantities (no vocabulary dimension).

    Args:
        logprob_topk: ``[..., k]`` log pi_theta at q (differentiable).
        logprob_token: ``[...]`` log pi_theta(y) (differentiable).
        ref_logprob_topk: ``[..., k]`` log pi_ref at q.
        ref_logprob_token: ``[...]`` log pi_ref(y).
        token_in_q: ``[...]`` bool, whether y is in q.
        direction: ``"reverse"`` or ``"forward"``.
        tail: one of :data:`TOPK_TAILS`.
        iw: ``[...]`` importance weight s (already stop-gradient and clipped), ``None`` for s = 1;
            unused by the tails without a sampled term (:func:`has_sampled_term`).
        reference_clamps: clamp log w in the K5 tail to the reference code's [-20, 20] (any tail).

    All floating inputs must share one dtype (the compute dtype). Returns ``[...]``.
    """
    _check_name(direction, KL_DIRECTIONS, "KL direction")
    _check_name(tail, TOPK_TAILS, "Top-k tail")
    on_q = on_q_term(partial(kl_terms, direction=direction), logprob_topk, ref_logprob_topk.detach(), tail)
    if not has_sampled_term(tail):
        return on_q
    # Masked sampled tail; inputs zeroed where y is in q so no inf/NaN reaches the gradient.
    in_tail = ~token_in_q
    zero = torch.zeros((), dtype=logprob_token.dtype, device=logprob_token.device)
    lp_y = torch.where(in_tail, logprob_token, zero)
    lr_y = torch.where(in_tail, ref_logprob_token.detach(), zero)
    bounds = _tail_log_w_range(direction, tail, logprob_token.dtype, reference_clamps)
    tail_est = sampled_kl_unweighted(lp_y, lr_y, _TAIL_ESTIMATOR[direction], bounds)
    if iw is not None:
        tail_est = iw * tail_est
    out = on_q + torch.where(in_tail, tail_est, zero)
    if tail == "unbiased" and logprob_topk.shape[-1] > 0:
        m = torch.exp(logprob_topk).sum(dim=-1)
        fix = m - sg(m)  # value 0, gradient grad m
        out = out - fix if direction == "reverse" else out + fix
    return out


def topk_kl(
    logits: torch.Tensor,
    token: torch.Tensor,
    topk_index: torch.Tensor,
    ref_logprob_topk: torch.Tensor,
    ref_logprob_token: torch.Tensor,
    *,
    direction: str,
    tail: str = "unbiased",
    sampling_logprob: Optional[torch.Tensor] = None,
    iw_clip: IWClip = None,
    reference_clamps: bool = False,
) -> torch.Tensor:
    """Per-token Top-k KL estimate (Algorithms 1/2 with the tail variant ``tail``).

    Args:
        logits: ``[..., V]`` policy logits, differentiable (bf16 is upcast to fp32; -inf allowed
            for masked vocabulary entries, which must then not be sampled).
        token: ``[...]`` sampled token ids y.
        topk_index: ``[..., k]`` index set q, k distinct ids per row (``ValueError`` otherwise);
            from the sampling policy for ``reverse``, from the anchor for ``forward``. k may be 0.
        ref_logprob_topk: ``[..., k]`` anchor log-probs at q (constant).
        ref_logprob_token: ``[...]`` anchor log-prob at y (constant).
        direction: ``"reverse"`` for KL(pi||ref), ``"forward"`` for KL(ref||pi).
        tail: one of :data:`TOPK_TAILS` (default ``"unbiased"``); see the module docstring.
        sampling_logprob: ``[...]`` log pi_sampling(y) for the off-policy weight; ``None`` = on-policy.
        iw_clip: ``(s_min, s_max)`` clip of the importance weight; ``None`` = unclipped.
        reference_clamps: the reference code's clamps (module docstring); ``False``: none.

    Returns:
        ``[...]`` estimate in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    _check_name(direction, KL_DIRECTIONS, "KL direction")
    _check_name(tail, TOPK_TAILS, "Top-k tail")
    gathered = gather_topk_inputs(logits, token, topk_index, ref_logprob_topk, ref_logprob_token,
                                  tail=tail, sampling_logprob=sampling_logprob, iw_clip=iw_clip,
                                  reference_clamps=reference_clamps)
    *quantities, iw = gathered
    return topk_kl_from_gathered(*quantities, direction=direction, tail=tail, iw=iw,
                                 reference_clamps=reference_clamps)


def gather_topk_inputs(logits, token, topk_index, ref_logprob_topk, ref_logprob_token, *, tail: str,
                       sampling_logprob=None, iw_clip=None, reference_clamps: bool = False) -> tuple:
    """What the ``*_from_gathered`` estimators need, from full ``[..., V]`` logits: log pi at q
    and at y, the anchor's log-probs (compute dtype), whether y is in q, and the tail's
    importance weight. The vocab-parallel op produces the same quantities without gathering."""
    check_unique_indices(topk_index)
    dt = compute_dtype(logits, ref_logprob_topk, ref_logprob_token, sampling_logprob)
    logp = torch.log_softmax(upcast(logits, dt), dim=-1)
    lp_y = gather_last(logp, token)
    iw = None
    if has_sampled_term(tail) and (sampling_logprob is not None or iw_clip is not None):
        iw = importance_weight(lp_y, upcast(sampling_logprob, dt), iw_clip, reference_clamps)
    return (gather_last(logp, topk_index), lp_y, upcast(ref_logprob_topk, dt),
            upcast(ref_logprob_token, dt), token_in_topk(token, topk_index), iw)
