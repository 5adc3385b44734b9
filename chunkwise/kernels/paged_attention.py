"""Paged attention for a mixed batch: prefill chunks and decodes (q_len >= 1 at any context offset) in one launch.

Layouts:
    q, out:           [num_tokens, num_heads, head_dim]; sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    page_tables:     int32 [num_seqs, max_pages_per_seq]; position p of s lives in page page_tables[s, p // page_size]
    seq_lens:         int32 [num_seqs], tokens in the cache for s including its new (already stored) tokens
    query_start_loc:  int32 [num_seqs + 1], cumulative query counts starting at 0
    positions:        int64 [num_tokens] or None
Query j of s sits at position seq_lens[s] - q_len + j, or at positions[query_start_loc[s] + j] when positions are
given (in strictly ascending order within s, each < seq_lens[s], not necessarily contiguous: the rows a blend
recomputes), and sees positions <= its own (and > pos - sliding_window).

One program serves BLOCK_Q query tokens of one sequence times the GROUP query heads of one KV head (GQA packed
into the rows), so every loaded K/V tile serves all heads that share it. Tile sizes depend only on head_dim and
the group size, never on q_len, batch or page size: that is what keeps outputs bitwise invariant.

Split context (`split_size`): a chunk of a few hundred rows fills few programs (its query blocks times the KV
heads), and each sweeps the whole context, so a long context's short chunk leaves most SMs idle. With split_size,
program (block, head, j) folds only the keys at positions [j * split_size, (j + 1) * split_size) and the last of
a block's programs to arrive merges its splits in split order, as split-KV decode does. The splits sit at absolute
positions, so a row's bits still depend only on its position and the cache (the same invariance), but they are
not the single pass's bits: a caller that needs one row to equal another (deterministic mode) uses one path.
    partial_out:  float32 [grid blocks, num_kv_heads, num_splits, BLOCK_M, D_PAD] (scratch)
    partial_lse:  float32 [grid blocks, num_kv_heads, num_splits, BLOCK_M] (scratch; log2 units, -inf: no key)
    arrivals:     int32 [grid blocks, num_kv_heads] (scratch, zero at launch; each launch leaves it zero)

One query per sequence (`paged_decode`, deterministic mode's decodes): block s is sequence s (query_start_loc
unread), every tile is folded masked in one loop, and a batch with programs for two an SM loads unpipelined (one
stage: how loads are scheduled, not what is summed). The same tiles in the same order: the general launch's bits.
With row sums by dot (`sum_by_dot`) a row's bits do not depend on the tile's height or warps, so one-token queries
take 16-row tiles instead of 64 (deterministic mode).
"""

import torch
import triton
import triton.language as tl

from chunkwise.kernels.attention_tile import (LOG2E, attend_ref, attend_tiles, check_cache, check_window, gather_kv_ref,
                                    pages_per_tile)
from chunkwise.kernels.split_kv import SplitWorkspace, check_workspace
from chunkwise.kernels.tiling import cast, cdiv, next_power_of_2, precision_for, shared_memory, sm_count


# A block's opt-in shared memory from which a GPU counts as Hopper-class here (H100/H200: 227 KB; A100: 164 KB):
# the 256-row tiles were measured only there (their sm_90 build takes 192 KB, tests/hopper_compile.py).
HOPPER_SHARED_MEMORY = 200 * 1024


