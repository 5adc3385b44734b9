"""Prefill attention of one serving-sized chunk at long context: one pass against the context split across
programs, time per layer (GPU).

    python -m benchmarks.attention_rows [--out FILE.json] [--min-table 32768]
    python -m benchmarks.attention_rows --chunks 640,768,1024 --contexts 2048,8192 --splits 512,2048

Qwen3-0.6B's attention shape (16 q / 8 KV heads of 128), bf16, pages of 16, one sequence: a chunk of 64..2048
new tokens ending at 512..8192 tokens of context, as a serving step's prefill is. In one pass such a chunk fills
few programs (its query blocks times the KV heads, far fewer than the SMs), so a layer's attention takes as long
as its last block's sweep over the whole context, whatever the chunk's length: the step's critical path. With
`split_size` each block's context is split every split_size positions across programs, merged by the last to
arrive, in 256- or 128-row tiles. Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph, as
the engine replays its steps: no host time), after a warm-up that compiles every variant; the ratio is one pass
over the best split (> 1: the split is faster). Also checked: split and one pass agree to bf16 rounding, and 128-
and 256-row tiles give the same bits, in one pass and split."""
import argparse
import json

import torch
import triton.testing

from chunkwise.kernels import paged_attention
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.testing import paginate, query_start_loc, random_kv

H, KV, D = 16, 8, 128
SPLITS = (256, 512, 1024)
CASES = [(ctx, chunk, ctx) for ctx in (512, 1024, 2048, 4096, 8192) for chunk in (64, 128, 256, 512, 1024, 2048)
         if chunk <= ctx]
# The same chunks under page tables as wide as 32768 positions, as a CUDA graph captured for max_model_len 32k
# sees them: the split grid then holds 64 splits per block, most of them past the context (programs that return).
CASES += [(2048, 64, 32768), (2048, 512, 32768)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--min-table", type=int, default=0, help="only the cases whose page tables span this many "
                    "positions or more (32768: the wide-table cases alone)")
    ap.add_argument("--chunks", help="comma-separated chunk lengths instead of the default cases (each ending at "
                    "each of --contexts positions)")
    ap.add_argument("--contexts", default="2048,4096,8192,16384", help="with --chunks: the contexts")
    ap.add_argument("--splits", help="comma-separated split sizes instead of %s" % ",".join(map(str, SPLITS)))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    splits = tuple(int(s) for s in args.splits.split(",")) if args.splits else SPLITS
    cases = CASES if not args.chunks else [
        (ctx, chunk, ctx) for ctx in map(int, args.contexts.split(",")) for chunk in map(int, args.chunks.split(","))
        if chunk <= ctx]
    variants = [(s, r) for s in splits for r in (256, 128)]
    print(f"{'ctx':>5} {'chunk':>5} {'one pass us':>11} " + " ".join(f"{f's{s}/{r} us':>11}" for s, r in variants)
          + "  best ratio", flush=True)
    for ctx, chunk, width in (c for c in cases if c[2] >= args.min_table):
        cache = paginate([random_kv(ctx, KV, D, torch.bfloat16, gen, "cuda")], 16, gen,
                         extra_table_cols=1 + (width - ctx) // 16)
        q = torch.randn(chunk, H, D, generator=gen).to(torch.bfloat16).cuda()
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        qsl = query_start_loc([chunk], "cuda")
        out = torch.empty_like(q)
        spaces = {(s, r): paged_split_workspace(chunk, H, q.dtype, cache.k_cache, cache.page_tables, s, r)
                  for s, r in variants}

        def run(split=None, max_rows=256):
            return paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, lens, qsl, D ** -0.5,
                                   out=out, max_rows=max_rows, split_size=split,
                                   workspace=spaces[split, max_rows] if split else None)
        one = run().clone()
        same_bits = torch.equal(one, run(max_rows=128))
        us = {None: 1e3 * triton.testing.do_bench_cudagraph(lambda: run(), rep=100)}
        err = {}
        for v in variants:
            split_out = run(*v).clone()
            same_bits &= torch.equal(split_out, run(v[0], 384 - v[1]))
            err[v] = ((split_out.float() - one.float()).norm() / one.float().norm()).item()
            us[v] = 1e3 * triton.testing.do_bench_cudagraph(lambda: run(*v), rep=100)
        best = min(variants, key=lambda v: us[v])
        row = dict(ctx=ctx, chunk=chunk, table_positions=width, one_pass_us=us[None],
                   split_us={f"{s}/{r}": us[s, r] for s, r in variants}, rel_diff_to_one_pass=max(err.values()),
                   same_bits_128_256_rows=same_bits)
        rows.append(row)
        print(f"{ctx:>5} {chunk:>5} {us[None]:>11.1f} " + " ".join(f"{us[v]:>11.1f}" for v in variants)
              + (f"  (table {width} wide)" if width > ctx else "")
              + f"  {us[None] / us[best]:.2f}x @{best[0]}/{best[1]} (max rel diff {max(err.values()):.1e}, "
              f"128/256-row bits same: {same_bits})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
