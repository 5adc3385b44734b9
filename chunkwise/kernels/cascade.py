"""Cascade (shared-prefix) split-KV decode: a split whose pages several sequences share is read once for all of them.

Split-KV (`chunkwise.kernels.split_kv`) cuts every sequence's KV at fixed positions: split j covers [j * split_size,
(j + 1) * split_size). When sequences' page tables agree on all pages up to the end of split j, and split j
lies whole below each one's seq_len, their split-j keys are the same memory. One program then loads each of
its tiles once and folds it into the rows of every sharing sequence (and their GQA heads), with the tile order
and per-row arithmetic of split-KV's split kernel; a tile that is fully masked for a row (a window that starts
later) leaves that row's state bitwise unchanged. The partials it writes are split-KV's, bit for bit; the other
("own") splits then go through split-KV's own kernel, which starts each sequence at its first own split and
merges all its splits as split-KV does, so `cascade_decode` equals `split_kv_decode` bitwise, whatever the
grouping.

The shared splits' work is an explicit list of items: item k is up to `item_size` members of one shared split
(by default as many as fill SHARED_ROWS tile rows with their GQA heads). The launch grid is (programs, num_kv_heads),
whatever the grouping, and program p takes items p, p + programs, ... below the item count, which it reads
from the device: a captured CUDA graph replays with any grouping its buffers hold.

Layouts (q, caches, page_tables, seq_lens, partials: as `split_kv_decode`):
    CascadeGroups, CSR over the shared splits (one entry per split that two or more sequences share):
        split:         int32 [num_shared]      split index j of shared split i (keys [j*split_size, (j+1)*split_size))
        starts:        int32 [num_shared + 1]  its sequences are members[starts[i]:starts[i+1]] (at least 2)
        members:       int32 [starts[-1]]      batch rows (sequence indices), ascending within each shared split
        shared_splits: int32 [num_seqs]        n_s: splits 0..n_s-1 of sequence s are shared, the rest its own
        item_shared:   int32 [num_items]       shared split i of work item k
        item_first:    int32 [num_items]       its members are members[item_first[k]:min(item_first[k] + item_size,
                                               starts[i + 1])]
        num_items:     int32 [1]               the item count, read by the kernel
        item_size:     int, members per item (`cascade_item_size(head_dim, group)` by default)
        programs:      int, the launch grid's first axis (0: no launch)
        split_size:    int, the split size the grouping was made for
    `cascade_groups` makes them exactly this long, the shared splits in order of j, with programs =
    num_items. A CUDA graph's static groups are longer buffers of the same layout: the kernel reads only the
    items below num_items and the entries they point at, and shared_splits (one per row, 0 for padding).
A sequence's shared splits are always a prefix of its splits, but who shares them may narrow as j grows
(a tree): a system prompt shared by all, then a document shared by some, is one entry per split for all
sequences, then entries for the subset.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from chunkwise.kernels.attention_tile import LOG2E, attend_ref, gather_kv_ref, pages_per_tile
from chunkwise.kernels.split_kv import (DEFAULT_SPLIT_SIZE, _check, _split_partial, _workspace_for, check_batch, launch_splits,
                              merge_splits_ref, split_tile_config)
from chunkwise.kernels.tiling import next_power_of_2, precision_for

# A shared-split program reads each tile of its split once for all its members, so the taller its tile, the
# fewer times a shared split is read. Split-KV's row sums come from a dot (see `_split_partial`), so a row's
# bits do not depend on the tile's height or warp count: on an H200, tiles of 16 to 256 rows, on 4 or 8 warps
# (wgmma from 64 rows), gave split-KV's bits, where tl.sum's layout-dependent order had made 64 rows differ.
# 64 rows read a shared prompt faster than split-KV's 16 (docs/BENCHMARKS.md, "Behind the code"). Tiles of
# 64 and 128 rows were verified there with head_dim 128 in float32, float16 and bfloat16; a head_dim above 128
# takes proportionally fewer rows, so no tile outgrows the verified footprint (a 256-row tile of a batched-dot
# variant outgrew shared memory).
SHARED_ROWS = 64
MAX_SHARED_ROWS = 128


def _rows_for(rows, head_dim):
    return rows * 128 // max(128, next_power_of_2(head_dim))


def cascade_item_size(head_dim, group):
    """Members per work item by default: as many sequences as fill SHARED_ROWS tile rows (fewer above head_dim
    128) with their `group` query heads per KV head (at least one). `cascade_decode` takes any item size up to
    `max_item_rows`."""
    return max(1, _rows_for(SHARED_ROWS, head_dim) // group)


def max_item_rows(head_dim, group):
    """Most tile rows (members x group) an item may hold: MAX_SHARED_ROWS (fewer above head_dim 128), or one
    member's."""
    return max(_rows_for(MAX_SHARED_ROWS, head_dim), group)


