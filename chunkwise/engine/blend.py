"""Blend mode in the fast engine (issue #28 §3; docs/ARCHITECTURE.md, "Blend mode"): which tokens of a blended
prompt are computed at which layer, and where the others' K/V come from.

A blended prompt is prefilled in one step from c0, the end of its exact prefix-cache hit. Its *candidates* are the
tokens of its chunk pieces whose isolated K/V the prefix cache holds: a chunk registered with the engine was
computed on its own, at positions 0..n-1, so its full pages sit in the prefix cache under a hash chain of its own
tokens, keyed by content and not by what precedes it in a request. Before the forward, each candidate's K/V are
copied from those pages to its own slot with K re-rotated by its chunk's new start (`relocate_kv`: RoPE is a
rotation). Every other token (text and id pieces, a chunk's tail past its last full page, a chunk whose pages were
evicted, the prompt's last token) is a *fixed row*, computed at every layer like any prefill.

Which candidates are computed (`Blend.policy`, recompute ratio r, n candidates, k(x) = min(n, floor(x n + 0.5))):
- "chunk-heads" (EPIC): the first floor(r len + 0.5) tokens of each chunk piece, at every layer.
- "kv-deviation" (CacheBlend): r = 0 computes none. Otherwise every candidate is computed at layer 0, and at each
  check layer l = 1..C (C = min(3, layers - 1)) the kept candidates compute fresh K/V, compared with their placed
  K/V; the k(r_l) that deviate most stay (r_l = r (1 + (C - l) / C): gradual filtering), ties to the lower position,
  and only kept rows go on to attention, the MLP and later layers. r = 1 keeps every row: a full recompute.

Selection happens on the device (`select_rows`) from counts known on the host, so the step never waits for it.
The host plans a step's blended sequences with `plan_blend` (scheduler, after the step's allocations: a page still
cached then is not overwritten before this step's forward reads it) and `BlendRows` (runner).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from chunkwise.chunks import Blend, ChunkReuse, Piece

MAX_CHECK_LAYERS = 3


def num_kept(ratio: float, n: int) -> int:
    """k(x): the candidates a ratio keeps, rounded half up."""
    return min(n, math.floor(ratio * n + 0.5))


def check_ratios(r: float, num_layers: int) -> list[float]:
    """r_l for the check layers l = 1..C of "kv-deviation": from r (1 + (C - 1) / C) down to r."""
    c = min(MAX_CHECK_LAYERS, num_layers - 1)
    return [min(1.0, r * (1 + (c - layer) / c)) for layer in range(1, c + 1)]


@dataclass(frozen=True)
class BlendJob:
    """One blended prefill of rows [start, start + len(candidate)) of a sequence, resolved against the prefix cache.
    Rows are relative to `start` (c0)."""
    params: Blend
    start: int                 # c0: the prompt's exact prefix ends here
    candidate: np.ndarray      # bool [R]: the row is a candidate (its chunk's K/V are stored)
    src_slots: np.ndarray      # int64 [n]: each candidate's slot in its chunk's stored pages
    deltas: np.ndarray         # int64 [n]: each candidate's chunk start, its re-rotation
    computed: np.ndarray       # bool [R]: rows computed from layer 0 on (fixed rows and the policy's first choice)
    kept: tuple[int, ...]      # candidates kept after each check layer ("kv-deviation" with r > 0; else empty)
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
    delta = np.zeros(rows, np.int64)
    head = np.zeros(rows, bool)
    for j, p in enumerate(pieces):
        if p.chunk is None:
            continue
        first = int(ends[j] - lengths[j])
        pages = np.array(pool.chain_pages(p.chunk.token_ids), np.int64)
        off = np.arange(len(pages) * ps)
        pos = first + off
        inside = (pos >= start) & (pos < total - 1)   # the prompt's last token gives the logits: always computed
        idx = pos[inside] - start
        candidate[idx] = True
        src[idx] = pages[off[inside] // ps] * ps + off[inside] % ps
        delta[idx] = first
        head[idx] = off[inside] < math.floor(params.recompute_ratio * p.num_tokens + 0.5)
    n = int(candidate.sum())
    kept: tuple[int, ...] = ()
    if params.policy == "chunk-heads":
        computed = ~candidate | head
    elif params.recompute_ratio == 0 or n == 0:
        computed = ~candidate
    else:
        computed = np.ones(rows, bool)
        kept = tuple(np.minimum.accumulate([num_kept(x, n) for x in check_ratios(params.recompute_ratio,
                                                                                   num_layers)]).tolist())
    piece_rows = np.repeat(np.arange(len(pieces)), lengths)[start:]
    return BlendJob(params, start, candidate, src[candidate], delta[candidate], computed, kept, piece_rows)


def blend_report(job: BlendJob, pieces: tuple[Piece, ...], first_row: int, kept: np.ndarray) -> tuple[ChunkReuse, ...]:
    """ChunkReuse per piece: exact below c0; recomputed = the rows computed at every layer (the job's computed rows,
    from the step's `first_row` on in its layer-0 layout, that are in `kept`, the rows of the last layer); blended =
    the rest."""
    full = job.computed.copy()
    rows0 = first_row + np.cumsum(job.computed) - 1        # each computed row's layer-0 row
    full[job.computed] = np.isin(rows0[job.computed], kept)
    out, first = [], 0
    for j, p in enumerate(pieces):
        exact = max(0, min(first + p.num_tokens, job.start) - first)
        recomputed = int(full[job.piece_rows == j].sum())
        out.append(ChunkReuse(p.chunk, p.num_tokens, exact, p.num_tokens - exact - recomputed, recomputed))
        first += p.num_tokens
    return tuple(out)


@dataclass
class CheckLayer:
    """One check layer of a step (device side): the rows' segments at that layer, in flat-batch order, each
    (first row, rows, rows kept or -1 for a segment kept whole), and what the step looks like after it."""
    segments: list[tuple[int, int, int]]
    query_start_loc: torch.Tensor    # int32 [P + 1] after the selection


@dataclass
class BlendInputs:
    """A step's blending on the device: the K/V to place before the forward and the check layers."""
    src_slots: torch.Tensor          # int64 [M]
    dst_slots: torch.Tensor          # int64 [M]
    deltas: torch.Tensor             # int64 [M]
    candidate: torch.Tensor          # bool [T]: the step's row is a candidate (layer-0 layout)
    checks: dict[int, CheckLayer]    # layer index -> its selection
    kept: torch.Tensor | None = None  # int64 [T']: the rows (layer-0 layout) computed at the last layer, once run


def select_rows(check: CheckLayer, deviation: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """The rows kept at a check layer, in order: whole segments as they are; in a blended one, its fixed rows and
    its `keep - fixed` candidates of largest deviation (float32 [T]), ties to the lower row."""
    score = torch.where(candidate, deviation, torch.full_like(deviation, math.inf))
    parts = []
    for first, rows, keep in check.segments:
        if keep < 0:
            parts.append(torch.arange(first, first + rows, device=score.device))
        else:
            order = torch.sort(score[first:first + rows], descending=True, stable=True).indices[:keep]
            parts.append(torch.sort(order).values + first)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=score.device)


@dataclass
class HostBlend:
    """A step's blending on the host (`HostStep.blend`): the K/V to place and each check layer's segments."""
    src_slots: np.ndarray      # int64 [M]: stored chunk slots
    dst_slots: np.ndarray      # int64 [M]: the candidates' own slots
    deltas: np.ndarray         # int64 [M]: re-rotation of each
    candidate: np.ndarray      # bool [T]: the step's rows (layer-0 layout) that are candidates
    checks: dict[int, tuple[list[tuple[int, int, int]], np.ndarray]]   # layer -> (segments, int32 [P + 1] qsl)
    jobs: list[tuple[int, BlendJob, int]]   # (seq id, its job, its first row), for the report


def plan_rows(jobs: list[BlendJob | None], n: np.ndarray, slots: np.ndarray, num_prefill: int, seq_ids: list[int]
              ) -> tuple[np.ndarray, np.ndarray, HostBlend]:
    """Rows of a step whose batch entries (prefill ones first, `n` new tokens each, their slots contiguous per
    entry; `seq_ids` theirs) include blended ones (`jobs[e]`, None for others): (bool [T] rows computed from layer 0,
    int64 [B] each entry's rows after the last check layer, the HostBlend)."""
    ends = np.cumsum(n)
    keep0 = np.ones(int(ends[-1]), bool)
    candidate = np.zeros(int(ends[-1]), bool)
    src, dst, deltas, entries = [], [], [], []
    for e, job in enumerate(jobs):
        if job is None:
            continue
        lo = int(ends[e] - n[e])
        keep0[lo:lo + n[e]] = job.computed
        candidate[lo:lo + n[e]] = job.candidate
        src.append(job.src_slots)
        dst.append(slots[lo:lo + n[e]][job.candidate])
        deltas.append(job.deltas)
        entries.append((e, job))
    counts = np.array([keep0[int(end - k):int(end)].sum() for end, k in zip(ends, n)], np.int64)
    firsts = np.cumsum(counts) - counts
    fixed = {e: int((job.computed & ~job.candidate).sum()) for e, job in entries}
    checks = {}
    num_checks = max((len(job.kept) for _, job in entries), default=0)
    for layer in range(1, num_checks + 1):
        segments: list[tuple[int, int, int]] = []
        first = 0
        for e, k in enumerate(counts):
            job = jobs[e] if e < num_prefill else None
            keep = fixed[e] + job.kept[layer - 1] if job is not None and job.kept else -1
            if keep < 0 and segments and segments[-1][2] < 0:   # runs of whole segments become one
                segments[-1] = (segments[-1][0], segments[-1][1] + int(k), -1)
            else:
                segments.append((first, int(k), keep))
            if keep >= 0:
                counts[e] = keep
            first += int(k)
        qsl = np.concatenate(([0], np.cumsum(counts[:num_prefill]))).astype(np.int32)
        checks[layer] = (segments, qsl)
    return keep0, counts, HostBlend(np.concatenate(src), np.concatenate(dst), np.concatenate(deltas),
                                    candidate[keep0], checks,
                                    [(seq_ids[e], job, int(firsts[e])) for e, job in entries])
