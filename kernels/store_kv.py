"""Write the K and V of a flat batch of new tokens into the paged cache.

Layouts:
    key, value:         [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache:   [num_pages, page_size, num_kv_heads, head_dim] (any dtype; values are cast to it)
    slot_mapping:       int64 [num_tokens]; slot = page_id * page_size + offset; -1 skips the token (padding)

One program stores a block of `store_block_tokens(...)` tokens, all their heads and dims as one
[BLOCK_T, H_PAD * D_PAD] tile. Under Triton's CPU interpreter every program costs milliseconds of Python,
so one program per token made the store dominate a CPU forward pass; on a GPU the store is a plain copy and
a tile of a few thousand elements per program keeps it coalesced without spilling registers.
"""
import torch
import triton
import triton.language as tl

from kernels.attention_tile import cast

# Elements of K (and as many of V) per program. GPU: 16 KiB of fp32 each, 32 values per thread at 4 warps.
# Interpreter: every program costs milliseconds of Python, so it gets tiles as large as numpy handles without
# strain (measured, 512 tokens x 2 heads x d64 fp32: 2 s as 512 one-token programs, 108 ms as 16, 21 ms as 1).
_GPU_TILE_ELEMENTS, _INTERPRETER_TILE_ELEMENTS = 4096, 65536


def store_block_tokens(num_kv_heads, head_dim, device):
    """Tokens per program on `device`: as many whole tokens as fit in its tile (a power of two, at least 1)."""
    per_token = triton.next_power_of_2(num_kv_heads) * triton.next_power_of_2(head_dim)
    tile = _GPU_TILE_ELEMENTS if torch.device(device).type == "cuda" else _INTERPRETER_TILE_ELEMENTS
    return max(1, tile // per_token)


def _check(key, value, k_cache, v_cache, slot_mapping):
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be equal [tokens, heads, dim]")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal 4-d")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} != key heads/dim {tuple(key.shape[1:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({key.shape[0]},)")


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping):
    """PyTorch twin of `store_kv`: an index_put over the flattened slots."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_cs, stride_ch, stride_dp, stride_ds, stride_dh,
    num_kv_heads, page_size,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < num_tokens
    slot = tl.load(slot_ptr + token, mask=token_ok, other=-1)
    # Padding tokens (slot -1) and the rows past num_tokens store nothing.
    row_ok = slot >= 0
    page = (slot // page_size)[:, None]
    offset = (slot % page_size)[:, None]
    # Column c of the tile is head c // D_PAD, dim c % D_PAD (powers of two: shifts and masks).
    col = tl.arange(0, H_PAD * D_PAD)
    h = (col // D_PAD)[None, :]
    d = (col % D_PAD)[None, :]
    mask = row_ok[:, None] & (h < num_kv_heads) & (d < HEAD_DIM)
    t = token.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + page * stride_cp + offset * stride_cs + h * stride_ch + d
    v_dst = v_cache_ptr + page * stride_dp + offset * stride_ds + h * stride_dh + d
    tl.store(k_dst, cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    """Scatter key/value rows into their slots of k_cache/v_cache (in place); slots of -1 are skipped."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kv needs head_dim contiguous in key, value and both caches")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_t = store_block_tokens(num_kv_heads, head_dim, key.device)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_T=block_t,
    )
