"""How many rows one program of a row-wise kernel (norms, RoPE, activations) takes, per device.

GPU: one row per program, so a decode batch of a few hundred rows still spreads over every SM. Triton's CPU
interpreter: every program costs milliseconds of Python, so a program takes as many rows as fit a tile numpy
handles without strain. Either way the count depends only on the row width and the device, never on the
number of rows, so a row's result does not depend on its batch-mates.
"""
import torch
import triton

_INTERPRETER_TILE_ELEMENTS = 65536


def block_rows(row_elements: int, device) -> int:
    """Rows per program (a power of two) for rows of `row_elements` padded elements on `device`."""
    if torch.device(device).type == "cuda":
        return 1
    return max(1, triton.next_power_of_2(_INTERPRETER_TILE_ELEMENTS // row_elements + 1) // 2)


def num_warps_for(tile_elements: int) -> int:
    """Warps for a memory-bound tile: about 8 elements per thread, 1 to 8 warps."""
    return min(8, max(1, tile_elements // 256))


def check_float(name: str, t: torch.Tensor):
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
