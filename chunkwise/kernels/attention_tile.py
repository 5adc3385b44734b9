"""The KV loop shared by the attention kernels, and the PyTorch reference both are checked against.

Tiles sit at absolute positions: tile t covers positions [t * BLOCK_N, (t + 1) * BLOCK_N) of the sequence,
whatever the chunk start or page size, and every query row folds the tiles in increasing order. A tile that
is fully masked for a row leaves that row's state bitwise unchanged, so a row's result depends only on its
own position and the cache, not on which other rows share its program (chunking, batch, page size).
"""
import math

import torch
import triton
import triton.language as tl

from chunkwise.kernels.tiling import cast, dot

LOG2E = 1.4426950408889634


def check_window(sliding_window):
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_cache(q, k_cache, v_cache, page_tables, seq_lens):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal 4-d")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} must be [rows, heads, {k_cache.shape[3]}]")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if page_tables.dim() != 2 or page_tables.dtype != torch.int32:
        raise ValueError(f"page_tables must be int32 [seqs, pages], got {page_tables.dtype} "
                         f"{tuple(page_tables.shape)}")
    if seq_lens.shape != (page_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{page_tables.shape[0]}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need head_dim contiguous")


def gather_kv_ref(cache, page_table, seq_len):
    """[seq_len, num_kv_heads, head_dim]: positions 0..seq_len-1 of one sequence, read through its pages."""
    pos = torch.arange(seq_len, device=cache.device)
    pages = page_table.to(cache.device)[pos // cache.shape[1]].long()
    return cache[pages, pos % cache.shape[1]]


def attend_ref(q, k, v, q_pos, scale, sliding_window):
    """Float32 masked softmax attention of rows q [n, H, D] at positions q_pos [n] over k/v [L, KVH, D].

    Returns (out [n, H, D], lse [n, H]) in float32; lse is the natural-log sum of exp of the scaled scores.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", probs, v), lse.transpose(0, 1)


@triton.jit
def attend_tiles(
    q, q_pos, m_i, l_i, acc, t_start, t_end, seq_len, window,
    k_cache_ptr, v_cache_ptr, table_ptr, PAGE_SIZE: tl.constexpr, kv_head,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
    SUM_BY_DOT: tl.constexpr = False,
):
    """Fold KV tiles t_start..t_end-1 into the online-softmax state (m_i, l_i, acc) of rows q [M, D_PAD].

    Positions >= seq_len are neither loaded nor seen: split-KV passes its split's end there, not the sequence's.
    PAGE_SIZE is a compile-time constant so the per-position page lookup divides by a constant.
    Scores are in log2 units (qk_scale = scale * log2(e)). Rows that see no key keep m_i = -inf, l_i = 0.
    MASKED=False is for tiles that every row sees whole: the mask would keep every score, so skipping it
    changes no bit (the kernels launch with FP fusion off so both variants round alike).
    PAGES_PER_TILE > 0 (see `pages_per_tile`): tiles hold whole pages or lie inside one, so each tile loads its
    PAGES_PER_TILE page ids once and spreads them over their positions, instead of one table load and page
    division per position; 0 keeps the per-position lookup (any page size). Both read the same addresses.
    SUM_BY_DOT: each row's sum of probabilities comes from a dot with ones (of the probabilities as rounded for
    the dot with V), whose per-element rounding is the MMA's, not the order in which the tile's layout spreads a
    row over threads and warps (tl.sum's), so a row gets the same bits in a tile of any height or warp count.
    """
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if SUM_BY_DOT:
        ones = cast(tl.full([BLOCK_N, 16], 1.0, tl.float32), v_cache_ptr.dtype.element_ty)
    for t in range(t_start, t_end):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        if PAGES_PER_TILE > 0:
            RUN: tl.constexpr = BLOCK_N // PAGES_PER_TILE  # positions of the tile in each of its pages
            idx = t * BLOCK_N // PAGE_SIZE + tl.arange(0, PAGES_PER_TILE)
            pages = tl.load(table_ptr + idx, mask=idx * PAGE_SIZE < seq_len, other=0).to(tl.int64)
            page = tl.reshape(tl.broadcast_to(pages[:, None], [PAGES_PER_TILE, RUN]), [BLOCK_N])
        else:
            page = tl.load(table_ptr + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + page[None, :] * stride_kp + offset[None, :] * stride_ks
                    + kv_head * stride_kh + d[:, None], mask=d_ok[:, None] & pos_ok[None, :], other=0.0)
        scores = dot(q, k, PRECISION) * qk_scale
        if MASKED:
            mask = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if USE_WINDOW:
                mask = mask & (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with no visible key yet keeps -inf; subtracting 0 instead keeps exp2 free of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        v = tl.load(v_cache_ptr + page[:, None] * stride_vp + offset[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        p_v = cast(p, v.dtype)
        if SUM_BY_DOT:
            # Every column of p_v @ ones is the row's sum, bitwise alike: their max is that sum, in any order.
            l_i = l_i * alpha + tl.max(dot(p_v, ones, PRECISION), 1)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p_v, v, PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def pages_per_tile(page_size, block_n):
    """Page ids per tile of block_n positions when page_size divides block_n (block_n // page_size) or
    block_n divides page_size (1); 0 otherwise (page sizes that are not powers of two)."""
    if block_n % page_size == 0:
        return block_n // page_size
    return 1 if page_size % block_n == 0 else 0
