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
Rounding: the bias add and the q/k-norm round to the dtype as the unfused ops do; RoPE is computed in float32
and rounded once (x1 * cos - x2 * sin, x2 * cos + x1 * sin), which in float32 is what the unfused ops compute.
"""
import torch
import triton
import triton.language as tl

from kernels.fused_norm import weigh
from kernels.tiling import block_rows, check_float, num_warps_for


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
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x = (xf * (1.0 + weight.float())).to(x.dtype) if plus_one else weight * xf.to(x.dtype)
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
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep].to(v_cache.dtype)
    return q if q_out is None else q_out.copy_(q)


@triton.jit
def _load_heads(qkv_ptr, bias_ptr, token, head, c, mask, stride_t, col0,
                HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Both halves [R, HALF_PAD] of the heads `head` [R, 1] of tokens `token` [R, 1], starting at qkv column
    col0, plus the bias if any, in qkv's dtype."""
    col = col0 + head * HEAD_DIM + c
    x1 = tl.load(qkv_ptr + token * stride_t + col, mask=mask, other=0.0)
    x2 = tl.load(qkv_ptr + token * stride_t + col + HALF, mask=mask, other=0.0)
    if HAS_BIAS:
        dtype = x1.dtype
        x1 = (x1.to(tl.float32) + tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        x2 = (x2.to(tl.float32) + tl.load(bias_ptr + col + HALF, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    return x1, x2


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos_ptr, sin_ptr, token, c, mask, eps,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, PLUS_ONE: tl.constexpr):
    """Halves [R, HALF_PAD] (qkv dtype) of the rows of tokens `token` [R, 1] at columns c [HALF_PAD] ->
    q/k-normed (if HAS_NORM) and rotated halves in float32."""
    dtype = x1.dtype
    c_ok = c < HALF
    if HAS_NORM:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)  # 0 where ~mask
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        x1 = weigh(x1 * inv_rms, tl.load(w_ptr + c, mask=c_ok, other=0.0), PLUS_ONE, dtype)
        x2 = weigh(x2 * inv_rms, tl.load(w_ptr + HALF + c, mask=c_ok, other=0.0), PLUS_ONE, dtype)
    cos = tl.load(cos_ptr + token * HALF + c[None, :], mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * HALF + c[None, :], mask=mask, other=0.0)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_store_kernel(
    qkv_ptr,        # [num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM]
    bias_ptr,       # [(num_heads + 2 * num_kv_heads) * HEAD_DIM], read if HAS_BIAS
    q_norm_ptr,     # [HEAD_DIM], read if HAS_NORM
    k_norm_ptr,     # [HEAD_DIM], read if HAS_NORM
    cos_ptr,        # float32 [num_tokens, HALF] contiguous
    sin_ptr,        # float32 [num_tokens, HALF] contiguous
    slot_ptr,       # int64 [num_tokens]
    q_out_ptr,      # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,    # [num_pages, page_size, num_kv_heads, HEAD_DIM]
    v_cache_ptr,    # [num_pages, page_size, num_kv_heads, HEAD_DIM]
    num_tokens, num_heads, num_kv_heads, page_size, eps,
    stride_t, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, H_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, PLUS_ONE: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    c = tl.arange(0, HALF_PAD)
    c_ok = c < HALF

    # q: rows are (token, head) pairs, BLOCK_T tokens x H_PAD heads.
    r = tl.arange(0, BLOCK_T * H_PAD)
    token = (t0 + r // H_PAD).to(tl.int64)[:, None]
    head = (r % H_PAD)[:, None]
    mask = (token < num_tokens) & (head < num_heads) & c_ok[None, :]
    x1, x2 = _load_heads(qkv_ptr, bias_ptr, token, head, c[None, :], mask, stride_t, 0, HEAD_DIM, HALF, HAS_BIAS)
    y1, y2 = _norm_rope(x1, x2, q_norm_ptr, cos_ptr, sin_ptr, token, c, mask, eps,
                        HEAD_DIM, HALF, HAS_NORM, PLUS_ONE)
    q_dst = q_out_ptr + token * stride_qt + head * stride_qh + c[None, :]
    tl.store(q_dst, y1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(q_dst + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=mask)

    # k and v: rows are (token, kv head) pairs; tokens with slot -1 (padding) and past num_tokens store nothing.
    r = tl.arange(0, BLOCK_T * KV_PAD)
    token = (t0 + r // KV_PAD).to(tl.int64)[:, None]
    head = (r % KV_PAD)[:, None]
    slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1)
    mask = (slot >= 0) & (head < num_kv_heads) & c_ok[None, :]
    page, offset = slot // page_size, slot % page_size
    k_col0 = num_heads * HEAD_DIM
    x1, x2 = _load_heads(qkv_ptr, bias_ptr, token, head, c[None, :], mask, stride_t, k_col0,
                         HEAD_DIM, HALF, HAS_BIAS)
    y1, y2 = _norm_rope(x1, x2, k_norm_ptr, cos_ptr, sin_ptr, token, c, mask, eps,
                        HEAD_DIM, HALF, HAS_NORM, PLUS_ONE)
    k_dst = k_cache_ptr + page * stride_kp + offset * stride_ks + head * stride_kh + c[None, :]
    tl.store(k_dst, y1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v1, v2 = _load_heads(qkv_ptr, bias_ptr, token, head, c[None, :], mask, stride_t,
                         k_col0 + num_kv_heads * HEAD_DIM, HEAD_DIM, HALF, HAS_BIAS)
    v_dst = v_cache_ptr + page * stride_vp + offset * stride_vs + head * stride_vh + c[None, :]
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(qkv, qkv_bias, q_norm, k_norm, cos, sin, slot_mapping, k_cache, v_cache, q_out):
    """The argument checks of `rope_store` and its reference; returns num_heads."""
    check_float("qkv", qkv)
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal "
                         f"[pages, page_size, kv_heads, head_dim] with head_dim contiguous")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for half-split RoPE")
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] % head_dim or qkv.shape[1] // head_dim <= 2 * num_kv_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [tokens, (heads + 2 * {num_kv_heads}) * {head_dim}] "
                         f"with the last dim contiguous")
    num_tokens, width = qkv.shape
    num_heads = width // head_dim - 2 * num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if qkv_bias is not None and (qkv_bias.shape != (width,) or qkv_bias.stride(0) != 1):
        raise ValueError(f"qkv_bias must be contiguous [{width}], got {tuple(qkv_bias.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together (q/k-norm) or both None")
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
                              or q_out.stride(2) != 1):
        raise ValueError(f"q_out must be {qkv.dtype} [{num_tokens}, {num_heads}, {head_dim}] with head_dim "
                         f"contiguous, got {q_out.dtype} {tuple(q_out.shape)}")
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
    half_pad = triton.next_power_of_2(half)
    h_pad, kv_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    block_t = block_rows((h_pad + 2 * kv_pad) * 2 * half_pad, qkv.device)
    _rope_store_kernel[(triton.cdiv(num_tokens, block_t),)](
        qkv, qkv_bias if qkv_bias is not None else qkv, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, cos, sin, slot_mapping, q_out, k_cache, v_cache,
        num_tokens, num_heads, num_kv_heads, k_cache.shape[1], eps,
        qkv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, BLOCK_T=block_t, H_PAD=h_pad, KV_PAD=kv_pad,
        HAS_BIAS=qkv_bias is not None, HAS_NORM=q_norm is not None, PLUS_ONE=plus_one,
        num_warps=num_warps_for(block_t * h_pad * 2 * half_pad), enable_fp_fusion=False,
    )
    return q_out
