"""Unbiased pass@k (Chen et al. 2021) and bootstrap intervals over problems.

With `n` samples of which `c` are correct, pass@k = 1 - C(n-c, k) / C(n, k): the chance that `k` samples drawn
without replacement from the `n` contain a correct one. The binomials overflow for the n (>= 128) used in ProRL's
new-ability experiments, so we use the product form 1 - prod_{i=n-c+1}^{n} (1 - k/i), which only multiplies numbers
in [0, 1] and is exactly 1.0 when fewer than `k` samples are wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check(n: int, c: int, k: int) -> None:
    if n < 1 or k < 1:
        raise ValueError(f"pass@k needs n >= 1 samples and k >= 1, got n={n}, k={k}.")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c}, n={n}.")
    if k > n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, got n={n}; raise --n or lower --k.")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `n` samples, `c` of them correct.

    Example:
        >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 3, 2)
        (0.25, 0.5, 1.0)
    """
    n, c, k = int(n), int(c), int(k)
    _check(n, c, k)
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def pass_at_k_per_problem(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> np.ndarray:
    """pass@k of every problem (arrays of per-problem sample and correct counts), as a float array."""
    num_samples, num_correct = np.asarray(num_samples), np.asarray(num_correct)
    if num_samples.shape != num_correct.shape:
        raise ValueError(f"num_samples {num_samples.shape} and num_correct {num_correct.shape} differ in shape.")
    return np.array([pass_at_k(n, c, k) for n, c in zip(num_samples.tolist(), num_correct.tolist())], dtype=float)


def pass_at_k_curve(num_samples: Sequence[int], num_correct: Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """Mean pass@k over problems for every k in `ks`."""
    return {int(k): float(pass_at_k_per_problem(num_samples, num_correct, k).mean()) for k in ks}


def bootstrap_interval(
    values: Sequence[float], num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem `values`, resampling problems with replacement.

    Problems are the unit of resampling because the per-problem estimate already averages its n samples; the
    interval is therefore about "what if we had drawn other problems", which is what comparing models needs.
    The same `seed` gives the same interval.
    """
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return float("nan"), float("nan")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}.")
    rng = np.random.default_rng(seed)
    means = np.empty(num_resamples)
    # Chunks keep memory at ~chunk x problems floats however many resamples are asked for.
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        means[start:stop] = values[rng.integers(0, values.size, size=(stop - start, values.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)
