"""Tile-config sweep for the attention kernels on the GPU (a tuning aid; the benchmark is bench_kernels.py).

Times each (BLOCK_M, BLOCK_N, num_warps, num_stages) of paged_attention and each (BLOCK_N, num_warps,
num_stages, split_size) of split_kv_decode on the benchmark's cases, checks each variant's output against the
default config's (a broken fast variant must not win), and prints one table.

    python benchmarks/sweep_kernels.py
"""
import importlib
import sys

import torch
from bench_kernels import CASES, SCALE, build, median_ms, ours, work

PAGED = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2),
         (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (256, 128, 8, 2), (256, 64, 8, 2), (128, 32, 4, 2),
         (32, 64, 4, 2), (16, 64, 4, 2), (16, 128, 4, 3)]
SPLIT = [(64, 4, 2, 512), (64, 4, 3, 512), (32, 4, 2, 512), (128, 4, 2, 512), (128, 8, 2, 512), (64, 2, 2, 512),
         (64, 4, 4, 512), (64, 4, 2, 256), (64, 4, 2, 1024), (128, 4, 3, 1024), (32, 2, 3, 256)]


# chunkwise/kernels/__init__.py re-exports functions of the same names, so fetch the modules themselves.
pa = importlib.import_module("chunkwise.kernels.paged_attention")
sk = importlib.import_module("chunkwise.kernels.split_kv")


def main():
    default_paged, default_split = pa.tile_config, sk.split_tile_config
    print("| kernel | config | case | ms | TB/s | TFLOP/s | max abs diff vs default |", flush=True)
    for case in CASES:
        t = build(case, torch.Generator(device="cuda").manual_seed(0))
        nbytes, flops = work(case)
        pa.tile_config = default_paged
        reference = ours(t, "paged")().clone()
        for cfg in PAGED:
            pa.tile_config = lambda *args, cfg=cfg: cfg   # takes whatever paged_attention passes
            fn = ours(t, "paged")
            diff = (fn().float() - reference.float()).abs().max().item()
            ms = median_ms(fn)
            print(f"| paged | {cfg} | {case.name} | {ms:.3f} | {nbytes / ms / 1e9:.2f} | {flops / ms / 1e9:.1f} "
                  f"| {diff:.1e} |", flush=True)
        pa.tile_config = default_paged
        if not case.decode:
            continue
        for block_n, warps, stages, split_size in SPLIT:
            # BLOCK_H stays the default's (the group's heads padded for tl.dot); the rest is swept.
            sk.split_tile_config = lambda head_dim, group, c=(block_n, warps, stages): (
                default_split(head_dim, group)[0], *c)
            q, args = t["q"], (t["k_cache"], t["v_cache"], t["page_tables"], t["seq_lens"], SCALE)
            fn = lambda: sk.split_kv_decode(q, *args, split_size=split_size)  # noqa: E731
            diff = (fn().float() - reference.float()).abs().max().item()
            ms = median_ms(fn)
            print(f"| split | {(block_n, warps, stages, split_size)} | {case.name} | {ms:.3f} | "
                  f"{nbytes / ms / 1e9:.2f} | {flops / ms / 1e9:.1f} | {diff:.1e} |", flush=True)
        sk.split_tile_config = default_split


if __name__ == "__main__":
    sys.exit(main())
