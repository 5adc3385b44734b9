"""A paired bootstrap confidence interval for a difference in accuracy between two modes on the same tasks.

Per task the difference d = mode right - baseline right (each 0 or 1); the tasks are resampled with replacement,
the same task indices for both modes (paired: a task hard for both cancels), and the interval is the percentile
interval of the resampled mean d. Seeded: the same inputs and seed give the same interval."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    difference: float   # mean(mode) - mean(baseline)
    low: float
    high: float


def paired_bootstrap(mode: Sequence[float], baseline: Sequence[float], seed: int = 0, resamples: int = 4000,
                     level: float = 0.95) -> Interval:
    """The mean paired difference mode - baseline over tasks and its bootstrap `level` interval."""
    a, b = np.asarray(mode, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_bootstrap needs two equal-length non-empty vectors, got shapes {a.shape}, {b.shape}")
    if not 0 < level < 1:
        raise ValueError(f"paired_bootstrap level must be in (0, 1), got {level!r}")
    d = a - b
    idx = np.random.default_rng(seed).integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(d.mean()), float(low), float(high))
