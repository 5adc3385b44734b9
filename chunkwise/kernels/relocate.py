"""Moving cached K/V to other positions (blend mode's placed K/V): copy slot to slot, re-rotating K.

Layouts (one layer's cache, or with `layers` every layer's, moved in one launch):
    k_cache, v_cache:  [num_pages, page_size, num_kv_heads, head_dim] contiguous; slot = page_id * page_size + offset
                       or [num_layers, num_pages, page_size, num_kv_heads, head_dim] with layers given
    layers:            int64 [m], the layers to move (those sharing one RoPE config), or None
    src_slots:         int64 [n], where each K/V is read
    dst_slots:         int64 [n], where it is written; disjoint from src_slots (the copies then need no order)
    deltas:            int64 [n], how many positions each moves (K at position p goes to p + deltas[i])
    inv_freq:          float32 [head_dim // 2], the layer's RoPE config (`ModelConfig.rope_for(layer).inv_freq`)
K was rotated by half-split RoPE at its old position; rotating it again by deltas[i] * inv_freq rotates it to the
new one (rotations compose). The rotation is computed in float32 and rounded once to the cache dtype,
(x1 * cos - x2 * sin, x2 * cos + x1 * sin), as rope_store rotates; V is copied bit for bit.
cos and sin come from `rope_cos_sin`, the engine's own for positions, so the kernel's rotation is the
reference's, bit for bit.
"""
import torch
import triton
import triton.language as tl

from chunkwise.kernels.rope_store import rope_cos_sin
from chunkwise.kernels.tiling import block_rows, cast, cdiv, check_float, next_power_of_2, num_warps_for