def shared_tile_rows(item_size, group):
    """BLOCK_M of the shared-split program for items of item_size members: their heads padded to a power of two,
    at least tl.dot's 16."""
    return max(16, next_power_of_2(item_size * group))


@dataclass(frozen=True)
class CascadeGroups:
    """Which splits of a decode batch are shared by which sequences, and the work items over them; see the
    module docstring for the layout. Build it with `cascade_groups` from the same page tables and seq_lens
    the kernel gets."""
    split: torch.Tensor
    starts: torch.Tensor
    members: torch.Tensor
    shared_splits: torch.Tensor
    item_shared: torch.Tensor
    item_first: torch.Tensor
    num_items: torch.Tensor
    item_size: int
    programs: int
    split_size: int

    TENSORS = ("split", "starts", "members", "shared_splits", "item_shared", "item_first", "num_items")

    @property
    def num_shared(self) -> int:
        """Shared splits of groups from `cascade_groups` (a graph's static groups: their capacity)."""
        return self.split.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]

    def to(self, device) -> CascadeGroups:
        return self.on(*(t.to(device) for t in self.tensors()))

    def on(self, *tensors) -> CascadeGroups:
        """The same groups held in other tensors of the same values (e.g. views of one packed upload), in the
        order of TENSORS."""
        return dataclasses.replace(self, **dict(zip(self.TENSORS, tensors, strict=True)))


