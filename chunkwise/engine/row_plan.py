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
- a plan with `groups` (blend's "adaptive") shares each check layer's places among its groups instead: a group
  whose placed rows still computed deviate by S in all scores S / (2m + 1) at its m-th most deviating row
  (`group_scores`), and the `keep[c]` highest scores are kept (Sainte-Laguë apportionment, ties to the lower row).

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
    groups: np.ndarray | None = None   # int64 [R]: each placed row's group (>= 0; -1 elsewhere) when the check
    #                                    layers apportion their places among groups; None: the rows select as one

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
        if self.groups is not None and (len(self.groups) != len(self.computed)
                                        or not np.array_equal(self.groups >= 0, self.placed)):
            raise ValueError(f"a row plan's groups {self.groups.tolist()!r:.80} must give each of its "
                             f"{len(self.computed)} rows a group >= 0 where placed, -1 elsewhere")

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
    groups: np.ndarray | None = None   # int64 [T] (layer-0 layout): step-wide groups of plans with groups, -1 else

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
    groups: torch.Tensor | None = None   # int64 [T] (layer-0 layout): HostRows.groups


def group_scores(deviation: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """float32 [T]: a grouped row's (groups int64 [T], >= 0) score S / (2m + 1), S its group's deviation sum
    (accumulated in float64, rounded to float32), m its rank in its group by deviation (0 the largest, ties to the
    lower row); an ungrouped row's (-1) its deviation (float32 [T]). Fixed-shape sorts and scans: the host never
    waits for it."""
    key = torch.where(groups >= 0, groups, torch.iinfo(torch.int64).max)   # ungrouped rows sort last
    by_dev = torch.sort(deviation, descending=True, stable=True).indices
    order = by_dev[torch.sort(key[by_dev], stable=True).indices]         # by group, then deviation, then row
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key)                  # each row's group's first place in order
    last = torch.searchsorted(sorted_key, sorted_key, right=True)
    sums = torch.cat([deviation.new_zeros(1, dtype=torch.float64), torch.cumsum(deviation[order].double(), 0)])
    rank = torch.arange(deviation.shape[0], device=deviation.device) - first
    quotient = (sums[last] - sums[first]).float() / (2 * rank + 1).float()
    score = torch.empty_like(deviation)
    score[order] = torch.where(groups[order] >= 0, quotient, deviation[order])
    return score


def select_rows(check: RowSelection, deviation: torch.Tensor, placed: torch.Tensor,
                groups: torch.Tensor | None = None) -> torch.Tensor:
    """The rows kept at a check layer, in order: whole segments as they are; in a selecting one, its rows that are
    not placed and its `keep - those` placed rows of largest deviation (float32 [T]), ties to the lower row; with
    `groups` (int64 [T]), of largest `group_scores` where grouped."""
    if groups is not None:
        deviation = group_scores(deviation, groups)
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
    groups = np.full(int(ends[-1]), -1, np.int64) if any(p is not None and p.groups is not None for p in plans) \
        else None
    src, dst, deltas, entries = [], [], [], []
    num_groups = 0
    for e, plan in enumerate(plans):
        if plan is None:
            continue
        lo = int(ends[e] - n[e])
        keep0[lo:lo + n[e]] = plan.computed
        placed[lo:lo + n[e]] = plan.placed
        if plan.groups is not None and plan.placed.any():   # step-wide ids: each plan's groups after the last's
            groups[lo:lo + n[e]] = np.where(plan.placed, plan.groups + num_groups, -1)
            num_groups += int(plan.groups.max()) + 1
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
                                   placed[keep0], checks, {seq_ids[e]: int(firsts[e]) for e, _ in entries},
                                   None if groups is None else groups[keep0])
