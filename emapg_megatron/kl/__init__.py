"""Single-device per-token KL and f-divergence estimators (the reference maths; no distributed code).

Modules, one concern each:

* :mod:`.sampled`     - sampled estimators K1, K2, K3, K3++, K4, K5 (Table 1, §5.2)
* :mod:`.topk`        - Top-k KL, Algorithms 1/2 with the ``unbiased`` / ``paper`` / ``none``
  (= ``truncate``) / ``renorm`` tails
* :mod:`.fdiv`        - sampled Kf++ and Top-k f-divergences (Appendix H) and exact references
* :mod:`.exact`       - exact per-token KL over the full vocabulary
* :mod:`.sequence`    - sequence-level KL (eq. 10-12), the WARP / InstructGPT baseline
* :mod:`.divergences` - the f / g generator functions and zero-mass-safe elementwise terms
* :mod:`.enumeration` - exact expectations over all sampled tokens (test utility)
* :mod:`.registry`    - the ``--kl-loss-type`` table: family, direction, where q comes from, alpha

Conventions: every function works per token on ``[..., V]`` logits / ``[..., k]`` index sets /
``[...]`` per-token values and returns ``[...]``; autograd flows into the policy only (anchor and
sampling log-probs are constants); maths runs in fp32, or fp64 when an input is fp64 (bf16 is
upcast); ``-inf`` logits (masked vocabulary padding) are safe in values and gradients.

Factoring for the vocab-parallel op: :func:`topk_kl` and :func:`topk_fdiv` are thin wrappers that
compute ``log_softmax``, gather at q and y, and call :func:`topk_kl_from_gathered` /
:func:`topk_fdiv_from_gathered`, which only see ``[..., k]`` and ``[...]`` tensors (policy
log-probs at q and y, anchor log-probs at q and y, the ``y in q`` mask and the importance weight).
:func:`sampled_kl` already works on per-token log-probs. A vocab-parallel implementation supplies
those gathered quantities and reuses the per-token maths unchanged. See ``docs/kl_estimators.md``.
"""

import importlib

# The names and the loss-type table need no torch (the command line reads them); the maths is
# loaded on first use of one of its names.
from .catalog import (
    ALL_DIVERGENCES,
    ALPHA_RANGE,
    F_DIVERGENCES,
    KL_DIRECTIONS,
    SAMPLED_ESTIMATOR_DIRECTION,
    SAMPLED_ESTIMATORS,
    SAMPLED_TAILS,
    TOPK_TAILS,
)
from .registry import (
    LOSS_TYPE_NAMES,
    LOSS_TYPES,
    SAMPLED,
    TOPK_FDIV,
    TOPK_KL,
    KLLossType,
    loss_type,
    topk_fdiv_type,
    uses_topk,
)

_LAZY = {
    "check_unique_indices": "_common", "importance_weight": "_common", "token_in_topk": "_common",
    "divergence_terms": "divergences",
    "exact_kl": "exact", "kl_terms": "exact",
    "fdiv_exact": "fdiv", "sampled_fdiv": "fdiv", "topk_fdiv": "fdiv", "topk_fdiv_from_gathered": "fdiv",
    "sampled_kl": "sampled",
    "sequence_kl": "sequence", "sequence_kl_loss": "sequence", "sequence_kl_penalized_reward": "sequence",
    "PAPER_K5_LOG_W_CLAMP": "topk", "has_sampled_term": "topk", "topk_kl": "topk",
    "topk_kl_from_gathered": "topk",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # the --kl-loss-type registry
    "KLLossType",
    "LOSS_TYPES",
    "LOSS_TYPE_NAMES",
    "SAMPLED",
    "TOPK_KL",
    "TOPK_FDIV",
    "loss_type",
    "topk_fdiv_type",
    "uses_topk",
    # names for CLI choices=
    "SAMPLED_ESTIMATORS",
    "SAMPLED_ESTIMATOR_DIRECTION",
    "TOPK_TAILS",
    "SAMPLED_TAILS",
    "KL_DIRECTIONS",
    "F_DIVERGENCES",
    "ALL_DIVERGENCES",
    "ALPHA_RANGE",
    "PAPER_K5_LOG_W_CLAMP",
    # estimators
    "sampled_kl",
    "topk_kl",
    "topk_kl_from_gathered",
    "sampled_fdiv",
    "topk_fdiv",
    "topk_fdiv_from_gathered",
    # exact references
    "exact_kl",
    "kl_terms",
    "fdiv_exact",
    "divergence_terms",
    # sequence level
    "sequence_kl",
    "sequence_kl_loss",
    "sequence_kl_penalized_reward",
    # helpers
    "importance_weight",
    "has_sampled_term",
    "check_unique_indices",
    "token_in_topk",
]