def tile_config(head_dim, group, dtype, shared_memory=0, max_rows=256, busy=False):
    """(BLOCK_M rows, BLOCK_N keys per tile, num_warps, num_stages) for a head_dim, GQA group size and dtype, on a
    device whose blocks may take `shared_memory` bytes (0: the CPU's interpreter); max_rows (64, 128 or 256) caps
    the rows where the GQA group allows. busy: a decode batch with programs enough for two an SM (`paged_decode`).

    256 rows on Hopper, 128 elsewhere; 64 rows (one warpgroup) for one-token queries. On Hopper, tiles capped at
    64 or 128 rows (one-token queries; a blend's scattered rows, small prefills' splits) take three stages (one
    when busy), unless a GQA group's rows outgrow the cap; fp32 tiles of 128 rows overflow shared memory, and d256
    keeps small tiles for registers.
    Every choice gives a row the 128-row tiles' bits on every shape measured; 16- or 32-row tiles do not (with
    tl.sum's row sums; with row sums by dot they do: decode_tile_config). Measurements: docs/BENCHMARKS.md,
    "Behind the code: tile_config".
    """
    if head_dim <= 128 and dtype != torch.float32:
        rows = 256 if shared_memory >= HOPPER_SHARED_MEMORY and max_rows >= 256 else min(128, max_rows)
        block_m = max(rows, next_power_of_2(group))
        # a capped tile its cap's rows fill (not one a GQA group widened) pipelines a third stage on Hopper
        stages = 3 if block_m == rows <= 128 and shared_memory >= HOPPER_SHARED_MEMORY else 2
        if stages == 3 and busy:
            stages = 1
        return block_m, 128, 8 if rows >= 128 else 4, stages
    return max(64, next_power_of_2(group)), 64 if head_dim <= 128 else 32, 4, 2


