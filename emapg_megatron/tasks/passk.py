"""Pass@k with the unbiased estimator (Chen et al., 2021).

For a problem with ``n`` samples of which ``c`` are correct,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds the (huge) binomials, so it is exact to float precision for any n.
It is 1 when ``n - c < k`` (every k-subset holds a correct sample).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["pass_at_k", "pass_at_k_array", "mean_pass_at_k", "default_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` correct."""
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n, got n={n} c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"need 1 <= k <= n, got k={k} n={n}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_array(ns: Sequence[int], cs: Sequence[int], k: int) -> np.ndarray:
    """pass@k per problem (vectorised over problems)."""
    return np.array([pass_at_k(n, c, k) for n, c in zip(ns, cs)], dtype=np.float64)


def mean_pass_at_k(ns: Sequence[int], cs: Sequence[int], k: int) -> float:
    """Mean pass@k over problems (NaN for no problems)."""
    vals = pass_at_k_array(ns, cs, k)
    return float(vals.mean()) if len(vals) else float("nan")


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n (n itself included)."""
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    if n >= 1:
        ks.append(n)
    return ks


def _check(ks: Iterable[int], n: int) -> list[int]:
    out = sorted({int(k) for k in ks})
    bad = [k for k in out if k < 1 or k > n]
    if bad:
        raise ValueError(f"k must lie in [1, n={n}], got {bad}")
    return out
