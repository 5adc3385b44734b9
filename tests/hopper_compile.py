"""Compiles the attention kernels and the deterministic matmul for Hopper (sm_90) on a machine without a GPU, as
their launchers configure them there, and prints each one's shared memory; `test_kernels_compile.py` runs it in
its own process.

The CPU suite runs the kernels through Triton's interpreter, which never compiles them: a GPU-only mistake (a
tile that outgrows shared memory, code the compiler rejects) would otherwise first show on a GPU. Each launcher
is called on small CPU tensors with Hopper's shared memory and SM count assumed (227 KB a block, 132), its kernel
launch is
caught before anything runs, and the caught arguments (the launcher's tile config included) are compiled with
triton.compile for sm_90; each must fit Hopper's shared memory. That proves the kernels compile and fit, not
their numbers (the GPU tests do that).
Needs TRITON_INTERPRET=0 before Triton is imported, hence the separate process.
"""
import importlib
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from chunkwise.kernels import (cascade_decode, cascade_groups, cascade_item_size, matmul, paged_attention,  # noqa: E402
                               paged_decode, split_kv_decode)
from chunkwise.kernels.testing import paginate, query_start_loc, random_kv  # noqa: E402

MATMUL = importlib.import_module("chunkwise.kernels.matmul")   # the package re-exports the function of this name
HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_MEMORY = 227 * 1024
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int64: "*i64"}


LAUNCHES: list[tuple] = []   # (kernel, args, kwargs) of each launch caught


def _catch(self, *args, grid, warmup, **kwargs):
    """Stands in for JITFunction.run: records the launch and runs nothing (launchers read no result back)."""
    LAUNCHES.append((self, args, dict(kwargs)))