def decode_tile_config(head_dim, group, dtype, shared_memory=0):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of `paged_decode` with row sums by dot, whose row bits do not
    depend on the tile: the group's rows padded to 16 (the fewest tl.dot takes) over tile_config's key tiles (the
    tiles a row folds, and their order, must be the prefill's), 4 warps, three stages on Hopper (two elsewhere).

    They give the bits of 64-, 128- and 256-row tiles on every batch measured, though their dots lower to mma.sync
    and the taller tiles' to wgmma. Measurements: docs/BENCHMARKS.md, "Behind the code: decode_tile_config".
    """
    block_n = tile_config(head_dim, group, dtype, shared_memory)[1]
    return max(16, next_power_of_2(group)), block_n, 4, 3 if shared_memory >= HOPPER_SHARED_MEMORY else 2


def _check(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, sliding_window, out, positions):
    check_cache(q, k_cache, v_cache, page_tables, seq_lens)
    check_window(sliding_window)
    if query_start_loc is None:   # paged_decode: one query per sequence
        if q.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"paged_decode takes one query per sequence: q has {q.shape[0]} rows for "
                             f"{seq_lens.shape[0]} sequences")
    elif query_start_loc.shape != (seq_lens.shape[0] + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [{seq_lens.shape[0] + 1}], got {query_start_loc.dtype} "
                         f"{tuple(query_start_loc.shape)}")
    if out is not None and (out.shape != q.shape or out.stride(2) != 1):
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)} with head_dim contiguous")
    if positions is not None and (positions.shape != (q.shape[0],) or positions.dtype != torch.int64
                                  or positions.stride(0) != 1 or positions.device != q.device):
        raise ValueError(f"positions must be contiguous int64 [{q.shape[0]}] on {q.device}, got {positions.dtype} "
                         f"{tuple(positions.shape)} on {positions.device}")


def paged_attention_ref(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale,
                        sliding_window=None, out=None, positions=None):
    """PyTorch twin of `paged_attention`: per sequence, gather its K/V and run a float32 masked softmax.

    Unlike the kernel, which reads nothing back to the host, it also checks the values of explicit positions."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, sliding_window, out, positions)
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        k = gather_kv_ref(k_cache, page_tables[s], seq_len)
        v = gather_kv_ref(v_cache, page_tables[s], seq_len)
        if positions is None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        else:
            q_pos = positions[rows]
            if q_pos[0] < 0 or q_pos[-1] >= seq_len or (q_pos[1:] <= q_pos[:-1]).any():
                raise ValueError(f"positions of sequence {s} must ascend strictly within [0, {seq_len}), got "
                                 f"{q_pos.tolist()}")
        out[rows] = attend_ref(q[rows], k, v, q_pos, scale, sliding_window)[0].to(out.dtype)
    return out


def paged_decode_ref(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window=None, out=None):
    """PyTorch twin of `paged_decode`: `paged_attention_ref` with one query per sequence."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, None, sliding_window, out, None)
    qsl = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, page_tables, seq_lens, qsl, scale, sliding_window, out)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, block_idx, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include block_idx; sequence s's first block is qsl[s] // BLOCK_Q + s."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= block_idx:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _fold(
    q, q_pos, lo, hi, full_lo, full_hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE: tl.constexpr,
    kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr, ONE_LOOP: tl.constexpr,
    SUM_BY_DOT: tl.constexpr,
):
    """(m, l, acc) of rows q over tiles [lo, hi), from a fresh state: the tiles outside [full_lo, full_hi) masked.
    ONE_LOOP: every tile masked, in one loop (the same bits: a mask that keeps every score changes none)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if ONE_LOOP:
        return attend_tiles(
            q, q_pos, m_i, l_i, acc, lo, hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,
            kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
            HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, True, PAGES_PER_TILE, SUM_BY_DOT,
        )
    f_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    f_hi = tl.minimum(tl.maximum(full_hi, f_lo), hi)
    m_i, l_i, acc = attend_tiles(
        q, q_pos, m_i, l_i, acc, lo, f_lo, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,
        kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
        HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, True, PAGES_PER_TILE, SUM_BY_DOT,
    )
    m_i, l_i, acc = attend_tiles(
        q, q_pos, m_i, l_i, acc, f_lo, f_hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,
        kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
        HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, False, PAGES_PER_TILE, SUM_BY_DOT,
    )
    m_i, l_i, acc = attend_tiles(
        q, q_pos, m_i, l_i, acc, f_hi, hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,
        kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
        HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, True, PAGES_PER_TILE, SUM_BY_DOT,
    )
    return m_i, l_i, acc


@triton.jit
def _merge_splits(partial_out_ptr, partial_lse_ptr, slot, first, last, row_ok, d_ok,
                  BLOCK_M: tl.constexpr, D_PAD: tl.constexpr):
    """The softmax-weighted sum of a block's splits first..last-1, in split order (log2 units). Loads bypass L1
    (.cg): other programs wrote the partials."""
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    lse_rows = partial_lse_ptr + slot * BLOCK_M + rows
    out_rows = partial_out_ptr + slot * (BLOCK_M * D_PAD) + rows[:, None] * D_PAD + d[None, :]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for j in range(first, last):
        m = tl.maximum(m, tl.load(lse_rows + j * BLOCK_M, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row saw no key: every weight 0, not NaN
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for j in range(first, last):
        w = tl.exp2(tl.load(lse_rows + j * BLOCK_M, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m)
        acc += w[:, None] * tl.load(out_rows + j * (BLOCK_M * D_PAD), mask=row_ok[:, None] & d_ok[None, :],
                                    other=0.0, cache_modifier=".cg")
        total += w
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]


# The tables' row stride is the width of the columns a step passes (the runner narrows an eager step's to what it
# reads): not specialised, so no width compiles a variant the warm-up did not.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    positions_ptr,  # int64 [num_tokens], read if EXPLICIT_POSITIONS (None otherwise)
    partial_out_ptr, partial_lse_ptr, arrivals_ptr,  # the split scratch (module docstring) if SPLIT_TILES
    num_seqs, num_kv_heads, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
    EXPLICIT_POSITIONS: tl.constexpr,
    SPLIT_TILES: tl.constexpr,  # tiles per split (axis 1 of the grid); 0: one pass over the context
    ONE_TOKEN: tl.constexpr,    # one query per sequence (`paged_decode`): block s is sequence s, qsl unread
    SUM_BY_DOT: tl.constexpr,   # row sums by dot (attend_tiles): a row's bits then do not depend on the tile
):
    # Last query blocks first, each block's KV heads side by side: a sequence's later blocks see more keys, so the
    # longest programs start first on every head, and the short ones fill the tail. (Head by head, the last
    # head's longest blocks started late, as the first heads' short ones finished.)
    r = tl.num_programs(0) - 1 - tl.program_id(0)
    block_idx = r // num_kv_heads
    kv_head = r % num_kv_heads
    if ONE_TOKEN:
        s = block_idx
        q_start = s
        q_len = 1
        local = 0
    else:
        s = _find_sequence(query_start_loc_ptr, num_seqs, block_idx, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + s)
        q_len = tl.load(query_start_loc_ptr + s + 1) - q_start
        local = block_idx - (q_start // BLOCK_Q + s)
        if local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + s)

    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    row_tok = (q_start + tok).to(tl.int64)

    if EXPLICIT_POSITIONS:
        # The block's rows may lie far apart: its tiles run from the first row's window to the last row, and
        # the tile bounds below follow from the first and last position as for implicit ones, so a row at the
        # same position folds the same tiles in the same order (those outside its own range leave no bit).
        q_pos = tl.load(positions_ptr + row_tok, mask=row_ok, other=0).to(tl.int32)
        first_pos = tl.min(tl.where(row_ok, q_pos, seq_len), 0)
        last_pos = tl.minimum(tl.max(tl.where(row_ok, q_pos, 0), 0) + 1, seq_len)  # one past the block's last query
    else:
        q_pos = seq_len - q_len + tok
        first_pos = seq_len - q_len + local * BLOCK_Q
        last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the block's last query
    t_end = tl.cdiv(last_pos, BLOCK_N)
    t_start = 0
    # Tiles [full_lo, full_hi) are seen whole by every row of the block: they skip the mask.
    full_lo = t_start
    if USE_WINDOW:
        t_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window, 0), BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, t_start), t_end)
    full_hi = tl.minimum(tl.maximum((first_pos + 1) // BLOCK_N, full_lo), t_end)
    table = page_tables_ptr + s.to(tl.int64) * stride_bt
    out_ptrs = out_ptr + row_tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT_TILES > 0:
        split = tl.program_id(1)
        first = t_start // SPLIT_TILES
        last = tl.cdiv(t_end, SPLIT_TILES)   # the block's splits: first..last-1
        if (split >= first) & (split < last):
            q = tl.load(q_ptr + row_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask,
                        other=0.0)
            m_i, l_i, acc = _fold(
                q, q_pos, tl.maximum(t_start, split * SPLIT_TILES), tl.minimum(t_end, (split + 1) * SPLIT_TILES),
                full_lo, full_hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
                BLOCK_M, HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, PAGES_PER_TILE, False, SUM_BY_DOT,
            )
            empty = l_i == 0.0   # rows before the split's first key, and padding rows
            o = acc / tl.where(empty, 1.0, l_i)[:, None]
            if last - first == 1:
                # The block's only split: merging it would weigh it by exp2(0) = 1 and divide by 1, these bits.
                tl.store(out_ptrs, cast(o, out_ptr.dtype.element_ty), mask=io_mask)
            else:
                slot = block_idx * num_kv_heads + kv_head   # this (block, KV head)'s partials
                j = (slot * tl.num_programs(1) + split).to(tl.int64)
                tl.store(partial_out_ptr + j * (BLOCK_M * D_PAD) + rows[:, None] * D_PAD + d[None, :], o,
                         mask=io_mask)
                tl.store(partial_lse_ptr + j * BLOCK_M + rows,
                         tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=row_ok)
                # Every thread's stores precede the arrival (barrier), which releases them to the merging program.
                tl.debug_barrier()
                arrival = arrivals_ptr + slot
                arrived = tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu")
                if arrived == last - first - 1:
                    tl.store(arrival, 0)  # every split of this (block, KV head) is in: ready for the next launch
                    o = _merge_splits(partial_out_ptr, partial_lse_ptr, (slot * tl.num_programs(1)).to(tl.int64),
                                      first, last, row_ok, d_ok, BLOCK_M, D_PAD)
                    tl.store(out_ptrs, cast(o, out_ptr.dtype.element_ty), mask=io_mask)
    else:
        q = tl.load(q_ptr + row_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask,
                    other=0.0)
        m_i, l_i, acc = _fold(
            q, q_pos, t_start, t_end, full_lo, full_hi, seq_len, window, k_cache_ptr, v_cache_ptr, table, PAGE_SIZE,
            kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
            BLOCK_M, HEAD_DIM, D_PAD, BLOCK_N, USE_WINDOW, PRECISION, PAGES_PER_TILE, ONE_TOKEN, SUM_BY_DOT,
        )
        # Padding rows see no key (l_i = 0); only they would divide by zero, and they are not stored.
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, cast(o, out_ptr.dtype.element_ty), mask=io_mask)


def _layout(num_tokens, num_heads, head_dim, dtype, device, num_kv_heads, num_seqs, max_rows, busy=False,
            decode_tiles=False):
    """(block_m, block_q, block_n, num_warps, num_stages, grid blocks) of a launch; decode_tiles: decode_tile_config's
    tiles (max_rows and busy then do not apply)."""
    if max_rows not in (64, 128, 256):
        raise ValueError(f"max_rows must be 64, 128 or 256, got {max_rows!r}")
    group = num_heads // num_kv_heads
    if decode_tiles:
        block_m, block_n, num_warps, num_stages = decode_tile_config(head_dim, group, dtype, shared_memory(device))
    else:
        block_m, block_n, num_warps, num_stages = tile_config(head_dim, group, dtype, shared_memory(device),
                                                              max_rows, busy)
    block_q = block_m // group
    # Sequence s's blocks start at query_start_loc[s] // block_q + s, so this bound covers every block
    # without reading query lengths back to the host.
    return block_m, block_q, block_n, num_warps, num_stages, num_tokens // block_q + num_seqs


def _split_shapes(layout, k_cache, page_tables, split_size):
    """(partial_out shape, arrivals shape) of a split launch of this `_layout`."""
    block_m, _, block_n, _, _, blocks = layout
    if not isinstance(split_size, int) or split_size < 1 or split_size % block_n:
        raise ValueError(f"split_size must be a positive multiple of {block_n} (the key tile), got {split_size!r}")
    splits = cdiv(page_tables.shape[1] * k_cache.shape[1], split_size)
    num_kv_heads = k_cache.shape[2]
    return (blocks, num_kv_heads, splits, block_m, next_power_of_2(k_cache.shape[3])), (blocks, num_kv_heads)


def _new_workspace(out_shape, arrivals_shape, device) -> SplitWorkspace:
    return SplitWorkspace(torch.empty(out_shape, device=device, dtype=torch.float32),
                          torch.empty(out_shape[:-1], device=device, dtype=torch.float32),
                          torch.zeros(arrivals_shape, device=device, dtype=torch.int32))


def paged_split_workspace(num_tokens, num_heads, dtype, k_cache, page_tables, split_size, max_rows=256):
    """The scratch of `paged_attention(..., split_size=split_size)` for num_tokens query rows of num_heads heads
    in dtype over these caches and page tables; one launch after another on a stream may share it."""
    layout = _layout(num_tokens, num_heads, k_cache.shape[3], dtype, k_cache.device, k_cache.shape[2],
                     page_tables.shape[0], max_rows)
    return _new_workspace(*_split_shapes(layout, k_cache, page_tables, split_size), k_cache.device)


def paged_attention(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale,
                    sliding_window=None, out=None, max_rows=256, positions=None, split_size=None, workspace=None,
                    sum_by_dot=False):
    """Causal attention of every query row over its sequence's pages; returns out (allocated if None).

    max_rows (64, 128 or 256) caps the rows of a program's tile (see tile_config): 64-row tiles give a row the bits
    of 128- and 256-row ones (tile_config says where measured).

    sum_by_dot: each row's sum of probabilities by a dot with ones, not a reduction over the tile's layout
    (`attend_tiles`' SUM_BY_DOT), so a row's bits do not depend on the tile at all: `paged_decode(...,
    sum_by_dot=True)`'s 16-row tiles give them too. Other bits than without it, and slower in 256-row
    prefill tiles, whose extra dot crowds their registers (docs/BENCHMARKS.md, "Behind the code: sum_by_dot").
    Deterministic mode takes it everywhere.

    positions (int64 [num_tokens]) places each row explicitly (see the module docstring); a row at the same
    position gets the same bits as without them. Their values are not checked here (that would read them back
    to the host); the reference checks them.

    split_size (a multiple of the key tile, 128 covers every tile): split the context across programs every
    split_size positions (module docstring), with `workspace` from paged_split_workspace (made here if None).
    Same rows, rounded differently from the single pass; neither depends on chunking, batch or page size."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, sliding_window, out, positions)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    layout = _layout(num_tokens, num_heads, head_dim, q.dtype, q.device, num_kv_heads, num_seqs, max_rows)
    if split_size is not None:
        shapes = _split_shapes(layout, k_cache, page_tables, split_size)
        workspace = (_new_workspace(*shapes, q.device) if workspace is None
                     else check_workspace(workspace, *shapes, q.device, "paged_split_workspace"))
    elif workspace is not None:
        raise ValueError("workspace is the split scratch: pass split_size with it")
    return _launch(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale, sliding_window, out, layout,
                   positions, split_size, workspace, sum_by_dot)


def busy_decode_seqs(num_kv_heads, device) -> float:
    """The fewest sequences from which a `paged_decode` batch is busy: programs (sequences x KV heads) for two an
    SM, so it loads unpipelined (tile_config). Infinite off CUDA."""
    sms = sm_count(device)
    return cdiv(2 * sms, num_kv_heads) if sms else float("inf")


def paged_decode(q, k_cache, v_cache, page_tables, seq_lens, scale, sliding_window=None, out=None, max_rows=64,
                 sum_by_dot=False):
    """`paged_attention` of one query per sequence (row s is sequence s's newest position), with the bits of
    paged_attention(..., query_start_loc=arange(num_seqs + 1)): the same tiles folded in the same order. Program s
    takes sequence s, where paged_attention's programs each search query_start_loc for theirs (8 dependent loads
    for 256 sequences) and its spare ones find none; and it folds every tile masked in one loop (the same bits:
    a mask that keeps every score changes none), whose single set of pipeline buffers leaves a block fewer
    registers spilled than the three loops' (8 bytes against 72 in the sm_90 build); busy batches load
    unpipelined (tile_config). max_rows as paged_attention's. sum_by_dot as paged_attention's, whose bits it then
    gives from 16-row tiles (decode_tile_config: mostly faster than split-KV for busy batches), max_rows unused."""
    _check(q, k_cache, v_cache, page_tables, seq_lens, None, sliding_window, out, None)
    num_seqs, num_heads, head_dim = q.shape
    busy = not sum_by_dot and num_seqs >= busy_decode_seqs(k_cache.shape[2], q.device)
    layout = _layout(num_seqs, num_heads, head_dim, q.dtype, q.device, k_cache.shape[2], num_seqs, max_rows, busy,
                     decode_tiles=sum_by_dot)
    return _launch(q, k_cache, v_cache, page_tables, seq_lens, None, scale, sliding_window, out,
                   layout[:-1] + (num_seqs,), None, None, None, sum_by_dot)


def _launch(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale, sliding_window, out, layout,
            positions, split_size, workspace, sum_by_dot):
    """One launch of the kernel over `layout`'s blocks; query_start_loc None: one query per sequence."""
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_q, block_n, num_warps, num_stages, blocks = layout
    splits = workspace.partial_out.shape[2] if workspace is not None else 1
    _paged_attention_kernel[(blocks * num_kv_heads, splits)](
        q, k_cache, v_cache, out, page_tables, seq_lens, query_start_loc, positions,
        *((workspace.partial_out, workspace.partial_lse, workspace.arrivals) if workspace is not None
          else (None, None, None)),
        num_seqs, num_kv_heads, scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, PRECISION=precision_for(q.dtype),
        PAGES_PER_TILE=pages_per_tile(k_cache.shape[1], block_n), EXPLICIT_POSITIONS=positions is not None,
        SPLIT_TILES=split_size // block_n if split_size is not None else 0, ONE_TOKEN=query_start_loc is None,
        SUM_BY_DOT=sum_by_dot,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )
    return out
