"""Split-KV (flash-decoding) attention for decodes: one query per sequence, the KV split at fixed positions,
the splits merged by log-sum-exp in the same launch.

Layouts:
    q, out:             [num_seqs, num_heads, head_dim] (one decode query per sequence, at position seq_lens[s] - 1)
    k_cache, v_cache:   [num_pages, page_size, num_kv_heads, head_dim]
    page_tables:       int32 [num_seqs, max_pages_per_seq];  seq_lens: int32 [num_seqs]
    partial_out:        float32 [num_seqs, num_heads, num_splits, head_dim] (scratch)
    partial_lse:        float32 [num_seqs, num_heads, num_splits] (scratch; natural log, -inf for no visible key)
    arrivals:           int32 [num_seqs, num_kv_heads] (scratch, zero at launch; each launch leaves it zero)
Split j covers positions [j * split_size, (j + 1) * split_size): a fixed size in tokens, not a fixed count,
so a sequence's splits (and its result) do not depend on the batch, page size or page-table width.
The grid has cdiv(max_pages_per_seq * page_size, split_size) splits per sequence, known without reading seq_lens
back (and fixed, as a captured CUDA graph needs); a program whose split holds no key its query sees (past the
sequence's end, or before its window) returns at once. Each program that computes a split counts its arrival
on its (sequence, KV head); the last to arrive merges that sequence's splits, in split order, into out. So the
merge reads only the sequence's own splits and takes no second launch, and a sequence's bits depend on its
own splits alone, never on the grid size or its batch-mates.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chunkwise.kernels.attention_tile import (LOG2E, attend_ref, attend_tiles, check_cache, check_window, gather_kv_ref,
                                    pages_per_tile)
from chunkwise.kernels.tiling import cast, cdiv, next_power_of_2, precision_for

DEFAULT_SPLIT_SIZE = 512


def split_tile_config(head_dim, group):
    """(BLOCK_H rows = the group's heads padded for tl.dot, BLOCK_N keys per tile, num_warps, num_stages)."""
    block_n = 64 if head_dim <= 128 else 32
    return max(16, next_power_of_2(group)), block_n, 4, 2


def _check(q, k_cache, v_cache, page_tables, seq_lens, sliding_window, split_size):
    """The argument checks of `split_kv_decode` and its reference, in one place."""
    check_cache(q, k_cache, v_cache, page_tables, seq_lens)
    check_window(sliding_window)
    block_n = split_tile_config(q.shape[2], q.shape[1] // k_cache.shape[2])[1]
    if not isinstance(split_size, int) or split_size < 1 or split_size % block_n:
        raise ValueError(f"split_size must be a positive multiple of {block_n}, got {split_size!r}")
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but seq_lens has {seq_lens.shape[0]}: one decode per sequence")


def merge_splits_ref(partial_out, partial_lse, out):
    """PyTorch twin of the split kernel's merge: softmax-weighted sum of the partials; empty splits weigh 0."""
    m = partial_lse.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(partial_lse - m)
    total = w.sum(dim=-1, keepdim=True)
    merged = (w[..., None] * partial_out).sum(dim=-2) / torch.where(total > 0, total, torch.ones_like(total))
    out.copy_(merged.to(out.dtype))
    return out


def split_kv_partials_ref(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window, split_size):
    """(partial_out, partial_lse) of `split_kv_decode`, computed split by split in float32."""
    num_seqs, num_heads, head_dim = q.shape
    num_splits = math.ceil(page_tables.shape[1] * k_cache.shape[1] / split_size)
    partial_out = torch.zeros(num_seqs, num_heads, num_splits, head_dim, device=q.device)
    partial_lse = torch.full((num_seqs, num_heads, num_splits), -math.inf, device=q.device)
    for s, seq_len in enumerate(seq_lens.tolist()):
        k = gather_kv_ref(k_cache, page_tables[s], seq_len)
        v = gather_kv_ref(v_cache, page_tables[s], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        for j in range(math.ceil(seq_len / split_size)):
            lo = j * split_size
            # Only the split's keys, with positions shifted by lo so the causal and window masks still compare
            # the same (relative) positions as on the whole sequence.
            o, lse = attend_ref(q[s:s + 1], k[lo:lo + split_size], v[lo:lo + split_size], q_pos - lo, scale,
                                sliding_window)
            partial_out[s, :, j] = o[0]
            partial_lse[s, :, j] = lse[0]
    return partial_out, partial_lse


def split_kv_decode_ref(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window=None,
                        split_size=DEFAULT_SPLIT_SIZE, out=None):
    """PyTorch twin of `split_kv_decode`: reference partials, then the reference merge."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, sliding_window, split_size)
    out = torch.empty_like(q) if out is None else out
    partials = split_kv_partials_ref(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window, split_size)
    return merge_splits_ref(*partials, out)




@triton.jit
def _split_partial(
    q, q_pos, t_start, hi, window, k_cache_ptr, v_cache_ptr, table_ptr, PAGE_SIZE: tl.constexpr, kv_head,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
):
    """(o [ROWS, D_PAD], lse [ROWS], natural log, -inf when no key is seen) of rows q at positions q_pos over
    tiles t_start.. of a split ending at hi. The one split step of split-KV, and of cascade's shared splits.
    Row sums by dot (`attend_tiles`' SUM_BY_DOT): a row's bits do not depend on the tile's height or warps, so
    cascade's taller tiles give split-KV's bits."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, q_pos, m_i, l_i, acc, t_start, tl.cdiv(hi, BLOCK_N), hi, window,
        k_cache_ptr, v_cache_ptr, table_ptr, PAGE_SIZE, kv_head,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
        HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, True, PAGES_PER_TILE, True,
    )
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    return o, lse


@triton.jit
def _merge(
    partial_out_ptr, partial_lse_ptr, out_ptr, s, head, row_ok, first, last,
    stride_ps, stride_ph, stride_pj, stride_ls, stride_lh, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, MAX_CHUNK: tl.constexpr = 64,
):
    """out[s, head] = the softmax-weighted sum of splits first..last-1 of rows `head` (merge_splits_ref's sums).
    Loads bypass L1 (.cg): other programs wrote the partials. The merge runs after the sequence's last split, at
    the end of the launch for the last sequences, so its loads are batched: the LSEs MAX_CHUNK splits at a time
    (an elementwise max in the loop, reduced after it: Triton 3.6 fails to compile a reduction carried by the loop)."""
    d = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    lse_rows = partial_lse_ptr + s * stride_ls + head * stride_lh
    out_rows = partial_out_ptr + s * stride_ps + head[:, None] * stride_ph + d[None, :]
    m_chunk = tl.full([ROWS, MAX_CHUNK], float("-inf"), tl.float32)
    for c in range(first, last, MAX_CHUNK):
        j = c + tl.arange(0, MAX_CHUNK)
        lse = tl.load(lse_rows[:, None] + j[None, :], mask=row_ok[:, None] & (j < last)[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        m_chunk = tl.maximum(m_chunk, lse)
    m = tl.max(m_chunk, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key at all (seq_len 0): every weight is 0, not NaN
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    # Unrolled so several splits' loads are in flight at once; the sums still run in split order.
    for j in tl.range(first, last, loop_unroll_factor=8):
        w = tl.exp(tl.load(lse_rows + j, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m)
        acc += w[:, None] * tl.load(out_rows + j * stride_pj, mask=mask, other=0.0, cache_modifier=".cg")
        total += w
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + s * stride_os + head[:, None] * stride_oh + d[None, :],
             cast(acc / total[:, None], out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_kernel(
    q_ptr,              # [num_seqs, num_heads, head_dim]
    k_cache_ptr,        # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,        # [num_pages, page_size, num_kv_heads, head_dim]
    out_ptr,            # [num_seqs, num_heads, head_dim]
    partial_out_ptr,    # float32 [num_seqs, num_heads, num_splits, head_dim]
    partial_lse_ptr,    # float32 [num_seqs, num_heads, num_splits]
    arrivals_ptr,       # int32 [num_seqs, num_kv_heads], zero at launch and left zero
    page_tables_ptr,   # int32 [num_seqs, max_pages_per_seq]
    seq_lens_ptr,       # int32 [num_seqs]
    start_split_ptr,    # int32 [num_seqs] when HAS_START: splits before it hold partials written already
    qk_scale, window, split_size,
    stride_qs, stride_qh, stride_os, stride_oh, stride_bt, stride_ps, stride_ph, stride_pj, stride_ls, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    PAGES_PER_TILE: tl.constexpr, HAS_START: tl.constexpr,
):
    """KV head (axis 0) of split j (axis 1) of sequence s (axis 2): the split's partials, and the merge of all
    the sequence's splits by whichever of its programs arrives last."""
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    last = tl.maximum(tl.cdiv(seq_len, split_size), 1)  # splits 0..last-1 hold the sequence (one if it is empty)
    first = 0   # the first split holding a key the query sees
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0) // split_size
    start = first
    if HAS_START:
        start = tl.maximum(first, tl.load(start_split_ptr + s))
    # The programs of splits lead..last-1 take part; when every split was written already (start == last),
    # the program of the last split computes nothing and only merges.
    lead = tl.minimum(start, last - 1)
    if (split >= lead) & (split < last):
        rows = tl.arange(0, BLOCK_H)
        row_ok = rows < GROUP
        head = kv_head * GROUP + rows
        if split >= start:
            d = tl.arange(0, D_PAD)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + s * stride_qs + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lo = split * split_size
            hi = tl.minimum(lo + split_size, seq_len)
            if USE_WINDOW:
                lo = tl.maximum(lo, seq_len - window)
            # Tiles stay at absolute multiples of BLOCK_N (split_size is one), whatever the window start.
            o, lse = _split_partial(
                q, tl.zeros([BLOCK_H], tl.int32) + seq_len - 1, lo // BLOCK_N, hi, window, k_cache_ptr, v_cache_ptr,
                page_tables_ptr + s.to(tl.int64) * stride_bt, PAGE_SIZE, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
                HEAD_DIM, D_PAD, BLOCK_H, BLOCK_N, USE_WINDOW, PRECISION, PAGES_PER_TILE,
            )
            tl.store(partial_out_ptr + s * stride_ps + head[:, None] * stride_ph + split * stride_pj + d[None, :], o,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(partial_lse_ptr + s * stride_ls + head * stride_lh + split, lse, mask=row_ok)
        # Every thread's stores precede the arrival (barrier), which releases them to the merging program.
        tl.debug_barrier()
        arrival = arrivals_ptr + s * tl.num_programs(0) + kv_head
        arrived = tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu")
        if arrived == last - lead - 1:
            tl.store(arrival, 0)  # every program of this (sequence, KV head) has arrived: ready for the next launch
            _merge(partial_out_ptr, partial_lse_ptr, out_ptr, s, head, row_ok, first, last,
                   stride_ps, stride_ph, stride_pj, stride_ls, stride_lh, stride_os, stride_oh,
                   HEAD_DIM, D_PAD, BLOCK_H)


@dataclass(frozen=True)
class SplitWorkspace:
    """The split kernel's scratch for a batch (layouts above). One launch after another on a stream may share
    it (each launch leaves the arrivals zero): an engine step makes one for all its layers."""
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    arrivals: torch.Tensor


def split_workspace(num_seqs, num_heads, num_kv_heads, head_dim, num_splits, device) -> SplitWorkspace:
    """A fresh SplitWorkspace; num_splits = num_splits_for(page tables' width, page_size, split_size)."""
    return SplitWorkspace(torch.empty(num_seqs, num_heads, num_splits, head_dim, device=device, dtype=torch.float32),
                          torch.empty(num_seqs, num_heads, num_splits, device=device, dtype=torch.float32),
                          torch.zeros(num_seqs, num_kv_heads, device=device, dtype=torch.int32))


def num_splits_for(max_pages_per_seq, page_size, split_size):
    """Splits per sequence in the grid: enough for a sequence filling its page-table row."""
    return cdiv(max_pages_per_seq * page_size, split_size)


def _workspace_for(q, k_cache, page_tables, split_size, workspace):
    """`workspace` checked against the batch, or a fresh one."""
    num_seqs, num_heads, head_dim = q.shape
    shape = (num_seqs, num_heads, num_splits_for(page_tables.shape[1], k_cache.shape[1], split_size), head_dim)
    if workspace is None:
        return split_workspace(*shape[:2], k_cache.shape[2], head_dim, shape[2], q.device)
    return check_workspace(workspace, shape, (num_seqs, k_cache.shape[2]), q.device, "split_workspace")


def check_workspace(workspace, out_shape, arrivals_shape, device, maker):
    """`workspace` if it is a SplitWorkspace of partial_out out_shape (partial_lse: all but its last dimension) and
    arrivals arrivals_shape on device; else a TypeError or ValueError naming the field. maker: the function that
    makes the right one, for the message."""
    if not isinstance(workspace, SplitWorkspace):
        raise TypeError(f"workspace must be a SplitWorkspace (from {maker}), got {type(workspace).__name__}")
    want = {"partial_out": (tuple(out_shape), torch.float32), "partial_lse": (tuple(out_shape[:-1]), torch.float32),
            "arrivals": (tuple(arrivals_shape), torch.int32)}
    for name, (size, dtype) in want.items():
        t = getattr(workspace, name)
        if t.shape != size or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"workspace.{name} must be contiguous {dtype} {size} on {device} for this batch, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return workspace


def launch_splits(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window, split_size, out, workspace,
                  start_split=None):
    """The split kernel over every sequence's splits from start_split[s] (int32 [num_seqs]; None: 0) on, merged
    into out with the partials already in `workspace` for the splits before it. Arguments as checked by _check
    and _workspace_for."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_h, block_n, num_warps, num_stages = split_tile_config(head_dim, group)
    partial_out, partial_lse, arrivals = workspace.partial_out, workspace.partial_lse, workspace.arrivals
    # KV heads vary fastest across programs, so the programs that run together read all heads of the same
    # positions: each position's heads are one contiguous run of the cache (DRAM locality; same math). Then
    # splits, then sequences: a sequence's programs run close together, so most merges overlap other work.
    _split_kernel[(num_kv_heads, partial_out.shape[2], num_seqs)](
        q, k_cache, v_cache, out, partial_out, partial_lse, arrivals, page_tables, seq_lens, start_split,
        scale * LOG2E, sliding_window or 0, split_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
        BLOCK_H=block_h, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
        PRECISION=precision_for(q.dtype),
        # Page ids loaded once per tile, not per key (faster: docs/BENCHMARKS.md, "Behind the code").
        PAGES_PER_TILE=pages_per_tile(page_size, block_n), HAS_START=start_split is not None,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )
    return out


def check_batch(q, out, what):
    """The grid's sequence-axis limit and out's layout, for `what` (the calling function's name)."""
    if q.shape[0] > 65535:  # sequences are the launch grid's third axis, which CUDA caps at 65535
        raise ValueError(f"{what} serves at most 65535 sequences per call, got {q.shape[0]}")
    if out is not None and (out.shape != q.shape or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} with head_dim contiguous, got {tuple(out.shape)}")


def split_kv_decode(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window=None,
                    split_size=DEFAULT_SPLIT_SIZE, out=None, workspace=None):
    """Decode attention with the KV split every split_size positions, then merged; returns out. `workspace`
    (a SplitWorkspace for this batch) saves allocating and zeroing the scratch on every call."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, sliding_window, split_size)
    check_batch(q, out, "split_kv_decode")
    workspace = _workspace_for(q, k_cache, page_tables, split_size, workspace)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return out
    return launch_splits(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window, split_size, out,
                         workspace)
