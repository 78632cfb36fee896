"""pass@k estimator and bootstrap intervals: exact combinatorics, brute force, reproducibility."""

import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prorl_trl.evaluation import bootstrap_interval, pass_at_k, pass_at_k_curve, pass_at_k_per_problem


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_matches_exact_combinatorics_on_random_cases():
    rng = random.Random(1234)
    for _ in range(500):
        n = rng.randint(1, 300)
        k = rng.randint(1, n)
        c = rng.randint(0, n)
        assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), rel=1e-9, abs=1e-12)


@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
@settings(max_examples=200, deadline=None)
def test_matches_exact_combinatorics_property(case):
    n, c, k = case
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(float(exact(n, c, k)), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("n", range(1, 8))
def test_matches_brute_force_enumeration(n):
    """pass@k is the share of k-subsets of the n samples that contain a correct sample."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            share = Fraction(sum(any(s) for s in subsets), len(subsets))
            assert pass_at_k(n, c, k) == pytest.approx(float(share), abs=1e-12)


def test_exactly_one_when_fewer_wrong_samples_than_k():
    assert pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(128, 1, 128) == 1.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 0, 10) == 0.0


def test_large_n_does_not_overflow():
    value = pass_at_k(1024, 3, 512)
    assert value == pytest.approx(float(exact(1024, 3, 512)), rel=1e-9)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 5), (0, 0, 1), (4, 1, 0)])
def test_bad_counts_raise_clear_errors(n, c, k):
    with pytest.raises(ValueError, match="pass@"):
        pass_at_k(n, c, k)


def test_vectorised_helpers_agree_with_scalar():
    n = np.array([8, 8, 16, 4])
    c = np.array([0, 3, 16, 1])
    per_problem = pass_at_k_per_problem(n, c, 2)
    assert per_problem.tolist() == [pass_at_k(a, b, 2) for a, b in zip(n, c)]
    curve = pass_at_k_curve(n, c, [1, 4])
    assert curve[1] == pytest.approx(np.mean(c / n))  # pass@1 is the plain accuracy
    assert curve[4] == pytest.approx(np.mean([pass_at_k(a, b, 4) for a, b in zip(n, c)]))
    with pytest.raises(ValueError, match="shape"):
        pass_at_k_per_problem([4, 4], [1], 1)


def test_bootstrap_is_reproducible_and_seed_dependent():
    values = np.random.default_rng(0).random(50)
    first = bootstrap_interval(values, num_resamples=500, seed=7)
    assert first == bootstrap_interval(values, num_resamples=500, seed=7)
    assert first != bootstrap_interval(values, num_resamples=500, seed=8)
    low, high = first
    assert low < values.mean() < high


def test_bootstrap_interval_narrows_with_more_problems_and_handles_edges():
    rng = np.random.default_rng(1)
    small = bootstrap_interval(rng.random(20), num_resamples=400, seed=0)
    large = bootstrap_interval(rng.random(2000), num_resamples=400, seed=0)
    assert large[1] - large[0] < small[1] - small[0]
    assert bootstrap_interval([0.5, 0.5, 0.5], seed=0) == (0.5, 0.5)
    assert all(math.isnan(v) for v in bootstrap_interval([], seed=0))
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval([1.0], confidence=1.5)
