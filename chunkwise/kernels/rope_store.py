"""From the fused QKV projection to attention's inputs in one kernel: the optional q/k bias and q/k-norm,
half-split RoPE on q and k, the rotated q written out and the new K/V stored into the paged cache.

Layouts:
    qkv:               [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q heads, k heads, v heads
    qkv_bias:          [(num_heads + 2 * num_kv_heads) * head_dim] or None
    q_norm, k_norm:    [head_dim] or None (Qwen3, Gemma 3: RMSNorm over head_dim of each head)
    cos, sin:          float32 [num_tokens, head_dim // 2]: RoPE of each token's position
    slot_mapping:      int64 [num_tokens]; slot = page_id * page_size + offset; -1 skips the token's K/V
    q_out:             [num_tokens, num_heads, head_dim]
    k_cache, v_cache:  [num_pages, page_size, num_kv_heads, head_dim]
(every tensor contiguous)
Rounding: the bias add and the q/k-norm round to the dtype as the unfused ops do; RoPE is computed in float32
and rounded once (x1 * cos - x2 * sin, x2 * cos + x1 * sin), which in float32 is what the unfused ops compute.
"""
import torch
import triton
import triton.language as tl

from chunkwise.kernels.fused_norm import _norm_ref, weigh
from chunkwise.kernels.tiling import block_rows, cast, cdiv, check_float, next_power_of_2, num_warps_for


