"""Blend mode's policies as numbers (docs/ARCHITECTURE.md, "Blend mode"): how many of a blended prefill's n
candidates each policy computes, and at which check layers "kv-deviation" narrows them.

k(x) = min(n, floor(x n + 0.5)). "chunk-heads" (EPIC) computes the first k(r) tokens of each chunk piece at every
layer. "kv-deviation" (CacheBlend) computes every candidate at layer 0 and, at each check layer l = 1..C
(C = min(MAX_CHECK_LAYERS, layers - 1)), keeps the k(r_l) that deviate most, r_l = r (1 + (C - l) / C): gradual
filtering, down to k(r) at the last check layer. "adaptive" keeps the same counts at the same layers, shared out
among the chunk pieces (the plan's groups) by how far each one's K/V moved: Sainte-Laguë apportionment of k(r_l)
places in proportion to each piece's deviation sum, its most deviating candidates taking them (row_plan.py,
`group_scores`), so the places add up to k(r_l) whatever the shares. r = 0 computes no candidate; r = 1 keeps every
row.
"""
from __future__ import annotations

import itertools
import math

MAX_CHECK_LAYERS = 3


def num_kept(ratio: float, n: int) -> int:
    """k(x): the candidates a ratio keeps, rounded half up."""
    return min(n, math.floor(ratio * n + 0.5))


def check_layers(num_layers: int) -> tuple[int, ...]:
    """The check layers 1..C of "kv-deviation" in a model of `num_layers` layers."""
    return tuple(range(1, min(MAX_CHECK_LAYERS, num_layers - 1) + 1))


def kept_counts(r: float, n: int, num_layers: int) -> tuple[int, ...]:
    """k(r_l) of n candidates at each check layer l = 1..C of "kv-deviation": non-increasing."""
    return tuple(itertools.accumulate((num_kept(x, n) for x in check_ratios(r, num_layers)), min))


def computed_candidates(r: float, n: int, num_layers: int) -> list[int]:
    """Candidates of n a "kv-deviation" blend computes at each layer: all at layer 0, k(r_l) at check layer l, the
    last check layer's k after it (a one-layer model computes all)."""
    kept = kept_counts(r, n, num_layers)
    return [n, *kept] + [kept[-1]] * (num_layers - 1 - len(kept)) if kept else [n] * num_layers


def check_ratios(r: float, num_layers: int) -> list[float]:
    """r_l for the check layers l = 1..C of "kv-deviation": from r (1 + (C - 1) / C) down to r."""
    c = min(MAX_CHECK_LAYERS, num_layers - 1)
    return [min(1.0, r * (1 + (c - layer) / c)) for layer in range(1, c + 1)]