def compile_launch(fn, args, kwargs) -> dict:
    """Compiles one caught launch for sm_90: its kernel, launch options and shared memory in bytes."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound = dict(zip(fn.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        # Triton's launcher tells the compiler which pointers and integers are multiples of 16, as here: without
        # that the loads are not vectorised or pipelined through shared memory, which then reads a third of its
        # real use (the 64-row decode tiles: 48 KB against 144 KB measured on an H200).
        if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0 or (
                type(value) is int and value % 16 == 0 and not param.is_constexpr and not param.do_not_specialize):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if param.is_constexpr or value is None:   # Triton passes None as a constant, as for a constexpr
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            raise TypeError(f"{fn.__name__}: no signature type for {param.name}={value!r}")
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                              options=options)
    tiles = {k: bound[k] for k in ("BLOCK_M", "BLOCK_H", "BLOCK_N", "BLOCK_K", "EXPLICIT_POSITIONS",
                                   "SPLIT_TILES", "ONE_TOKEN", "SUM_BY_DOT") if k in bound}
    return dict(kernel=fn.__name__, shared=compiled.metadata.shared, **tiles, **options)


def _batch(heads, kv_heads, head_dim, dtype, lens, gen):
    cache = paginate([random_kv(n, kv_heads, head_dim, dtype, gen) for n in lens], 16, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, cache


def cases():
    """(name, launch): a few of the engines' Hopper configurations (a compile takes 2-60 s on a CPU, so not
    every dtype and shape): prefill attention's 256-row bf16 tiles, its 128-row tiles with explicit positions and
    the context split (as a blend's rows take them) and with the context split (as the engine's short steps take
    them), and the 256-row tiles with row sums by dot (deterministic mode's), one-token decodes' 64 rows and
    deterministic mode's 16, split-KV's largest (fp32 d256) and cascade's shared-split tiles."""
    gen = torch.Generator().manual_seed(0)
    q, c = _batch(16, 8, 128, torch.bfloat16, [600, 40], gen)
    yield "paged_attention bf16 16q/8kv d128", lambda: paged_attention(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, query_start_loc([1, 1]), 0.1)
    yield "paged_attention bf16 16q/8kv d128 explicit positions (a blend's rows)", lambda: paged_attention(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, query_start_loc([1, 1]), 0.1,
        positions=torch.tensor([300, 39]), split_size=2048, max_rows=128)
    yield "paged_attention bf16 16q/8kv d128 split context", lambda: paged_attention(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, query_start_loc([1, 1]), 0.1, split_size=512,
        max_rows=128)
    yield "paged_attention bf16 16q/8kv d128 row sums by dot (deterministic prefill)", lambda: paged_attention(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, query_start_loc([1, 1]), 0.1, sum_by_dot=True)
    yield "paged_decode bf16 16q/8kv d128", lambda: paged_decode(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, 0.1, max_rows=64)
    yield "paged_decode bf16 16q/8kv d128 row sums by dot (deterministic decodes: 16 rows)", lambda: paged_decode(
        q, c.k_cache, c.v_cache, c.page_tables, c.seq_lens, 0.1, sum_by_dot=True)
    q4, c4 = _batch(16, 8, 128, torch.bfloat16, [50 + i for i in range(40)], gen)
    yield "paged_decode bf16 16q/8kv d128, 40 sequences (busy: unpipelined)", lambda: paged_decode(
        q4, c4.k_cache, c4.v_cache, c4.page_tables, c4.seq_lens, 0.1, max_rows=64)
    q2, c2 = _batch(8, 1, 256, torch.float32, [600, 40], gen)
    yield "split_kv_decode fp32 8q/1kv d256", lambda: split_kv_decode(
        q2, c2.k_cache, c2.v_cache, c2.page_tables, c2.seq_lens, 0.1, sliding_window=512, split_size=512)
    # 40 sequences whose first 1024 positions are the same pages: two shared splits, items of the default size.
    shared = random_kv(1024, 8, 128, torch.bfloat16, gen)
    own = [random_kv(n, 8, 128, torch.bfloat16, gen) for n in range(100, 140)]
    c3 = paginate([(torch.cat([shared[0], k]), torch.cat([shared[1], v])) for k, v in own], 16, gen)
    tables = c3.page_tables.clone()
    tables[:, :1024 // 16] = tables[0, :1024 // 16]
    groups = cascade_groups(tables, c3.seq_lens, 16, 512, item_size=cascade_item_size(128, 2))
    assert groups.programs, "no shared split: the case would not launch the shared-split kernel"
    q3 = torch.randn(len(own), 16, 128, generator=gen).to(torch.bfloat16)
    yield "cascade_decode bf16 16q/8kv d128", lambda: cascade_decode(
        q3, c3.k_cache, c3.v_cache, tables, c3.seq_lens, groups, 0.1, split_size=512)
    w = torch.randn(4096, 1024, generator=gen).to(torch.bfloat16)
    for m in MATMUL.config_changes(4096, 1024, torch.bfloat16, "cuda", 8192):
        yield f"matmul bf16 [{m}, 1024] @ [4096, 1024].T", lambda m=m: matmul(torch.randn(m, 1024).to(w.dtype), w)


def main():
    attention = importlib.import_module("chunkwise.kernels.paged_attention")
    attention.shared_memory = lambda device: HOPPER_SHARED_MEMORY
    attention.sm_count = lambda device: 132
    # The matmul's tiles as on an H100 SXM or H200 (132 SMs), chosen as for a CUDA tensor.
    MATMUL.sm_count = lambda device: 132
    MATMUL.capability = lambda device: (9, 0)
    config = MATMUL.matmul_config
    MATMUL.matmul_config = lambda n, k, dtype, device, m: config(n, k, dtype, "cuda", m)
    JITFunction.run = _catch
    for name, launch in cases():
        LAUNCHES.clear()
        launch()
        assert LAUNCHES, f"{name}: no kernel launched"
        for fn, args, kwargs in LAUNCHES:
            row = dict(case=name, **compile_launch(fn, args, kwargs))
            print(json.dumps(row), flush=True)
            assert row["shared"] <= HOPPER_SHARED_MEMORY, (f"{name}: {row['kernel']} takes {row['shared']} bytes "
                                                           f"of shared memory, past Hopper's {HOPPER_SHARED_MEMORY}")


if __name__ == "__main__":
    main()