def _host_ints(x, what):
    """x (a tensor, array or list) as a numpy array of ints (int arrays as they are)."""
    a = x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.size == 0:
        return a.astype(np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must hold ints, got {a.dtype}")
    return a


def _as_table(page_tables, rows):
    """(int [num_rows, width] table, int [num_seqs] each sequence's row, int [num_seqs] pages each one's row
    holds); ragged lists are zero-padded."""
    if isinstance(page_tables, (torch.Tensor, np.ndarray)):
        table = _host_ints(page_tables, "page_tables")
        if table.ndim != 2:
            raise ValueError(f"page_tables must be 2-d, got shape {tuple(table.shape)}")
        widths = np.full(table.shape[0], table.shape[1], np.int64)
    else:
        lists = [_host_ints(r, "page_tables") for r in page_tables]
        widths = np.array([len(r) for r in lists], np.int64)
        table = np.zeros((len(lists), int(widths.max(initial=0))), np.int32)
        for s, r in enumerate(lists):
            table[s, :len(r)] = r
    if rows is None:
        return table, np.arange(table.shape[0]), widths
    rows = _host_ints(rows, "rows")
    if rows.ndim != 1 or len(rows) and (rows.min() < 0 or rows.max() >= table.shape[0]):
        raise ValueError(f"rows must be 1-d indices of the {table.shape[0]} page-table rows, got {rows}")
    return table, rows, widths[rows]


def cascade_groups(page_tables, seq_lens, page_size, split_size=DEFAULT_SPLIT_SIZE, *, item_size,
                   rows=None) -> CascadeGroups:
    """The shared splits of a decode batch, from its page tables alone, and their work items of up to
    `item_size` members (`cascade_item_size(head_dim, group)` by default). Host tensors.

    page_tables: int [num_rows, width] (numpy, tensor) or one sequence of page ids per row; sequence s's is
    row rows[s] (rows: int [num_seqs]; None: row s). Entries past a sequence's last page are ignored, so
    padding and stale entries are harmless. seq_lens: tokens of each sequence (>= 1). Split j of sequence s is
    shared with t when both hold it whole ((j + 1) * split_size <= seq_len, so every key of the split is one
    of each sequence's own positions) and their tables agree on every page up to the one holding position
    (j + 1) * split_size - 1: then the split's keys, and all before them, are the same memory. The shared
    part thus ends on a split boundary, rounded down, and never past a member's seq_len.

    Vectorised over the rows: sorted by their pages' bytes, the rows that agree on their first k pages are a
    run (any lexicographic order keeps a common prefix contiguous), so each split's sharers are the runs of
    neighbours agreeing on the split's pages, less the rows that do not hold the split whole.
    """
    for name, value in (("page_size", page_size), ("split_size", split_size), ("item_size", item_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    table, rows, widths = _as_table(page_tables, rows)
    lens = _host_ints(seq_lens, "seq_lens")
    if lens.ndim != 1 or rows.shape[0] != lens.shape[0]:
        raise ValueError(f"{rows.shape[0]} page tables but {lens.shape[0] if lens.ndim else lens} seq_lens")
    bad = np.flatnonzero((lens < 1) | (widths * page_size < lens))
    if len(bad):
        s = int(bad[0])
        raise ValueError(f"sequence {s}: seq_len {lens[s]} must be >= 1 and fit its {widths[s]} pages of {page_size}")
    n = len(lens)
    whole = lens.astype(np.int64) // split_size      # splits each sequence holds whole
    holders = np.flatnonzero(whole > 0)
    members = levels = np.zeros(0, np.int64)
    starts = np.zeros(1, np.int64)
    if len(holders) > 1:
        depth, m = int(whole.max()), len(holders)
        need = (np.arange(1, depth + 1) * split_size - 1) // page_size + 1   # pages up to the end of split j
        pages = np.ascontiguousarray(table[rows[holders], :need[-1]], np.int32)
        order = np.argsort(pages.view(np.dtype((np.void, 4 * need[-1]))).ravel(), kind="stable")
        pages = pages[order]
        differ = np.ones((m - 1, need[-1] + 1), bool)   # a last column that always differs
        np.not_equal(pages[1:], pages[:-1], out=differ[:, :-1])
        agree = differ.argmax(1)   # pages each pair of sorted neighbours agrees on
        # Per split j, each holder's run of sorted neighbours agreeing on the split's pages.
        run = np.empty((depth, m), np.int64)
        run[:, 0] = 0
        np.cumsum(agree[None, :] < need[:, None], axis=1, out=run[:, 1:])
        run[:, order] = run.copy()
        # Every (split j, holder) with the holder holding split j whole, split-major, holders ascending: its
        # candidate group (split, run) is a group if it has two members or more.
        flat = np.flatnonzero(whole[holders][None, :] > np.arange(depth)[:, None])
        base = flat // m * m
        group = run.ravel()[flat] + base
        shared = np.bincount(group, minlength=depth * m)[group] > 1
        group, holder = group[shared], (flat - base)[shared]
        # Stable: members stay ascending within their group (16-bit keys take numpy's radix sort).
        order = np.argsort(group.astype(np.uint16) if depth * m <= 1 << 16 else group, kind="stable")
        group, members = group[order], holders[holder[order]]
        new = np.ones(len(group), bool)
        np.not_equal(group[1:], group[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        levels, starts = group[starts] // m, np.append(starts, len(group))
    chunks = -(-np.diff(starts) // item_size)
    item_shared = np.repeat(np.arange(len(chunks)), chunks)
    item_first = starts[item_shared] + (np.arange(len(item_shared)) - np.repeat(np.cumsum(chunks) - chunks, chunks)) \
        * item_size
    i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32))  # noqa: E731
    return CascadeGroups(split=i32(levels), starts=i32(starts), members=i32(members),
                         shared_splits=i32(np.bincount(members, minlength=n)), item_shared=i32(item_shared),
                         item_first=i32(item_first), num_items=i32([len(item_shared)]), item_size=item_size,
                         programs=len(item_shared), split_size=split_size)


def _check_groups(groups, q, k_cache, split_size):
    if not isinstance(groups, CascadeGroups):
        raise TypeError(f"groups must be a CascadeGroups (from cascade_groups), got {type(groups).__name__}")
    if groups.split_size != split_size:
        raise ValueError(f"groups were made for split_size {groups.split_size}, not {split_size}")
    if groups.shared_splits.shape != (q.shape[0],):
        raise ValueError(f"groups cover {groups.shared_splits.shape[0]} sequences, the batch has {q.shape[0]}")
    for name in CascadeGroups.TENSORS:
        t = getattr(groups, name)
        if t.dtype != torch.int32 or t.device != q.device or t.dim() != 1:
            raise ValueError(f"groups.{name} must be 1-d int32 on {q.device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    if groups.item_shared.shape != groups.item_first.shape or groups.num_items.shape != (1,):
        raise ValueError(f"groups.item_shared {tuple(groups.item_shared.shape)} and item_first "
                         f"{tuple(groups.item_first.shape)} must be equally long, num_items one count")
    group = q.shape[1] // k_cache.shape[2]
    rows = max_item_rows(q.shape[2], group)
    if not isinstance(groups.item_size, int) or not 1 <= groups.item_size * group <= rows:
        raise ValueError(f"groups' items hold {groups.item_size!r} members of {group} heads each; a shared-split "
                         f"tile of head_dim {q.shape[2]} holds 1 to {rows} rows (cascade_item_size gives the default)")
    if not isinstance(groups.programs, int) or groups.programs < (1 if groups.item_shared.shape[0] else 0):
        raise ValueError(f"groups.programs must be an int >= 1 when there are items, got {groups.programs!r}")


def cascade_decode_ref(q, k_cache, v_cache, page_tables, seq_lens, groups, scale, sliding_window=None,
                       split_size=DEFAULT_SPLIT_SIZE, out=None):
    """PyTorch twin of `cascade_decode`: each shared split gathered once (through its first member's table)
    and attended by all its members' queries, each own split per sequence, then the reference merge.
    `groups` as `cascade_groups` makes them (every entry in use)."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, sliding_window, split_size)
    _check_groups(groups, q, k_cache, split_size)
    out = torch.empty_like(q) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    num_splits = math.ceil(page_tables.shape[1] * k_cache.shape[1] / split_size)
    partial_out = torch.zeros(num_seqs, num_heads, num_splits, head_dim, device=q.device)
    partial_lse = torch.full((num_seqs, num_heads, num_splits), -math.inf, device=q.device)
    starts = groups.starts.tolist()
    for i, j in enumerate(groups.split.tolist()):
        members = groups.members[starts[i]:starts[i + 1]].long()
        lo, hi = j * split_size, (j + 1) * split_size
        k = gather_kv_ref(k_cache, page_tables[members[0]], hi)[lo:]
        v = gather_kv_ref(v_cache, page_tables[members[0]], hi)[lo:]
        o, lse = attend_ref(q[members], k, v, seq_lens[members].long() - 1 - lo, scale, sliding_window)
        partial_out[members, :, j] = o
        partial_lse[members, :, j] = lse
    for s, (seq_len, first) in enumerate(zip(seq_lens.tolist(), groups.shared_splits.tolist())):
        k = gather_kv_ref(k_cache, page_tables[s], seq_len)
        v = gather_kv_ref(v_cache, page_tables[s], seq_len)
        for j in range(first, math.ceil(seq_len / split_size)):
            lo = j * split_size
            o, lse = attend_ref(q[s:s + 1], k[lo:lo + split_size], v[lo:lo + split_size],
                                torch.tensor([seq_len - 1 - lo], device=q.device), scale, sliding_window)
            partial_out[s, :, j] = o[0]
            partial_lse[s, :, j] = lse[0]
    return merge_splits_ref(partial_out, partial_lse, out)


@triton.jit
def _shared_split_kernel(
    q_ptr,              # [num_seqs, num_heads, head_dim]
    k_cache_ptr,        # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,        # [num_pages, page_size, num_kv_heads, head_dim]
    partial_out_ptr,    # float32 [num_seqs, num_heads, num_splits, head_dim]
    partial_lse_ptr,    # float32 [num_seqs, num_heads, num_splits]
    page_tables_ptr,   # int32 [num_seqs, max_pages_per_seq]
    seq_lens_ptr,       # int32 [num_seqs]
    split_ptr,          # int32 [>= num_shared]: split index of each shared split
    starts_ptr,         # int32 [>= num_shared + 1]: CSR offsets into members
    members_ptr,        # int32 [>= starts[num_shared]]: batch rows of each shared split
    item_shared_ptr,    # int32 [>= num_items]: shared split of each work item
    item_first_ptr,     # int32 [>= num_items]: index in members of each item's first member
    num_items_ptr,      # int32 [1]: the item count
    qk_scale, window, split_size,
    stride_qs, stride_qh, stride_bt, stride_ps, stride_ph, stride_pj, stride_ls, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, MEMBERS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
):
    """KV head (axis 1) of work items axis0, axis0 + programs, ... below num_items (a program per axis-0 index):
    an item is up to MEMBERS members of one shared split; its rows are member-major, each member's GROUP query
    heads of this KV head."""
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    num_items = tl.load(num_items_ptr)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        i = tl.load(item_shared_ptr + item)
        first = tl.load(item_first_ptr + item)
        end = tl.load(starts_ptr + i + 1)
        split = tl.load(split_ptr + i)
        member = first + rows // GROUP
        row_ok = (rows < MEMBERS * GROUP) & (member < end)
        s = tl.load(members_ptr + member, mask=row_ok, other=0).to(tl.int64)
        # Padding rows get seq_len 0: every key is in their future, so they see nothing (and are not stored).
        seq_len = tl.load(seq_lens_ptr + s, mask=row_ok, other=0)
        q = tl.load(q_ptr + s[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lo = split * split_size
        hi = lo + split_size  # whole for every member: cascade_groups shares only splits below each seq_len
        if USE_WINDOW:
            # From the earliest window start of the rows; tiles before a row's own start are fully masked for it.
            lo = tl.maximum(lo, tl.min(tl.where(row_ok, seq_len - window, hi), 0))
        # All members' tables agree up to this split's last page: read the first member's.
        table = page_tables_ptr + tl.load(members_ptr + first).to(tl.int64) * stride_bt
        o, lse = _split_partial(
            q, seq_len - 1, lo // BLOCK_N, hi, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE, kv_head,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, USE_WINDOW, PRECISION, PAGES_PER_TILE,
        )
        tl.store(partial_out_ptr + s[:, None] * stride_ps + head[:, None] * stride_ph + split * stride_pj
                 + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(partial_lse_ptr + s * stride_ls + head * stride_lh + split, lse, mask=row_ok)


def cascade_decode(q, k_cache, v_cache, page_tables, seq_lens, groups, scale, sliding_window=None,
                   split_size=DEFAULT_SPLIT_SIZE, out=None, workspace=None):
    """`split_kv_decode` with the splits in `groups` (from `cascade_groups` over these page tables and
    seq_lens, moved to q's device, or static buffers of the same layout) read once per shared split; bitwise
    the same result, whatever groups.programs. Returns out. `workspace`: as split_kv_decode's."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, sliding_window, split_size)
    _check_groups(groups, q, k_cache, split_size)
    check_batch(q, out, "cascade_decode")
    workspace = _workspace_for(q, k_cache, page_tables, split_size, workspace)
    out = torch.empty_like(q) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    _, block_n, num_warps, num_stages = split_tile_config(head_dim, group)
    block_m = shared_tile_rows(groups.item_size, group)
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    if groups.programs:
        _shared_split_kernel[(groups.programs, num_kv_heads)](
            q, k_cache, v_cache, partial_out, partial_lse, page_tables, seq_lens,
            groups.split, groups.starts, groups.members, groups.item_shared, groups.item_first, groups.num_items,
            scale * LOG2E, sliding_window or 0, split_size,
            q.stride(0), q.stride(1), page_tables.stride(0),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            PAGE_SIZE=page_size, GROUP=group, MEMBERS=groups.item_size, HEAD_DIM=head_dim,
            D_PAD=next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
            USE_WINDOW=sliding_window is not None, PRECISION=precision_for(q.dtype),
            PAGES_PER_TILE=pages_per_tile(page_size, block_n),
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
        )
    # The own splits, and the merge of every split, by split-KV's kernel (after the shared splits: same stream).
    return launch_splits(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window, split_size, out,
                         workspace, start_split=groups.shared_splits)