def rope_cos_sin(positions, inv_freq):
    """cos, sin float32 [num_tokens, head_dim // 2] for int positions [num_tokens] and inv_freq [head_dim // 2]."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return freqs.cos(), freqs.sin()


def _split(qkv, num_heads, num_kv_heads, head_dim):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return (q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
            v.reshape(t, num_kv_heads, head_dim))


def _norm_rope_ref(x, weight, cos, sin, eps, plus_one):
    if weight is not None:
        x = _norm_ref(x, weight, eps, plus_one)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_store_ref(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, eps, plus_one,
                   q_out=None):
    """PyTorch twin of `rope_store`."""
    num_heads = _check(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, q_out)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias
    q, k, v = _split(qkv, num_heads, k_cache.shape[2], k_cache.shape[3])
    q = _norm_rope_ref(q, q_norm, cos, sin, eps, plus_one)
    k = _norm_rope_ref(k, k_norm, cos, sin, eps, plus_one)
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]
    return q if q_out is None else q_out.copy_(q)


@triton.jit
def _rope_store_kernel(
    qkv_ptr,        # [num_tokens, NUM_HEADS * HEAD_DIM] contiguous, NUM_HEADS = num_q_heads + 2 * num_kv_heads
    bias_ptr,       # [NUM_HEADS * HEAD_DIM], read if HAS_BIAS
    q_norm_ptr,     # [HEAD_DIM], read if HAS_NORM
    k_norm_ptr,     # [HEAD_DIM], read if HAS_NORM
    cos_ptr,        # float32 [num_tokens, HALF] contiguous
    sin_ptr,        # float32 [num_tokens, HALF] contiguous
    slot_ptr,       # int64 [num_tokens]
    q_out_ptr,      # [num_tokens, num_q_heads, HEAD_DIM] contiguous
    k_cache_ptr,    # [num_pages * page_size, num_kv_heads, HEAD_DIM] contiguous (slot-major)
    v_cache_ptr,    # [num_pages * page_size, num_kv_heads, HEAD_DIM] contiguous
    num_tokens, num_q_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NUM_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr, HEADS_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, PLUS_ONE: tl.constexpr,
):
    # One tile of rows = (token, head) pairs over every head of qkv (q heads, then k, then v) of BLOCK_T tokens,
    # columns = the first half of head_dim; the second half is the same tile shifted by HALF. q, k and v share
    # the loads and the math (v rows skip norm and rotation): under the interpreter every op costs ~1 ms.
    r = tl.arange(0, BLOCK_T * HEADS_PAD)[:, None]
    token = tl.program_id(0) * BLOCK_T + r // HEADS_PAD
    head = r % HEADS_PAD
    c = tl.arange(0, HALF_PAD)[None, :]
    is_q = head < num_q_heads
    kv_head = head - num_q_heads                     # k heads: 0..num_kv_heads-1, v heads: num_kv_heads..
    is_v = kv_head >= num_kv_heads
    slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1)
    # q of every token; K/V only of tokens with a slot (-1 is padding, as are the rows past num_tokens).
    ok = (token < num_tokens) & (head < NUM_HEADS) & (is_q | (slot >= 0)) & (c < HALF)
    col = head * HEAD_DIM + c
    src = qkv_ptr + token.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + col
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    if HAS_BIAS:
        x1 = cast(x1.to(tl.float32) + tl.load(bias_ptr + col, mask=ok).to(tl.float32), dtype)
        x2 = cast(x2.to(tl.float32) + tl.load(bias_ptr + col + HALF, mask=ok).to(tl.float32), dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)  # 0 where ~ok
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1, keep_dims=True) + tl.sum(x2 * x2, axis=1, keep_dims=True)
        inv_rms = tl.rsqrt(ss / HEAD_DIM + eps)
        w_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr) + c
        x1 = tl.where(is_v, x1, weigh(x1 * inv_rms, tl.load(w_ptr, mask=ok), PLUS_ONE, dtype).to(tl.float32))
        x2 = tl.where(is_v, x2, weigh(x2 * inv_rms, tl.load(w_ptr + HALF, mask=ok), PLUS_ONE, dtype).to(tl.float32))
    cs = token.to(tl.int64) * HALF + c
    cos = tl.load(cos_ptr + cs, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + cs, mask=ok, other=0.0)
    y1 = cast(tl.where(is_v, x1, x1 * cos - x2 * sin), dtype)
    y2 = cast(tl.where(is_v, x2, x2 * cos + x1 * sin), dtype)

    q_dst = q_out_ptr + token.to(tl.int64) * (num_q_heads * HEAD_DIM) + col
    tl.store(q_dst, y1, mask=ok & is_q)
    tl.store(q_dst + HALF, y2, mask=ok & is_q)
    # The slot indexes the cache's flattened [pages * page_size] dim directly; v heads share k's offsets.
    kv = slot * (num_kv_heads * HEAD_DIM) + tl.where(is_v, kv_head - num_kv_heads, kv_head) * HEAD_DIM + c
    is_k = ok & ~is_q & ~is_v
    tl.store(k_cache_ptr + kv, y1, mask=is_k)
    tl.store(k_cache_ptr + kv + HALF, y2, mask=is_k)
    tl.store(v_cache_ptr + kv, y1, mask=ok & is_v)
    tl.store(v_cache_ptr + kv + HALF, y2, mask=ok & is_v)


def _check(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, q_out):
    """The argument checks of `rope_store` and its reference; returns num_heads."""
    check_float("qkv", qkv)
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal and "
                         f"contiguous [pages, page_size, kv_heads, head_dim]")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must have qkv's dtype {qkv.dtype}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for half-split RoPE")
    if (qkv.dim() != 2 or not qkv.is_contiguous() or qkv.shape[1] % head_dim
            or qkv.shape[1] // head_dim <= 2 * num_kv_heads):
        raise ValueError(f"qkv {tuple(qkv.shape)} must be contiguous [tokens, (heads + 2 * {num_kv_heads}) * "
                         f"{head_dim}]")
    num_tokens, width = qkv.shape
    num_heads = width // head_dim - 2 * num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if qkv_bias is not None and (qkv_bias.shape != (width,) or qkv_bias.stride(0) != 1):
        raise ValueError(f"qkv_bias must be contiguous [{width}], got {tuple(qkv_bias.shape)}")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and q_norm.dtype != k_norm.dtype):
        raise ValueError("q_norm and k_norm must be given together (q/k-norm), of one dtype, or both None")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous [{head_dim}], got {tuple(w.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (num_tokens, head_dim // 2) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{num_tokens}, {head_dim // 2}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if q_out is not None and (q_out.shape != (num_tokens, num_heads, head_dim) or q_out.dtype != qkv.dtype
                              or not q_out.is_contiguous()):
        raise ValueError(f"q_out must be contiguous {qkv.dtype} [{num_tokens}, {num_heads}, {head_dim}], got "
                         f"{q_out.dtype} {tuple(q_out.shape)}")
    return num_heads


def rope_store(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, eps, plus_one,
               q_out=None):
    """Rotated q [num_tokens, num_heads, head_dim] (into q_out, new if None); K/V stored into the caches.

    q_norm/k_norm use the models' RMSNorm convention: `plus_one` for Gemma's (1 + w), eps the model's.
    """
    num_heads = _check(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, q_out)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    if q_out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    half_pad = next_power_of_2(half)
    heads_pad = next_power_of_2(num_heads + 2 * num_kv_heads)
    block_t = block_rows(heads_pad * 2 * half_pad, qkv.device)
    _rope_store_kernel[(cdiv(num_tokens, block_t),)](
        qkv, qkv_bias if qkv_bias is not None else qkv, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, cos, sin, slot_mapping, q_out, k_cache, v_cache,
        num_tokens, num_heads, num_kv_heads, eps,
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, NUM_HEADS=num_heads + 2 * num_kv_heads,
        BLOCK_T=block_t, HEADS_PAD=heads_pad,
        HAS_BIAS=qkv_bias is not None, HAS_NORM=q_norm is not None, PLUS_ONE=plus_one,
        num_warps=num_warps_for(block_t * heads_pad * half_pad), enable_fp_fusion=False,
    )
    return q_out
