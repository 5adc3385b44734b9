"""The gated MLP's activation over the fused gate_up projection: act(gate) * up, in one pass.

Layouts:
    gate_up:  [num_tokens, 2 * intermediate] (gate columns first, then up; the last dim contiguous)
    out:      [num_tokens, intermediate]
act is "silu" (Llama, Mistral, Qwen) or "gelu_pytorch_tanh" (Gemma). Rounding as the unfused ops: act(gate)
is computed in float32 and rounded to the dtype, then the product with up in the dtype (exact in float32,
rounded once).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from chunkwise.kernels.tiling import block_rows, cast, cdiv, check_float, next_power_of_2, num_warps_for

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_GPU_BLOCK_COLS = 1024


def act_and_mul_ref(gate_up, act, out=None):
    """PyTorch twin of `act_and_mul`."""
    _check(gate_up, act, out)
    gate, up = gate_up.chunk(2, dim=-1)
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return a * up if out is None else torch.mul(a, up, out=out)


@triton.jit
def _act_and_mul_kernel(
    gate_up_ptr,    # [num_tokens, 2 * inter]
    out_ptr,        # [num_tokens, inter]
    num_tokens, inter, stride_g, stride_o,
    GELU_TANH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    col = (tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I))[None, :]
    mask = (row < num_tokens) & (col < inter)
    gate = tl.load(gate_up_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + inter + col, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3): no tanh needed.
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    else:
        z = gate
    # sigmoid(z) with exp of a non-positive argument only: no overflow to inf for z << 0.
    e = tl.exp(-tl.abs(z))
    a = gate * tl.where(z >= 0, 1.0, e) / (1.0 + e)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + col, cast(cast(a, dtype).to(tl.float32) * up, dtype), mask=mask)


def _check(gate_up, act, out):
    check_float("gate_up", gate_up)
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate] with the last dim contiguous, got shape "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    shape = (gate_up.shape[0], gate_up.shape[1] // 2)
    if out is not None and (out.shape != shape or out.dtype != gate_up.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be {gate_up.dtype} {shape} with the last dim contiguous, got {out.dtype} "
                         f"{tuple(out.shape)}")


def act_and_mul(gate_up, act, out=None):
    """act(gate) * up for gate_up [tokens, 2 * intermediate] -> [tokens, intermediate] (into out, new if None)."""
    _check(gate_up, act, out)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    if gate_up.device.type == "cuda":
        block_i = min(_GPU_BLOCK_COLS, next_power_of_2(inter))
    else:
        block_i = next_power_of_2(inter)
    block_t = block_rows(block_i, gate_up.device)
    grid = (cdiv(num_tokens, block_t), cdiv(inter, block_i))
    _act_and_mul_kernel[grid](
        gate_up, out, num_tokens, inter, gate_up.stride(0), out.stride(0),
        GELU_TANH=act == "gelu_pytorch_tanh", BLOCK_T=block_t, BLOCK_I=block_i,
        num_warps=num_warps_for(block_t * block_i), enable_fp_fusion=False,
    )
    return out
