"""Row plans: which rows of a step's prefills are computed at which layer, and where the K/V of the rows not
computed come from. The model applies a step's plan (`StepRows`) without knowing why it was made; a feature that
reuses K/V computed elsewhere (chunkwise/engine/blend/) produces one `RowPlan` per prefill.

A prefill's plan over its R new rows:
- `computed` rows run from layer 0; the others are never computed: their K/V are *placed*.
- `placed` rows get K/V copied from `src_slots` before the forward, K re-rotated by `deltas` positions (RoPE is a
  rotation, `relocate_kv`). A placed row may be computed too: its placed K/V are then what a check layer compares
  its fresh K/V with, and the layers that compute it overwrite them.
- at each of `check_layers`, the computed rows that are not placed all go on, and of the computed placed rows the
  `keep[c]` whose fresh K/V deviate most from their placed K/V (ties to the lower row); the rest stop there. The
  selection runs on the device (`select_rows`) from counts fixed on the host, so the host never waits for it.

A step combines its prefills' plans (`step_rows`, on the host) into flat-batch arrays and, per check layer, the
rows' segments and the prefill query_start_loc after it: fixed shapes per (rows, kept rows), the form CUDA graphs
can bucket. A step's forward leaves the rows computed at its last layer in `RowInputs.kept` (layer-0 layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

Segment = tuple[int, int, int]   # (first row, rows, rows kept or -1 for a segment kept whole), flat-batch order


@dataclass(frozen=True)
class RowPlan:
    """One prefill's rows [start, start + R) of its sequence: R = len(computed)."""
    computed: np.ndarray             # bool [R]: computed from layer 0
    placed: np.ndarray               # bool [R]: K/V placed before the forward
    src_slots: np.ndarray            # int64 [n placed]: each placed row's K/V source slot
    deltas: np.ndarray               # int64 [n placed]: its K re-rotation, in positions
    check_layers: tuple[int, ...] = ()   # ascending
    keep: tuple[int, ...] = ()       # computed placed rows kept after each check layer, non-increasing

    def __post_init__(self):
        if len(self.computed) != len(self.placed):
            raise ValueError(f"a row plan's computed ({len(self.computed)}) and placed ({len(self.placed)}) masks "
                             f"differ in length")
        n = int(self.placed.sum())
        if len(self.src_slots) != n or len(self.deltas) != n:
            raise ValueError(f"a row plan of {n} placed rows has {len(self.src_slots)} source slots and "
                             f"{len(self.deltas)} deltas")
        if len(self.check_layers) != len(self.keep):
            raise ValueError(f"a row plan's check layers {self.check_layers} and keep counts {self.keep} differ "
                             f"in length")

    @property
    def num_fixed(self) -> int:
        """Rows computed at every layer whatever a selection finds: computed and not placed."""
        return int((self.computed & ~self.placed).sum())


@dataclass(frozen=True)
class HostRows:
    """A step's row plan on the host (`HostStep.rows`), rows in flat-batch order after the layer-0 filter."""
    src_slots: np.ndarray     # int64 [M]: placed K/V sources
    dst_slots: np.ndarray     # int64 [M]: the placed rows' own slots
    deltas: np.ndarray        # int64 [M]: re-rotation of each
    placed: np.ndarray        # bool [T]: the step's rows (layer-0 layout) that are placed
    checks: dict[int, tuple[list[Segment], np.ndarray]] = field(default_factory=dict)  # layer -> (segments, qsl)
    first_rows: dict[int, int] = field(default_factory=dict)   # seq id -> its first row (layer-0 layout)

    @classmethod
    def in_place(cls, num_rows: int) -> HostRows:
        """A plan that places every row's K/V onto itself (delta 0) and selects nothing: the shapes a warm-up
        compiles for."""
        slots = np.arange(num_rows, dtype=np.int64)
        return cls(slots, slots, np.zeros(num_rows, np.int64), np.zeros(num_rows, bool))


@dataclass
class PaddedSelection:
    """A check layer's selection in fixed shapes, as a blend graph replays it (chunkwise/engine/blend_graphs.py):
    the layer's prefill rows are its real ones then padding, its decodes after them, and it leaves `rows` prefill
    rows (its `num_kept` real ones first, then padding that stores nothing) and the decodes."""
    row_segment: torch.Tensor    # int64 [prefill rows in]: each row's segment; padding rows the last, which keeps none
    segment_start: torch.Tensor  # int64 [S]: each segment's first row (segments are contiguous, in order)
    segment_keep: torch.Tensor   # int64 [S]: rows each segment keeps (a whole one: all of its rows)
    num_kept: torch.Tensor       # int64 [1]: the real prefill rows kept
    rows: int                    # prefill rows out: num_kept or more


@dataclass
class RowSelection:
    """One check layer on the device: the rows' segments at that layer and the prefill query_start_loc after it."""
    segments: list[Segment]
    query_start_loc: torch.Tensor    # int32 [P + 1]
    padded: PaddedSelection | None = None   # a blend graph's form of `segments` (None: an eager step's)


