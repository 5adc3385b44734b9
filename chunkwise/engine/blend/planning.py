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
from chunkwise.engine.blend.policy import check_layers, computed_candidates, kept_counts
from chunkwise.engine.row_plan import RowPlan


def layer_rows(params: Blend, pieces: tuple[Piece, ...], start: int, num_layers: int, page_size: int) -> list[int]:
    """The rows a blended prefill of `pieces` from `start` computes at each layer, past that layer's selection, as
    `plan_blend` plans it while every chunk piece's variant is cached: its O(pieces) count before the plan, for the
    scheduler's budget. A variant whose pages were evicted since has fewer candidates, so more rows are computed."""
    total = sum(p.num_tokens for p in pieces)
    rows, candidates, heads, first = total - start, 0, 0, 0
    for p in pieces:
        if p.chunk is not None and p.context is not None:
            n_ctx = len(p.context)
            cached = max((n_ctx + p.num_tokens) // page_size * page_size - n_ctx, 0)
            lo, hi = max(first, start), min(first + cached, total - 1)
            candidates += max(hi - lo, 0)
            head = math.floor(params.recompute_ratio * p.num_tokens + 0.5)
            heads += max(min(hi, first + head) - lo, 0)
        first += p.num_tokens
    fixed = rows - candidates
    if params.policy == "chunk-heads":
        return [fixed + heads] * num_layers
    if params.recompute_ratio == 0 or candidates == 0:
        return [fixed] * num_layers
    return [fixed + k for k in computed_candidates(params.recompute_ratio, candidates, num_layers)]


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
    `chain_pages(piece)` gives the cached pages of a chunk piece's variant, context then chunk (default:
    `pool.chain_pages` of those ids)."""
    if chain_pages is None:
        def chain_pages(piece):
            return pool.chain_pages(piece.context.token_ids + piece.chunk.token_ids)
    ps = pool.page_size
    lengths = np.array([p.num_tokens for p in pieces], np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    rows = total - start
    # Every chunk piece's cached tokens at once (a Python step per piece, none per token or page): their
    # positions ascend with the pieces, so the candidates come out in row order.
    # A chunk piece whose variant's pages are cached (none placed: p.context is None) has its chunk's tokens at
    # offsets len(context).. of its chain, moved by its start less the context's length.
    chunked = [j for j, p in enumerate(pieces) if p.chunk is not None and p.context is not None]
    chains = [np.asarray(chain_pages(pieces[j]), np.int64) for j in chunked]
    n_ctx = np.array([len(pieces[j].context) for j in chunked], np.int64)
    num_pages = np.array([len(c) for c in chains], np.int64)
    tokens = np.maximum(num_pages * ps - n_ctx, 0)               # the chunk's tokens in those pages
    owner = np.repeat(np.arange(len(chains)), tokens)           # each cached token's chunk piece (of `chunked`)
    off = np.arange(int(tokens.sum())) - np.repeat(np.cumsum(tokens) - tokens, tokens)   # its offset in its chunk
    firsts = (ends - lengths)[chunked]
    pos = firsts[owner] + off
    inside = (pos >= start) & (pos < total - 1)   # the prompt's last token gives the logits: always computed
    owner, off, idx = owner[inside], off[inside], pos[inside] - start
    pages = np.concatenate(chains) if chains else np.zeros(0, np.int64)
    page_at = np.cumsum(num_pages) - num_pages                  # each chain's first page in `pages`
    at = off + n_ctx[owner]                                     # its offset in its variant's chain
    src = pages[page_at[owner] + at // ps] * ps + at % ps
    heads = np.array([math.floor(params.recompute_ratio * pieces[j].num_tokens + 0.5) for j in chunked], np.int64)
    candidate = np.zeros(rows, bool)
    candidate[idx] = True
    group = np.full(rows, -1, np.int64)     # "adaptive": each candidate's piece
    group[idx] = np.asarray(chunked, np.int64)[owner]
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
        kept = kept_counts(params.recompute_ratio, n, num_layers)
    piece_rows = np.repeat(np.arange(len(pieces)), lengths)[start:]
    groups = group if layers and params.policy == "adaptive" else None
    return BlendJob(params, start, RowPlan(computed, candidate, src, firsts[owner] - n_ctx[owner], layers, kept,
                                           groups), piece_rows)
