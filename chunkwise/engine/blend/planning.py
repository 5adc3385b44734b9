"""A blended prefill's row plan, resolved against the prefix cache: which of its tokens are computed at which layer,
and where the others' K/V come from.

A blended prompt is prefilled in one step from c0, the end of its exact prefix-cache hit. Its *candidates* are the
tokens of its chunk pieces whose variant's K/V the prefix cache holds: a chunk registered with the engine after a
context (none: the isolated variant) was computed as the continuation of the context's ids, at positions
len(context)..len(context)+n-1, so the full pages of context + chunk sit in the prefix cache under their hash chain,
keyed by content and not by what precedes the chunk in a request. The validated request names each piece's variant
(`Piece.context`: the longest registered context the prompt opens with). Each candidate's K/V are placed: copied
from those pages to its own slot with K re-rotated by its chunk's new start less its context's length. Every other
token (text and id pieces, a chunk with no variant, a chunk's tail past the last full page, a variant whose pages
were evicted, the prompt's last token) is a *fixed row*, computed at every layer like any prefill. Which candidates
are computed: chunkwise/engine/blend/policy.py.

The scheduler plans after the step's allocations (`Blender.plan`): a page still cached then is not overwritten before
this step's forward reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from chunkwise.chunks import Blend, Piece
from chunkwise.engine.blend.policy import check_layers, check_ratios, num_kept
from chunkwise.engine.row_plan import RowPlan


@dataclass(frozen=True)
class BlendJob:
    """One blended prefill of rows [start, start + R) of a sequence: its row plan (candidates are its placed rows)
    and what its report needs. Rows are relative to `start` (c0)."""
    params: Blend
    start: int                 # c0: the prompt's exact prefix ends here
    rows: RowPlan
    piece_rows: np.ndarray     # int64 [R]: each row's piece index


def plan_blend(params: Blend, pieces: tuple[Piece, ...], start: int, pool, num_layers: int) -> BlendJob:
    """The blend of a prompt made of `pieces` whose first `start` tokens are exact, against `pool`'s prefix cache."""
    ps = pool.page_size
    lengths = np.array([p.num_tokens for p in pieces], np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    rows = total - start
    candidate = np.zeros(rows, bool)
    src = np.full(rows, -1, np.int64)
    group = np.full(rows, -1, np.int64)     # "adaptive": each candidate's piece
    delta = np.zeros(rows, np.int64)
    head = np.zeros(rows, bool)
    for j, p in enumerate(pieces):
        if p.chunk is None or p.context is None:
            continue
        first = int(ends[j] - lengths[j])
        n_ctx = len(p.context)
        pages = np.array(pool.chain_pages(p.context.token_ids + p.chunk.token_ids), np.int64)
        off = np.arange(n_ctx, max(n_ctx, len(pages) * ps))   # the chunk's tokens in those pages
        pos = first + off - n_ctx
        inside = (pos >= start) & (pos < total - 1)   # the prompt's last token gives the logits: always computed
        idx = pos[inside] - start
        candidate[idx] = True
        src[idx] = pages[off[inside] // ps] * ps + off[inside] % ps
        delta[idx] = first - n_ctx
        group[idx] = j
        head[idx] = off[inside] - n_ctx < math.floor(params.recompute_ratio * p.num_tokens + 0.5)
    n = int(candidate.sum())
    layers: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    if params.policy == "chunk-heads":
        computed = ~candidate | head
    elif params.recompute_ratio == 0 or n == 0:
        computed = ~candidate
    else:
        computed = np.ones(rows, bool)
        layers = check_layers(num_layers)
        kept = tuple(np.minimum.accumulate([num_kept(x, n) for x in check_ratios(params.recompute_ratio,
                                                                                   num_layers)]).tolist())
    piece_rows = np.repeat(np.arange(len(pieces)), lengths)[start:]
    groups = group if layers and params.policy == "adaptive" else None
    return BlendJob(params, start, RowPlan(computed, candidate, src[candidate], delta[candidate], layers, kept,
                                           groups), piece_rows)
