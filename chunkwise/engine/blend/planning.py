"""A blended prefill's row plan, resolved against the prefix cache: which of its tokens are computed at which layer,
and where the others' K/V come from.

A blended prompt is prefilled in one step from c0, the end of its exact prefix-cache hit. Its *candidates* are the
tokens of its chunk pieces whose isolated K/V the prefix cache holds: a chunk registered with the engine was
computed on its own, at positions 0..n-1, so its full pages sit in the prefix cache under a hash chain of its own
tokens, keyed by content and not by what precedes it in a request. Each candidate's K/V are placed: copied from
those pages to its own slot with K re-rotated by its chunk's new start. Every other token (text and id pieces, a
chunk's tail past its last full page, a chunk whose pages were evicted, the prompt's last token) is a *fixed row*,
computed at every layer like any prefill. Which candidates are computed: chunkwise/engine/blend/policy.py.

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


def plan_blend(params: Blend, pieces: tuple[Piece, ...], start: int, pool, num_layers: int,
               chain_pages=None) -> BlendJob:
    """The blend of a prompt made of `pieces` whose first `start` tokens are exact, against `pool`'s prefix cache;
    `chain_pages(chunk)` gives a chunk's cached pages (default: `pool.chain_pages` of its tokens)."""
    if chain_pages is None:
        def chain_pages(chunk):
            return pool.chain_pages(chunk.token_ids)
    ps = pool.page_size
    lengths = np.array([p.num_tokens for p in pieces], np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    rows = total - start
    # Every chunk piece's cached tokens at once (a Python step per piece, none per token or page): their
    # positions ascend with the pieces, so the candidates come out in row order.
    chunked = [j for j, p in enumerate(pieces) if p.chunk is not None]
    chains = [np.asarray(chain_pages(pieces[j].chunk), np.int64) for j in chunked]
    num_pages = np.array([len(c) for c in chains], np.int64)
    tokens = num_pages * ps
    owner = np.repeat(np.arange(len(chains)), tokens)           # each cached token's chunk piece (of `chunked`)
    off = np.arange(int(tokens.sum())) - np.repeat(np.cumsum(tokens) - tokens, tokens)   # its offset in its chunk
    firsts = (ends - lengths)[chunked]
    pos = firsts[owner] + off
    inside = (pos >= start) & (pos < total - 1)   # the prompt's last token gives the logits: always computed
    owner, off, idx = owner[inside], off[inside], pos[inside] - start
    pages = np.concatenate(chains) if chains else np.zeros(0, np.int64)
    page_at = np.cumsum(num_pages) - num_pages                  # each chain's first page in `pages`
    src = pages[page_at[owner] + off // ps] * ps + off % ps
    heads = np.array([math.floor(params.recompute_ratio * pieces[j].num_tokens + 0.5) for j in chunked], np.int64)
    candidate = np.zeros(rows, bool)
    candidate[idx] = True
    head = np.zeros(rows, bool)
    head[idx] = off < heads[owner]
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
    return BlendJob(params, start, RowPlan(computed, candidate, src, firsts[owner], layers, kept),
                    piece_rows)
