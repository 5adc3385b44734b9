"""A batch-invariant matmul: out = x @ w.T, where a row's result never depends on how many rows there are.

Layouts:
    x:    [M, K], row-major (the activations; M = tokens of the step, any number)
    w:    [N, K], row-major (a Linear weight as HF stores it)
    out:  [M, N], row-major, x's dtype; accumulated in float32, rounded once
There is no split-K, and every program folds its K tiles in increasing order, each tile's product accumulating
into the output's float32 registers. So each output element is the same chain of MMA steps (K in steps of 16 for
16-bit floats) whatever M is, and a token's projection is bitwise the same in a 1-row decode step and a 512-row
prefill chunk. cuBLAS and the CPU BLAS pick their kernel (and with it the reduction order, split-K included) by
M, which is why the engine's deterministic mode uses this instead.

The tile shape may grow with M on Hopper (`matmul_config`): larger tiles for steps that fill the GPU with them.
Only tiles that keep that chain are chosen: at least 64 rows and 4 warps, so that every one lowers to the same
warpgroup MMA (wgmma). Measured on an H200 (bf16, Qwen3-0.6B's five weights, 1 to 8192 rows): 14 tile shapes from
64x32 to 256x128, K tiles of 64 and 128, 4 and 8 warps, 3 and 4 stages gave every output bitwise alike
(tests/test_deterministic_gpu.py checks the chosen ones). M is not specialised by Triton (`do_not_specialize`),
so within a tile shape any row count runs the very same compiled code.
"""
import torch
import triton
import triton.language as tl

from chunkwise.kernels.tiling import cast, capability, cdiv, check_float, dot, INTERPRET, precision_for, sm_count


def matmul_ref(x, w):
    """PyTorch twin of `matmul`: float32 products and sums, rounded once to x's dtype."""
    _check(x, w)
    return (x.float() @ w.float().t()).to(x.dtype)


# Tiles for steps of at least 128 rows, largest first, each taken when it alone gives every SM a program
# (measured: docs/BENCHMARKS.md, "Behind the code: WIDE_TILES").
WIDE_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3))


def matmul_config(n: int, k: int, dtype: torch.dtype, device, m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for x [m, k] @ w [n, k].T.

    GPU: below 128 rows (decode steps), 64 rows per tile (one Hopper warpgroup MMA) and narrow column tiles for
    narrow weights (o_proj, down_proj), so that even a decode step spreads its weight reads over a few dozen SMs.
    From 128 rows on Hopper, the largest of WIDE_TILES that still gives each SM a program. All of them keep a row's
    bits there (module docstring); elsewhere (mma.sync, not measured) the tile stays the weight's. float32 keeps
    one tile per weight: its TF32-free dots were not measured across tiles. The interpreter: big tiles, since
    every program costs milliseconds of Python.
    """
    if torch.device(device).type != "cuda":
        return 64, 256, 64, 4, 1
    block_n = 128 if n >= 16384 else 64 if n >= 4096 else 32
    if dtype == torch.float32:
        return 64, block_n, 32, 4, 3
    if m >= 128 and capability(device)[0] == 9:   # the tiles' bits were measured alike on Hopper only
        for tile in WIDE_TILES:
            if cdiv(m, tile[0]) * cdiv(n, tile[1]) >= sm_count(device):
                return tile
    return 64, block_n, 64, 4, 4


def config_changes(n: int, k: int, dtype: torch.dtype, device, max_m: int) -> list[int]:
    """The row counts up to max_m at which `matmul_config` takes another tile (1 first): one matmul of each compiles
    every variant that row counts up to max_m use (a warm-up's). Read off matmul_config itself, row count by row
    count, so the two cannot disagree."""
    rows, last = [], None
    for m in range(1, max_m + 1):
        config = matmul_config(n, k, dtype, device, m)
        if config != last:
            rows.append(m)
            last = config
    return rows


def _check(x, w):
    check_float("x", x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w ({w.dtype}, {w.device}) must match x ({x.dtype}, {x.device})")
    if not w.is_contiguous():
        raise ValueError("w must be contiguous [N, K]")


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in float32. GPU: the MMA accumulates in place. Interpreter: the row-stable `dot`."""
    if INTERPRET:
        acc = acc + dot(a, b, PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,      # [M, K] row-major
    w_ptr,      # [N, K] row-major
    out_ptr,    # [M, N] row-major
    M,          # rows: a runtime value the compiled code never depends on
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):   # K tiles in increasing order, the same for every row
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = _mma(a, b, acc, PRECISION)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], cast(acc, out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def matmul(x, w, out=None):
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype, each row's bits independent of M (see the module doc)."""
    _check(x, w)
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = matmul_config(n, k, x.dtype, x.device, m)
    grid = (cdiv(n, block_n), cdiv(m, block_m))
    _matmul_kernel[grid](x, w, out, m, N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         PRECISION=precision_for(x.dtype), num_warps=num_warps, num_stages=num_stages)
    return out
