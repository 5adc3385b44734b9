"""RMSNorm over the last dim, with the residual add (and Gemma's sandwich pre-norm) folded in.

Layouts:
    x, residual, out, residual_out:  [num_rows, hidden], contiguous
    weight, pre_weight:              [hidden]

    rms_norm(x)                           -> norm(x)
    add_rms_norm(x, residual)             -> (norm(s), s)         with s = x + residual, rounded to x's dtype
    add_rms_norm(x, residual, pre_weight) -> (norm(s), s)         with s = norm_pre(x) + residual (Gemma 3: the
                                                                  post-attention/post-FF norm of a sublayer's
                                                                  output, added to the stream, then the next norm)
norm(x) is computed in float32 and rounded as the models do: Llama-style `w * norm(x).to(dtype)` (the product
in the dtype), Gemma-style `(norm(x) * (1 + w.float())).to(dtype)`. Every rounding point of the unfused
PyTorch ops is kept, so only the order of the sum of squares differs (float32 either way).
"""
import torch
import triton
import triton.language as tl

from chunkwise.kernels.tiling import block_rows, cast, cdiv, check_float, next_power_of_2, num_warps_for


def _norm_ref(x, weight, eps, plus_one):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def rms_norm_ref(x, weight, eps, plus_one, out=None):
    """PyTorch twin of `rms_norm`."""
    _check(x, weight)
    y = _norm_ref(x, weight, eps, plus_one)
    return y if out is None else out.copy_(y)


def add_rms_norm_ref(x, residual, weight, eps, plus_one, pre_weight=None, out=None, residual_out=None):
    """PyTorch twin of `add_rms_norm`."""
    _check(x, weight, residual, pre_weight)
    s = (x if pre_weight is None else _norm_ref(x, pre_weight, eps, plus_one)) + residual
    y = _norm_ref(s, weight, eps, plus_one)
    if out is not None:
        y, s = out.copy_(y), residual_out.copy_(s)
    return y, s


@triton.jit
def weigh(xn, w, PLUS_ONE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Normalized rows xn [R, C] float32 times the weight w ([1, C] or [R, C], any dtype), rounded to OUT_DTYPE
    at the models' rounding points. Also used by the q/k-norm of `rope_store`."""
    if PLUS_ONE:
        return cast(xn * (1.0 + w.to(tl.float32)), OUT_DTYPE)
    # Llama: round to the dtype first, then the product in the dtype (exact in float32, rounded once).
    return cast(cast(xn, OUT_DTYPE).to(tl.float32) * w.to(tl.float32), OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,             # [num_rows, hidden] contiguous
    res_ptr,           # [num_rows, hidden] contiguous, read if HAS_RES
    w_ptr,             # [hidden]
    pre_w_ptr,         # [hidden], read if HAS_PRE
    out_ptr,           # [num_rows, hidden] contiguous
    res_out_ptr,       # [num_rows, hidden] contiguous, written if HAS_RES
    num_rows, hidden, eps,
    HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr, PLUS_ONE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Few ops and one offset tensor for all four arrays: under the interpreter every op costs about a millisecond.
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_N)[None, :]
    col_ok = col < hidden
    mask = (row < num_rows) & col_ok
    offs = row.to(tl.int64) * hidden + col
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / hidden + eps)
        x = weigh(x * inv_rms, tl.load(pre_w_ptr + col, mask=col_ok), PLUS_ONE, dtype).to(tl.float32)
    if HAS_RES:
        x = add_residual(x, res_ptr, res_out_ptr, offs, mask)
    store_norm(x, w_ptr, out_ptr, offs, mask, col, col_ok, hidden, eps, PLUS_ONE)


@triton.jit
def add_residual(x, res_ptr, res_out_ptr, offs, mask):
    """x [R, C] float32 plus the residual at offs, rounded to res_out's dtype and stored there; returned in float32.
    Also the tail of the all-reduce's NORM (chunkwise/kernels/all_reduce.py), which must round as this kernel does."""
    s = cast(x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32), res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offs, s, mask=mask)
    return s.to(tl.float32)


@triton.jit
def store_norm(x, w_ptr, out_ptr, offs, mask, col, col_ok, hidden, eps, PLUS_ONE: tl.constexpr):
    """RMSNorm of the float32 rows x [R, C] (C masked to hidden by col_ok) times the weight, stored at offs."""
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / hidden + eps)
    tl.store(out_ptr + offs, weigh(x * inv_rms, tl.load(w_ptr + col, mask=col_ok), PLUS_ONE,
                                   out_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, residual=None, pre_weight=None, out=None, residual_out=None):
    check_float("x", x)
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [rows, hidden], got shape {tuple(x.shape)} strides {x.stride()}")
    hidden = x.shape[1]
    for name, w in (("weight", weight), ("pre_weight", pre_weight)):
        if w is not None and (w.shape != (hidden,) or w.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous [{hidden}], got {tuple(w.shape)}")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous {x.dtype} {tuple(x.shape)} like x, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")


def _launch(x, weight, eps, plus_one, residual, pre_weight, out, residual_out):
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block_n = next_power_of_2(hidden)
    block_r = block_rows(block_n, x.device)
    res, res_out = (residual, residual_out) if residual is not None else (x, out)  # unread, unwritten
    _rms_norm_kernel[(cdiv(num_rows, block_r),)](
        x, res, weight, pre_weight if pre_weight is not None else weight, out, res_out,
        num_rows, hidden, eps,
        HAS_RES=residual is not None, HAS_PRE=pre_weight is not None, PLUS_ONE=plus_one,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps_for(block_r * block_n), enable_fp_fusion=False,
    )


def rms_norm(x, weight, eps, plus_one, out=None):
    """RMSNorm of each row of x [rows, hidden] into `out` (new if None); see the module docstring."""
    _check(x, weight, out=out)
    out = torch.empty_like(x) if out is None else out
    _launch(x, weight, eps, plus_one, None, None, out, None)
    return out


def add_rms_norm(x, residual, weight, eps, plus_one, pre_weight=None, out=None, residual_out=None):
    """(norm(s), s) with s = x + residual, or s = norm_pre(x) + residual when pre_weight is given.

    Writes into `out` and `residual_out` (new tensors if None); x and residual are only read.
    """
    _check(x, weight, residual, pre_weight, out, residual_out)
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _launch(x, weight, eps, plus_one, residual, pre_weight, out, residual_out)
    return out, residual_out
