"""The names of every estimator, KL direction, f-divergence and Top-k tail, and the scalar
properties the ``--kl-loss-type`` registry decides with: no torch, so the command line (its
choices and checks) and ``--help`` load none of the maths. The estimator modules import their
names from here."""

from __future__ import annotations

import math
from typing import Optional, Sequence

#: Valid ``direction`` values of the Top-k KL and of the exact KL.
KL_DIRECTIONS = ("reverse", "forward")

#: Valid sampled ``estimator`` names, in Table 1 order.
SAMPLED_ESTIMATORS = ("k1", "k2", "k3", "k3++", "k4", "k5")

#: The KL direction whose *value* each sampled estimator targets in expectation (``k2`` targets
#: none exactly; its gradient is the reverse-KL gradient, so it is listed as reverse).
SAMPLED_ESTIMATOR_DIRECTION = {"k1": "reverse", "k2": "reverse", "k3": "reverse", "k3++": "reverse",
                               "k4": "reverse", "k5": "forward"}

#: Table 5 f-divergences (besides the two KLs), valid values for ``divergence=``.
F_DIVERGENCES = ("pearson_chi2", "neyman_chi2", "squared_hellinger", "jensen_shannon", "total_variation",
                 "alpha")
#: Everything ``divergence_terms`` / ``topk_fdiv`` understand (the KLs via their f-generators).
ALL_DIVERGENCES = F_DIVERGENCES + ("reverse_kl", "forward_kl")

#: The valid alpha of the alpha-divergence, in words (for error messages and docs).
ALPHA_RANGE = "any finite real except 0 and 1 (its limits there are the forward and the reverse KL)"

#: Valid ``tail`` values: the corrected estimator, Algorithms 1/2 as the reference code runs them,
#: truncated KL (``"none"`` and its other name ``"truncate"``), the KL renormalised over q.
TOPK_TAILS = ("unbiased", "paper", "none", "truncate", "renorm")
#: The tails that add the sampled term on y not in q; the others are deterministic given q.
SAMPLED_TAILS = ("unbiased", "paper")

_LOG2 = math.log(2.0)


def check_name(name: str, valid: Sequence[str], what: str) -> str:
    if name not in valid:
        raise ValueError(f"unknown {what} {name!r}; expected one of {tuple(valid)}")
    return name


def check_divergence(name: str, alpha: Optional[float]) -> None:
    """Raise ``ValueError`` unless ``name`` is known and ``alpha`` is given exactly when it is used."""
    check_name(name, ALL_DIVERGENCES, "divergence")
    if name == "alpha":
        if alpha is None:
            raise ValueError(f"divergence='alpha' needs alpha=: {ALPHA_RANGE}")
        if not math.isfinite(alpha) or alpha in (0.0, 1.0):
            raise ValueError(f"alpha-divergence got alpha={alpha!r}; it needs {ALPHA_RANGE}")
    elif alpha is not None:
        raise ValueError(f"alpha= is only used by divergence='alpha', not {name!r}")


def f_at_zero(name: str, alpha: Optional[float] = None) -> float:
    """lim_{t->0+} f(t): the contribution per unit Q of an index the policy gives zero mass."""
    table = {
        "reverse_kl": 0.0,
        "forward_kl": math.inf,
        "pearson_chi2": 1.0,
        "neyman_chi2": math.inf,
        "squared_hellinger": 0.5,
        "jensen_shannon": 0.5 * _LOG2,
        "total_variation": 0.5,
    }
    if name == "alpha":
        return 1.0 / alpha if alpha > 0 else math.inf
    return table[name]


def g_at_zero(name: str, alpha: Optional[float] = None) -> float:
    """lim_{w->0+} g_f(w): the contribution per unit P of an index the anchor gives zero mass."""
    table = {
        "reverse_kl": math.inf,
        "forward_kl": 0.0,
        "pearson_chi2": math.inf,
        "neyman_chi2": 1.0,
        "squared_hellinger": 0.5,
        "jensen_shannon": 0.5 * _LOG2,
        "total_variation": 0.5,
    }
    if name == "alpha":
        return 1.0 / (1.0 - alpha) if alpha < 1 else math.inf
    return table[name]