@dataclass
class RowInputs:
    """A step's row plan on the device (`StepInputs.rows`): K/V to place before the forward, the check layers."""
    src_slots: torch.Tensor          # int64 [M]
    dst_slots: torch.Tensor          # int64 [M]
    deltas: torch.Tensor             # int64 [M]
    placed: torch.Tensor             # bool [T] (layer-0 layout)
    checks: dict[int, RowSelection]  # layer index -> its selection
    kept: torch.Tensor | None = None   # int64 [T']: the rows (layer-0 layout) computed at the last layer, once run


def select_rows(check: RowSelection, deviation: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    """The rows kept at a check layer, in order: whole segments as they are; in a selecting one, its rows that are
    not placed and its `keep - those` placed rows of largest deviation (float32 [T]), ties to the lower row."""
    score = torch.where(placed, deviation, torch.full_like(deviation, torch.inf))
    parts = []
    for first, rows, keep in check.segments:
        if keep < 0:
            parts.append(torch.arange(first, first + rows, device=score.device))
        else:
            order = torch.sort(score[first:first + rows], descending=True, stable=True).indices[:keep]
            parts.append(torch.sort(order).values + first)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=score.device)


def select_padded(sel: PaddedSelection, deviation: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    """`select_rows` in fixed shapes and without a host sync: the rows kept of a padded layer of T rows (deviation
    float32 [T], placed bool [T]) whose first len(sel.row_segment) rows are prefill ones: sel.rows prefill rows
    (the real kept ones ascending, as `select_rows` orders them, then not-kept ones as padding), then the decodes.
    Within a segment, rows go by deviation descending, ties to the lower row (two stable sorts), and the first
    `segment_keep` of each are kept."""
    n = sel.row_segment.shape[0]
    score = torch.where(placed[:n], deviation[:n], torch.full_like(deviation[:n], torch.inf))
    by_score = torch.sort(score, descending=True, stable=True).indices
    order = by_score[torch.sort(sel.row_segment[by_score], stable=True).indices]
    seg = sel.row_segment[order]
    rank = torch.arange(n, device=score.device) - sel.segment_start[seg]
    # kept rows ascending, then the others ascending: sort the rows with n added to those not kept
    key = torch.sort(torch.where(rank < sel.segment_keep[seg], order, order + n)).values[:sel.rows]
    rows = torch.where(key < n, key, key - n)
    decodes = torch.arange(n, deviation.shape[0], device=score.device)
    return torch.cat((rows, decodes)) if decodes.shape[0] else rows


def padded_slots(sel: PaddedSelection, slots: torch.Tensor) -> torch.Tensor:
    """The slots of a padded selection's rows (`select_padded`'s order): its padding prefill rows store nothing."""
    at = torch.arange(slots.shape[0], device=slots.device)
    return slots.masked_fill((at >= sel.num_kept) & (at < sel.rows), -1)


def step_rows(plans: list[RowPlan | None], n: np.ndarray, slots: np.ndarray, num_prefill: int, seq_ids: list[int]
              ) -> tuple[np.ndarray, np.ndarray, HostRows]:
    """Rows of a step whose batch entries (prefill ones first, `n` new tokens each, their slots contiguous per
    entry; `seq_ids` theirs) include planned ones (`plans[e]`, None for others): (bool [T] rows computed from layer
    0, int64 [B] each entry's rows after the last check layer, the HostRows)."""
    ends = np.cumsum(n)
    keep0 = np.ones(int(ends[-1]), bool)
    placed = np.zeros(int(ends[-1]), bool)
    src, dst, deltas, entries = [], [], [], []
    for e, plan in enumerate(plans):
        if plan is None:
            continue
        lo = int(ends[e] - n[e])
        keep0[lo:lo + n[e]] = plan.computed
        placed[lo:lo + n[e]] = plan.placed
        src.append(plan.src_slots)
        dst.append(slots[lo:lo + n[e]][plan.placed])
        deltas.append(plan.deltas)
        entries.append((e, plan))
    counts = np.array([keep0[int(end - k):int(end)].sum() for end, k in zip(ends, n)], np.int64)
    firsts = np.cumsum(counts) - counts
    checks = {}
    for layer in sorted({c for _, plan in entries for c in plan.check_layers}):
        segments: list[Segment] = []
        first = 0
        for e, k in enumerate(counts):
            plan = plans[e] if e < num_prefill else None
            keep = (plan.num_fixed + plan.keep[plan.check_layers.index(layer)]
                    if plan is not None and layer in plan.check_layers else -1)
            if keep < 0 and segments and segments[-1][2] < 0:   # runs of whole segments become one
                segments[-1] = (segments[-1][0], segments[-1][1] + int(k), -1)
            else:
                segments.append((first, int(k), keep))
            if keep >= 0:
                counts[e] = keep
            first += int(k)
        qsl = np.concatenate(([0], np.cumsum(counts[:num_prefill]))).astype(np.int32)
        checks[layer] = (segments, qsl)
    return keep0, counts, HostRows(np.concatenate(src), np.concatenate(dst), np.concatenate(deltas),
                                   placed[keep0], checks, {seq_ids[e]: int(firsts[e]) for e, _ in entries})
