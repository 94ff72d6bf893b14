"""The KL loss types: one table, keyed by the ``--kl-loss-type`` CLI name (no distributed code).

Everything that names a token-level KL loss (the CLI choices, the trainer's choice of where the
index set q comes from, ``emapg_megatron.parallel.kl_from_policy_terms``) reads this table.

=========================  =========  =========  ========  ====================================
name                       family     direction  q from    estimator
=========================  =========  =========  ========  ====================================
``k1`` .. ``k4``, ``k3++``  sampled    reverse    (no q)    ``sampled_kl`` (Table 1)
``k5``                     sampled    forward    (no q)    ``sampled_kl`` (Table 1)
``topk-reverse``           topk-kl    reverse    old       ``topk_kl_from_gathered`` (Alg. 1)
``topk-forward``           topk-kl    forward    anchor    ``topk_kl_from_gathered`` (Alg. 2)
``topk-pearson_chi2``      topk-fdiv  reverse    old       ``topk_fdiv_from_gathered`` (H.3)
``topk-neyman_chi2``       topk-fdiv  forward    anchor    ``topk_fdiv_from_gathered`` (H.3)
``topk-squared_hellinger`` topk-fdiv  forward    anchor    ``topk_fdiv_from_gathered`` (H.3)
``topk-jensen_shannon``    topk-fdiv  forward    anchor    ``topk_fdiv_from_gathered`` (H.3)
``topk-total_variation``   topk-fdiv  forward    anchor    ``topk_fdiv_from_gathered`` (H.3)
``topk-alpha``             topk-fdiv  by alpha   by alpha  ``topk_fdiv_from_gathered``, alpha
=========================  =========  =========  ========  ====================================

Where q comes from ("old" = the top-k of the sampling policy pi_old, computed in the old-policy
pass; "anchor" = the top-k of the anchor itself, computed in the anchor pass). Any q fixed before
the update keeps every Top-k estimator unbiased (Appendix H.3: "Top-K is a variance/compute
heuristic"), so the choice is about variance: q should hold the mass that would make the sampled
tail large. The paper takes pi_old's top-k for the reverse KL (Alg. 1) and the anchor's for the
forward KL (Alg. 2): "the policy under which the expectation is taken". For an f-divergence the
tail's value is ``sum_{j not in q} ref(j) f(t_j) = sum_{j not in q} pi(j) g_f(w_j)``: a token the
policy favours and the anchor neglects adds up to ``g_f(0)`` per unit of *policy* mass, one the
anchor favours and the policy neglects up to ``f(0)`` per unit of *anchor* mass (the limits of
:func:`~emapg_megatron.kl.divergences.f_at_zero` / ``g_at_zero``). So q covers the policy when
``g_f(0) > f(0)`` (direction "reverse") and the anchor otherwise (direction "forward"):

* reverse KL (0 vs inf), Pearson chi^2 (1 vs inf), alpha > 1/2: "reverse", q from pi_old;
* forward KL, Neyman chi^2, alpha < 1/2: "forward", q from the anchor;
* ties (the symmetric squared Hellinger, Jensen-Shannon, total variation, alpha = 1/2): the
  anchor, because the tail ``r g_f(w)``, sampled from the policy, is bounded by ``g_f(0)`` where
  the anchor vanishes but grows like ``f(0) w`` where the anchor dominates. There "forward" only
  names the q rule.

The rule reproduces both KL choices, is continuous at the alpha-divergence's KL limits
(alpha -> 1 is the reverse KL, alpha -> 0 the forward KL) and respects its duality
``D_alpha(pi||ref) = D_{1-alpha}(ref||pi)``. ``topk-alpha`` is therefore the one entry whose
direction and q depend on its parameter: "reverse" (q from pi_old) iff alpha > 1/2.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional

from .catalog import (
    ALL_DIVERGENCES,
    ALPHA_RANGE,
    F_DIVERGENCES,
    KL_DIRECTIONS,
    SAMPLED_ESTIMATOR_DIRECTION,
    SAMPLED_ESTIMATORS,
    check_divergence,
    check_name,
    f_at_zero,
    g_at_zero,
)

__all__ = [
    "SAMPLED",
    "TOPK_KL",
    "TOPK_FDIV",
    "KLLossType",
    "LOSS_TYPES",
    "LOSS_TYPE_NAMES",
    "loss_type",
    "topk_fdiv_type",
    "uses_topk",
]

#: Families: sampled estimators (O(1) memory), Top-k KL (Alg. 1/2), Top-k f-divergences (App. H.3).
SAMPLED, TOPK_KL, TOPK_FDIV = "sampled", "topk-kl", "topk-fdiv"

#: The keyword that selects the loss type inside its family's estimator callable.
_SELECTOR = {SAMPLED: "estimator", TOPK_KL: "direction", TOPK_FDIV: "divergence"}


@dataclass(frozen=True)
class KLLossType:
    """One ``--kl-loss-type``: what it computes and what it needs."""

    name: str
    """The CLI name (``--kl-loss-type``) and the ``kind=`` of ``kl_from_policy_terms``."""

    family: str
    """``"sampled"`` (Table 1; needs only log pi(y)), ``"topk-kl"`` (Algorithms 1/2) or
    ``"topk-fdiv"`` (Appendix H.3): the exact term on q plus a masked sampled tail."""

    estimator_name: str
    """The per-token function of :mod:`emapg_megatron.kl` that computes it (:attr:`estimator`)."""

    selector: str
    """The value that picks this loss type inside ``estimator``: the sampled estimator
    (``"k3++"``), the KL direction (``"reverse"``) or the f-divergence generator
    (``"pearson_chi2"``); :meth:`kwargs` passes it under the right keyword."""

    needs_alpha: bool
    """Whether it takes ``alpha`` (only ``topk-alpha``): then alpha is required, otherwise it
    must be ``None``. Valid alpha: any finite real except 0 and 1."""

    @property
    def estimator(self) -> Callable:
        """The function itself: ``sampled_kl`` (on log-probs), ``topk_kl_from_gathered`` or
        ``topk_fdiv_from_gathered`` (on log-probs gathered at q and y). Call it with
        ``**kwargs(alpha)``. Imported on first use: the table itself needs no torch."""
        return getattr(importlib.import_module(__package__), self.estimator_name)

    def check_alpha(self, alpha: Optional[float]) -> None:
        """``ValueError`` unless ``alpha`` is given (and valid) exactly when it is needed."""
        if self.needs_alpha and alpha is None:
            raise ValueError(f"KL loss type {self.name!r} needs alpha (--kl-alpha): {ALPHA_RANGE}")
        if not self.needs_alpha and alpha is not None:
            raise ValueError(f"alpha is only used by the alpha-divergence, not by KL loss type {self.name!r}")
        if self.needs_alpha:
            check_divergence(self.selector, alpha)

    def kwargs(self, alpha: Optional[float] = None) -> dict:
        """Keyword arguments that select this loss type in :attr:`estimator` (alpha checked)."""
        self.check_alpha(alpha)
        kw = {_SELECTOR[self.family]: self.selector}
        if self.needs_alpha:
            kw["alpha"] = alpha
        return kw

    def direction(self, alpha: Optional[float] = None) -> str:
        """``"reverse"`` or ``"forward"``: the KL whose value a sampled estimator targets
        (``SAMPLED_ESTIMATOR_DIRECTION``), the Top-k KL's direction, or for an f-divergence the
        KL it sides with: ``"reverse"`` iff ``g_f(0) > f(0)`` (see the module docstring)."""
        self.check_alpha(alpha)
        if self.family == SAMPLED:
            return SAMPLED_ESTIMATOR_DIRECTION[self.selector]
        if self.family == TOPK_KL:
            return self.selector
        return "reverse" if g_at_zero(self.selector, alpha) > f_at_zero(self.selector, alpha) else "forward"

    def q_source(self, alpha: Optional[float] = None) -> Optional[str]:
        """Where the index set q comes from: ``None`` (sampled: no q), ``"old"`` (top-k of the
        sampling policy, reverse-style) or ``"anchor"`` (top-k of the anchor, forward-style)."""
        if self.family == SAMPLED:
            self.check_alpha(alpha)
            return None
        return "old" if self.direction(alpha) == "reverse" else "anchor"


def _sampled_type(estimator: str) -> KLLossType:
    return KLLossType(estimator, SAMPLED, "sampled_kl", estimator, needs_alpha=False)


def _topk_kl_type(direction: str) -> KLLossType:
    return KLLossType(f"topk-{direction}", TOPK_KL, "topk_kl_from_gathered", direction, needs_alpha=False)


def topk_fdiv_type(divergence: str) -> KLLossType:
    """The Top-k f-divergence of Appendix H.3 for any generator in ``ALL_DIVERGENCES``.

    The table holds it for ``F_DIVERGENCES`` only: with the KL generators (``reverse_kl``,
    ``forward_kl``) it is unbiased too, but ``topk-reverse`` / ``topk-forward`` are the same
    divergences with the lower-variance K4/K5 tails.
    """
    check_name(divergence, ALL_DIVERGENCES, "divergence")
    return KLLossType(f"topk-{divergence}", TOPK_FDIV, "topk_fdiv_from_gathered", divergence,
                      needs_alpha=divergence == "alpha")


#: Every KL loss type by CLI name, in Table 1 / Algorithm / Table 5 order (read-only).
LOSS_TYPES: Mapping[str, KLLossType] = MappingProxyType({
    t.name: t
    for t in (
        *map(_sampled_type, SAMPLED_ESTIMATORS),
        *map(_topk_kl_type, KL_DIRECTIONS),
        *map(topk_fdiv_type, F_DIVERGENCES),
    )
})

#: The valid ``--kl-loss-type`` names (for argparse ``choices=``).
LOSS_TYPE_NAMES = tuple(LOSS_TYPES)


def loss_type(name: str) -> KLLossType:
    """The table entry for ``name``; ``ValueError`` listing the valid names otherwise."""
    check_name(name, LOSS_TYPE_NAMES, "KL kind")
    return LOSS_TYPES[name]


def uses_topk(name: str, k: int) -> bool:
    """Whether ``name`` needs an index set q of ``k`` ids (a Top-k family with k > 0). With k = 0
    a Top-k loss is its sampled tail alone (K4 / K5 / Kf++) and needs no q."""
    return loss_type(name).family != SAMPLED and k > 0