def _check(k_cache, v_cache, src_slots, dst_slots, deltas, inv_freq, layers=None):
    check_float("k_cache", k_cache)
    dims, what = (4, "[pages, page_size, kv_heads, head_dim]") if layers is None else \
        (5, "[layers, pages, page_size, kv_heads, head_dim] (layers given)")
    if (k_cache.dim() != dims or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache {v_cache.dtype} "
                         f"{tuple(v_cache.shape)} must be equal and contiguous {what}")
    if layers is not None and (layers.dtype != torch.int64 or layers.dim() != 1 or layers.device != k_cache.device):
        raise ValueError(f"layers must be int64 [m] on {k_cache.device}, got {layers.dtype} {tuple(layers.shape)} "
                         f"on {layers.device}")
    head_dim = k_cache.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for half-split RoPE")
    n = src_slots.shape[0] if src_slots.dim() == 1 else -1
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots), ("deltas", deltas)):
        if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64 [n] (n the length of src_slots), got {t.dtype} "
                             f"{tuple(t.shape)} against src_slots {tuple(src_slots.shape)}")
    if inv_freq.dtype != torch.float32 or inv_freq.shape != (head_dim // 2,) or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq must be contiguous float32 [{head_dim // 2}], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    for name, t in (("v_cache", v_cache), ("src_slots", src_slots), ("dst_slots", dst_slots), ("deltas", deltas),
                    ("inv_freq", inv_freq)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")


def relocate_kv_ref(k_cache, v_cache, src_slots, dst_slots, deltas, inv_freq, layers=None):
    """PyTorch twin of `relocate_kv`; unlike the kernel (which reads nothing back to the host) it also checks the
    slots' and layers' values: inside the cache, and src and dst disjoint."""
    _check(k_cache, v_cache, src_slots, dst_slots, deltas, inv_freq, layers)
    if layers is not None:
        ids = layers.tolist()
        if any(not 0 <= i < k_cache.shape[0] for i in ids):
            raise ValueError(f"layers must lie in [0, {k_cache.shape[0]}), got {ids}")
        for i in ids:
            relocate_kv_ref(k_cache[i], v_cache[i], src_slots, dst_slots, deltas, inv_freq)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.numel() and (slots.min() < 0 or slots.max() >= num_slots):
            raise ValueError(f"{name} must lie in [0, {num_slots}), got {slots.tolist()}")
    if torch.isin(dst_slots, src_slots).any():
        raise ValueError(f"dst_slots {dst_slots.tolist()} and src_slots {src_slots.tolist()} must be disjoint")
    k = k_cache.view(-1, *k_cache.shape[2:])
    v = v_cache.view(-1, *v_cache.shape[2:])
    cos, sin = rope_cos_sin(deltas, inv_freq)
    half = k.shape[-1] // 2
    x1, x2 = k[src_slots, :, :half].float(), k[src_slots, :, half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    k[dst_slots] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(k.dtype)
    v[dst_slots] = v[src_slots]


@triton.jit
def _relocate_kernel(
    k_cache_ptr,    # [num_slots, num_kv_heads, HEAD_DIM] contiguous (slot-major)
    v_cache_ptr,    # [num_slots, num_kv_heads, HEAD_DIM] contiguous
    src_ptr,        # int64 [n]
    dst_ptr,        # int64 [n]
    cos_ptr,        # float32 [n, HALF] contiguous
    sin_ptr,        # float32 [n, HALF] contiguous
    layers_ptr,     # int64 [m]: program_id(1)'s layer, if LAYERED (None otherwise)
    layer_stride,   # elements from one layer's cache to the next, if LAYERED
    n, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_I: tl.constexpr, HEADS_PAD: tl.constexpr, LAYERED: tl.constexpr,
):
    if LAYERED:
        base = tl.load(layers_ptr + tl.program_id(1)) * layer_stride   # int64: a cache may pass 2**31 elements
        k_cache_ptr += base
        v_cache_ptr += base
    # Rows = (item, kv head) pairs of BLOCK_I items, columns = the first half of head_dim; the second half is
    # the same tile shifted by HALF. K and V rows share the addresses (the caches have one layout).
    r = tl.arange(0, BLOCK_I * HEADS_PAD)[:, None]
    item = tl.program_id(0) * BLOCK_I + r // HEADS_PAD
    head = r % HEADS_PAD
    c = tl.arange(0, HALF_PAD)[None, :]
    ok = (item < n) & (head < num_kv_heads) & (c < HALF)
    src = tl.load(src_ptr + item, mask=item < n, other=0)
    dst = tl.load(dst_ptr + item, mask=item < n, other=0)
    col = head * HEAD_DIM + c
    src_off = src * (num_kv_heads * HEAD_DIM) + col
    dst_off = dst * (num_kv_heads * HEAD_DIM) + col

    x1 = tl.load(k_cache_ptr + src_off, mask=ok, other=0.0)
    x2 = tl.load(k_cache_ptr + src_off + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    cs = item.to(tl.int64) * HALF + c
    cos = tl.load(cos_ptr + cs, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + cs, mask=ok, other=0.0)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(k_cache_ptr + dst_off, cast(x1 * cos - x2 * sin, dtype), mask=ok)
    tl.store(k_cache_ptr + dst_off + HALF, cast(x2 * cos + x1 * sin, dtype), mask=ok)

    tl.store(v_cache_ptr + dst_off, tl.load(v_cache_ptr + src_off, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst_off + HALF, tl.load(v_cache_ptr + src_off + HALF, mask=ok), mask=ok)


def relocate_kv(k_cache, v_cache, src_slots, dst_slots, deltas, inv_freq, layers=None):
    """For each i: K[dst_slots[i]] = K[src_slots[i]] rotated by deltas[i] * inv_freq, V[dst_slots[i]] =
    V[src_slots[i]], in one kernel launch (after the float32 cos/sin of the angles), in one layer's cache or, with
    `layers`, in each of those layers of stacked caches (a launch each would cost more host time than the copies
    take). The slots' and layers' values are the caller's to keep inside the cache and the slots disjoint
    (checking them would read them back to the host)."""
    _check(k_cache, v_cache, src_slots, dst_slots, deltas, inv_freq, layers)
    n = src_slots.shape[0]
    if n == 0 or (layers is not None and layers.shape[0] == 0):
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    half = head_dim // 2
    half_pad = next_power_of_2(half)
    heads_pad = next_power_of_2(num_kv_heads)
    cos, sin = rope_cos_sin(deltas, inv_freq)
    block_i = block_rows(heads_pad * 2 * half_pad, k_cache.device)
    _relocate_kernel[(cdiv(n, block_i), 1 if layers is None else layers.shape[0])](
        k_cache, v_cache, src_slots, dst_slots, cos, sin, layers, k_cache.stride(0) if layers is not None else 0,
        n, num_kv_heads,
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, BLOCK_I=block_i, HEADS_PAD=heads_pad,
        LAYERED=layers is not None,
        num_warps=num_warps_for(block_i * heads_pad * half_pad), enable_fp_fusion=False,
    )
