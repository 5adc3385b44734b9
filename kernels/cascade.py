"""Cascade (shared-prefix) split-KV decode: a split whose pages several sequences share is read once for all of them.

Split-KV (`kernels.split_kv`) cuts every sequence's KV at fixed positions: split j covers [j * split_size,
(j + 1) * split_size). When sequences' block tables agree on all pages up to the end of split j, and split j
lies whole below each one's seq_len, their split-j keys are the same memory. One program then loads each of
its tiles once and folds it into the rows of every sharing sequence (and their GQA heads), with the tile order
and per-row arithmetic of split-KV's split kernel; a tile that is fully masked for a row (a window that starts
later) leaves that row's state bitwise unchanged. The partials it writes are split-KV's, bit for bit; the other
("own") splits then go through split-KV's own kernel, which starts each sequence at its first own split and
merges all its splits as split-KV does, so `cascade_decode` equals `split_kv_decode` bitwise, whatever the
grouping.

Layouts (q, caches, block_tables, seq_lens, partials: as `split_kv_decode`):
    CascadeGroups, CSR over the shared splits (one entry per split that two or more sequences share):
        split:         int32 [num_shared]      split index j of shared split i (keys [j*split_size, (j+1)*split_size))
        starts:        int32 [num_shared + 1]  its sequences are members[starts[i]:starts[i+1]] (at least 2)
        members:       int32 [starts[-1]]      batch rows (sequence indices), ascending within each shared split
        shared_splits: int32 [num_seqs]        n_s: splits 0..n_s-1 of sequence s are shared, the rest its own
        max_members:   int, the most members of one shared split (sizes the launch grid without a read-back)
        split_size:    int, the split size the grouping was made for
A sequence's shared splits are always a prefix of its splits, but who shares them may narrow as j grows
(a tree): a system prompt shared by all, then a document shared by some, is one entry per split for all
sequences, then entries for the subset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_tile import LOG2E, attend_ref, gather_kv_ref, pages_per_tile, precision_for
from kernels.split_kv import (DEFAULT_SPLIT_SIZE, _check, _split_partial, _workspace_for, check_batch, launch_splits,
                              merge_splits_ref, split_tile_config)

# A shared-split program packs its members' query heads into split-KV's own tile height (BLOCK_H rows) and
# launches with the same tile config: on a GPU a taller tile compiles to other MMA instructions, whose rounding
# differed from split-KV's (seen on an H200 with 64 rows), while the same tile shape gives a row the same bits
# wherever it sits in the tile.


@dataclass(frozen=True)
class CascadeGroups:
    """Which splits of a decode batch are shared by which sequences; see the module docstring for the layout.
    Build it with `cascade_groups` from the same block tables and seq_lens the kernel gets."""
    split: torch.Tensor
    starts: torch.Tensor
    members: torch.Tensor
    shared_splits: torch.Tensor
    max_members: int
    split_size: int

    @property
    def num_shared(self) -> int:
        return self.split.shape[0]

    def to(self, device) -> CascadeGroups:
        return self.on(self.split.to(device), self.starts.to(device), self.members.to(device),
                       self.shared_splits.to(device))

    def on(self, split, starts, members, shared_splits) -> CascadeGroups:
        """The same groups held in other tensors of the same values (e.g. views of one packed upload)."""
        return CascadeGroups(split, starts, members, shared_splits, self.max_members, self.split_size)


def cascade_groups(block_tables, seq_lens, page_size, split_size=DEFAULT_SPLIT_SIZE) -> CascadeGroups:
    """The shared splits of a decode batch, from its block tables alone.

    block_tables: one sequence of page ids per sequence (lists, or the rows of an int tensor; entries past a
    sequence's last page are ignored, so zero padding is harmless). seq_lens: tokens of each sequence (>= 1).
    Split j of sequence s is shared with t when both hold it whole ((j + 1) * split_size <= seq_len, so every
    key of the split is one of each sequence's own positions) and their tables agree on every page up to the
    one holding position (j + 1) * split_size - 1: then the split's keys, and all before them, are the same
    memory. The shared part thus ends on a split boundary, rounded down, and never past a member's seq_len.
    """
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else [list(t) for t in block_tables]
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    for name, value in (("page_size", page_size), ("split_size", split_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if len(tables) != len(lens):
        raise ValueError(f"{len(tables)} block tables but {len(lens)} seq_lens")
    for s, (table, n) in enumerate(zip(tables, lens)):
        if not isinstance(n, int) or n < 1 or len(table) * page_size < n:
            raise ValueError(f"sequence {s}: seq_len {n} must be >= 1 and fit its {len(table)} pages of {page_size}")
    whole = [n // split_size for n in lens]
    shared, shared_splits = [], [0] * len(lens)
    candidates = [list(range(len(lens)))]  # sets of sequences that share every split before j
    j = 0
    while candidates:
        pages = slice(j * split_size // page_size, ((j + 1) * split_size - 1) // page_size + 1)
        narrowed = []
        for group in candidates:
            by_pages = {}
            for s in group:
                if whole[s] > j:
                    by_pages.setdefault(tuple(tables[s][pages]), []).append(s)
            for members in by_pages.values():
                if len(members) > 1:
                    shared.append((j, members))
                    narrowed.append(members)
                    for s in members:
                        shared_splits[s] = j + 1
        candidates = narrowed
        j += 1
    i32 = dict(dtype=torch.int32)
    sizes = [len(m) for _, m in shared]
    return CascadeGroups(
        split=torch.tensor([j for j, _ in shared], **i32),
        starts=torch.tensor([0] + sizes, **i32).cumsum(0, dtype=torch.int32),
        members=torch.tensor([s for _, m in shared for s in m], **i32),
        shared_splits=torch.tensor(shared_splits, **i32), max_members=max(sizes, default=0), split_size=split_size)


def _check_groups(groups, q, split_size):
    if not isinstance(groups, CascadeGroups):
        raise TypeError(f"groups must be a CascadeGroups (from cascade_groups), got {type(groups).__name__}")
    if groups.split_size != split_size:
        raise ValueError(f"groups were made for split_size {groups.split_size}, not {split_size}")
    if groups.shared_splits.shape != (q.shape[0],):
        raise ValueError(f"groups cover {groups.shared_splits.shape[0]} sequences, the batch has {q.shape[0]}")
    for name in ("split", "starts", "members", "shared_splits"):
        t = getattr(groups, name)
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"groups.{name} must be int32 on {q.device}, got {t.dtype} on {t.device}")


def cascade_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, groups, scale, sliding_window=None,
                       split_size=DEFAULT_SPLIT_SIZE, out=None):
    """PyTorch twin of `cascade_decode`: each shared split gathered once (through its first member's table)
    and attended by all its members' queries, each own split per sequence, then the reference merge."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, split_size)
    _check_groups(groups, q, split_size)
    out = torch.empty_like(q) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    num_splits = math.ceil(block_tables.shape[1] * k_cache.shape[1] / split_size)
    partial_out = torch.zeros(num_seqs, num_heads, num_splits, head_dim, device=q.device)
    partial_lse = torch.full((num_seqs, num_heads, num_splits), -math.inf, device=q.device)
    starts = groups.starts.tolist()
    for i, j in enumerate(groups.split.tolist()):
        members = groups.members[starts[i]:starts[i + 1]].long()
        lo, hi = j * split_size, (j + 1) * split_size
        k = gather_kv_ref(k_cache, block_tables[members[0]], hi)[lo:]
        v = gather_kv_ref(v_cache, block_tables[members[0]], hi)[lo:]
        o, lse = attend_ref(q[members], k, v, seq_lens[members].long() - 1 - lo, scale, sliding_window)
        partial_out[members, :, j] = o
        partial_lse[members, :, j] = lse
    for s, (seq_len, first) in enumerate(zip(seq_lens.tolist(), groups.shared_splits.tolist())):
        k = gather_kv_ref(k_cache, block_tables[s], seq_len)
        v = gather_kv_ref(v_cache, block_tables[s], seq_len)
        for j in range(first, math.ceil(seq_len / split_size)):
            lo = j * split_size
            o, lse = attend_ref(q[s:s + 1], k[lo:lo + split_size], v[lo:lo + split_size],
                                torch.tensor([seq_len - 1 - lo], device=q.device), scale, sliding_window)
            partial_out[s, :, j] = o[0]
            partial_lse[s, :, j] = lse[0]
    return merge_splits_ref(partial_out, partial_lse, out)


@triton.jit
def _shared_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, partial_out_ptr, partial_lse_ptr, block_tables_ptr, seq_lens_ptr,
    split_ptr, starts_ptr, members_ptr, qk_scale, window, split_size,
    stride_qs, stride_qh, stride_bt, stride_ps, stride_ph, stride_pj, stride_ls, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, MEMBERS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
):
    """Shared split i (program axis 0), KV head (axis 1), members chunk*MEMBERS.. of it (axis 2): rows are
    member-major, each member's GROUP query heads of this KV head."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(starts_ptr + i) + tl.program_id(2) * MEMBERS
    end = tl.load(starts_ptr + i + 1)
    if first < end:
        split = tl.load(split_ptr + i)
        rows = tl.arange(0, BLOCK_M)
        member = first + rows // GROUP
        row_ok = (rows < MEMBERS * GROUP) & (member < end)
        s = tl.load(members_ptr + member, mask=row_ok, other=0).to(tl.int64)
        # Padding rows get seq_len 0: every key is in their future, so they see nothing (and are not stored).
        seq_len = tl.load(seq_lens_ptr + s, mask=row_ok, other=0)
        head = kv_head * GROUP + rows % GROUP
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + s[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lo = split * split_size
        hi = lo + split_size  # whole for every member: cascade_groups shares only splits below each seq_len
        if USE_WINDOW:
            # From the earliest window start of the rows; tiles before a row's own start are fully masked for it.
            lo = tl.maximum(lo, tl.min(tl.where(row_ok, seq_len - window, hi), 0))
        # All members' tables agree up to this split's last page: read the first member's.
        table = block_tables_ptr + tl.load(members_ptr + first).to(tl.int64) * stride_bt
        o, lse = _split_partial(
            q, seq_len - 1, lo // BLOCK_N, hi, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE, kv_head,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
            HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, USE_WINDOW, PRECISION, PAGES_PER_TILE,
        )
        tl.store(partial_out_ptr + s[:, None] * stride_ps + head[:, None] * stride_ph + split * stride_pj
                 + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(partial_lse_ptr + s * stride_ls + head * stride_lh + split, lse, mask=row_ok)


def cascade_decode(q, k_cache, v_cache, block_tables, seq_lens, groups, scale, sliding_window=None,
                   split_size=DEFAULT_SPLIT_SIZE, out=None, workspace=None):
    """`split_kv_decode` with the splits in `groups` (from `cascade_groups` over these block tables and
    seq_lens, moved to q's device) read once per shared split; bitwise the same result. Returns out.
    `workspace`: as split_kv_decode's."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, split_size)
    _check_groups(groups, q, split_size)
    check_batch(q, out, "cascade_decode")
    workspace = _workspace_for(q, k_cache, block_tables, split_size, workspace)
    out = torch.empty_like(q) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_h, block_n, num_warps, num_stages = split_tile_config(head_dim, group)
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    if groups.num_shared:
        members = max(1, block_h // group)
        _shared_split_kernel[(groups.num_shared, num_kv_heads, triton.cdiv(groups.max_members, members))](
            q, k_cache, v_cache, partial_out, partial_lse, block_tables, seq_lens,
            groups.split, groups.starts, groups.members, scale * LOG2E, sliding_window or 0, split_size,
            q.stride(0), q.stride(1), block_tables.stride(0),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            PAGE_SIZE=page_size, GROUP=group, MEMBERS=members, HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim), BLOCK_M=block_h, BLOCK_N=block_n,
            USE_WINDOW=sliding_window is not None, PRECISION=precision_for(q.dtype),
            PAGES_PER_TILE=pages_per_tile(page_size, block_n),
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
        )
    # The own splits, and the merge of every split, by split-KV's kernel (after the shared splits: same stream).
    return launch_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, split_size, out,
                         workspace, start_split=groups.shared_splits)
