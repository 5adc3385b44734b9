"""What differs between the GPU and Triton's CPU interpreter, for every kernel: rows per program, dots, casts.

Rows per program of a row-wise kernel (norms, RoPE, activations):

GPU: one row per program, so a decode batch of a few hundred rows still spreads over every SM. Triton's CPU
interpreter: every program costs milliseconds of Python, so a program takes as many rows as fit a tile numpy
handles without strain. Either way the count depends only on the row width and the device, never on the
number of rows, so a row's result does not depend on its batch-mates.
"""
import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETER_TILE_ELEMENTS = 65536


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), for host code: newer Triton makes `triton.cdiv` a constexpr function, whose argument
    unwrapping costs microseconds a call, and the wrappers run several per launch of every eager step."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n < 1), for host code (see cdiv)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere)."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def shared_memory(device) -> int:
    """Bytes of shared memory a block may opt into on a CUDA device (0 elsewhere, or where torch does not say)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


@functools.lru_cache(maxsize=None)
def capability(device) -> tuple[int, int]:
    """A CUDA device's compute capability ((9, 0) for Hopper); (0, 0) elsewhere."""
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def block_rows(row_elements: int, device) -> int:
    """Rows per program (a power of two) for rows of `row_elements` padded elements on `device`."""
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cuda":
        return 1
    return max(1, next_power_of_2(_INTERPRETER_TILE_ELEMENTS // row_elements + 1) // 2)


def num_warps_for(tile_elements: int) -> int:
    """Warps for a memory-bound tile: about 8 elements per thread, 1 to 8 warps."""
    return min(8, max(1, tile_elements // 256))


def check_float(name: str, t: torch.Tensor):
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


# Triton's CPU interpreter, read once at import as Triton reads it (kernels/__init__ sets it first). There
# `tl.dot` is the host BLAS's matmul, whose rounding of a row can depend on the row's place in the tile
# (OpenBLAS's Haswell kernel does), and bfloat16 is raw uint16 bits that arithmetic and `.to` get wrong.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


def precision_for(dtype):
    """fp32 inputs get IEEE dots (the strict tier must not be TF32); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] -> float32 [M, N]. GPU: tl.dot. Interpreter: every product in float32 (bf16 and fp16
    operands upcast exactly) and each output element reduced by numpy alone, so a row's result depends on that
    row's values only, never on its place in the tile, the tile's height or on the host BLAS."""
    if INTERPRET:
        a = a.to(tl.float32)
        bt = tl.trans(b.to(tl.float32))  # [N, K]: the products' reduction runs along numpy's contiguous axis
        # Even and odd k apart, at every size: the [M, N, K] products of 128-wide 16-bit tiles would pass Triton's
        # cap on a tensor's elements (2**20), and splitting only the large ones would sum a row otherwise in a
        # taller tile than in a shorter one.
        a0, a1 = tl.split(tl.reshape(a, [a.shape[0], a.shape[1] // 2, 2]))
        b0, b1 = tl.split(tl.reshape(bt, [bt.shape[0], bt.shape[1] // 2, 2]))
        c = tl.sum(a0[:, None, :] * b0[None, :, :], 2) + tl.sum(a1[:, None, :] * b1[None, :, :], 2)
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does. The interpreter truncates float -> bfloat16, so
    there the rounding is done on the float32 bits (NaN stays NaN)."""
    if INTERPRET:
        if dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
            x32 = x.to(tl.float32)
            bits = x32.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(x32 != x32, 0x7FC0, bits)
            y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y
