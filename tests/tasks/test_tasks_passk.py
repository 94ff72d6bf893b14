"""Unbiased pass@k against brute-force enumeration of k-subsets."""
import itertools
import math

import numpy as np
import pytest

from emapg_megatron.tasks.passk import default_ks, mean_pass_at_k, pass_at_k


def brute_force(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_matches_binomial_formula_and_is_stable_for_large_n():
    for n, c, k in [(64, 3, 8), (200, 17, 50), (1000, 1, 999), (500, 250, 100)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9, abs=1e-12)
    v = pass_at_k(100000, 5, 10)
    assert np.isfinite(v) and 0 < v < 1


def test_edge_cases():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_mean_and_default_ks():
    assert mean_pass_at_k([4, 4], [0, 4], 2) == pytest.approx(0.5)
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]
