"""SmoothQuant's factors, as the engine check infers them from what is held: the factor an up_proj row carries and
the one its down_proj column must carry back (mindie_match.py). Runs in the engines' environments."""
from __future__ import annotations

from typing import Any

import numpy as np


def row_factors(E: np.ndarray, S: np.ndarray, tol: np.ndarray, free: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the interval [lo, hi] of factors f for which every element of E is within tol of f * S, and the f
    used (1 when the interval holds 1, else its middle): SmoothQuant divides an up_proj row by what it multiplies
    the down_proj column by. (f, lo, hi, whether any f fits)."""
    use = ~free & (np.abs(S) > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        a, b = (E - tol) / S, (E + tol) / S
    lo = np.where(use, np.minimum(a, b), -np.inf).max(axis=1)
    hi = np.where(use, np.maximum(a, b), np.inf).min(axis=1)
    ok = lo <= hi
    one = (lo <= 1.0) & (1.0 <= hi)
    f = np.where(one | ~(np.isfinite(lo) & np.isfinite(hi)), 1.0, 0.5 * (lo + hi))
    return f, lo, hi, ok


def column_factors(h: Any, rows: np.ndarray, E: np.ndarray, S: np.ndarray, tol: np.ndarray, allowed: np.ndarray,
                   qmax: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per down_proj column, the factor m it carries and its relative spread: one m its up_proj row allows
    (`allowed`: [K, 2] bounds) for which every element of the column is within tol of S * m (elements at the range's
    end aside, they may be clipped): 1 where that holds 1, else the middle of the feasible interval; spread 0. Where no single m fits both (real weights:
    Gemma-3's deep layers, where the up row bounds its factor only loosely), the middle of the up row's bounds with
    their half-width as spread: each element may then take any factor the up row allows, no more."""
    end = np.zeros_like(E, dtype=bool) if h.q is None else np.abs(h.q[rows]) >= qmax.get(h.kind, 127)
    use = ~end & (np.abs(S) > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        a, b = (E - tol) / S, (E + tol) / S
    lo = np.maximum(np.where(use, np.minimum(a, b), -np.inf).max(axis=0), allowed[:, 0])
    hi = np.minimum(np.where(use, np.maximum(a, b), np.inf).min(axis=0), allowed[:, 1])
    fits = lo <= hi
    mid = 0.5 * (allowed[:, 0] + allowed[:, 1])
    spread = np.where(fits, 0.0, 0.5 * (allowed[:, 1] - allowed[:, 0]) / np.abs(mid))
    inside = np.where((lo <= 1.0) & (1.0 <= hi), 1.0, 0.5 * (lo + hi))  # never an end: no element on the edge
    return np.where(fits, inside, mid), spread
