"""Which problem features predict solving: OLS of per-problem pass@k on level and subject indicators.

As in ProRL's analysis, each problem is one observation, its accuracy at the largest k the outcome, and
categorical features (MATH `level`, `subject`) enter as 0/1 indicators with the first category as the baseline.
Plain numpy least squares with classical standard errors; p-values from scipy's t distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def design_matrix(frame: pd.DataFrame, features: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Intercept plus one indicator per non-baseline category of every feature (baseline: the smallest value)."""
    columns, names = [np.ones(len(frame))], ["intercept"]
    for feature in features:
        values = frame[feature].astype(str)
        categories = sorted(values.unique(), key=lambda v: (0, float(v), v) if _numeric(v) else (1, 0.0, v))
        for category in categories[1:]:
            columns.append((values == category).to_numpy(dtype=float))
            names.append(f"{feature}={category}")
    return np.column_stack(columns), names


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def ols(y: np.ndarray, x: np.ndarray, names: Sequence[str]) -> pd.DataFrame:
    """Coefficients, standard errors, t statistics and two-sided p-values of `y ~ x` (no robust corrections)."""
    from scipy import stats

    y, x = np.asarray(y, dtype=float), np.asarray(x, dtype=float)
    observations, parameters = x.shape
    degrees = observations - np.linalg.matrix_rank(x)
    if degrees <= 0:
        raise ValueError(
            f"OLS needs more problems ({observations}) than independent terms ({np.linalg.matrix_rank(x)}); "
            "evaluate more problems or drop a --breakdown field."
        )
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residuals = y - x @ coef
    sigma2 = float(residuals @ residuals) / degrees
    covariance = sigma2 * np.linalg.pinv(x.T @ x)
    std_err = np.sqrt(np.clip(np.diag(covariance), 0, None))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(std_err > 0, coef / std_err, np.nan)
    p = 2 * stats.t.sf(np.abs(t), degrees)
    return pd.DataFrame({"term": list(names), "coef": coef, "std_err": std_err, "t": t, "p": p})


def feature_regression(per_problem: pd.DataFrame, outcome: str, features: Sequence[str]) -> pd.DataFrame:
    """OLS of `outcome` (a per-problem column, e.g. pass@k at the largest k) on indicators of `features`."""
    x, names = design_matrix(per_problem, features)
    return ols(per_problem[outcome].to_numpy(dtype=float), x, names)
