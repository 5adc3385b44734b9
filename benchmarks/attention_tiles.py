"""A blend's rows under every tile configuration: (BLOCK_M, BLOCK_N, warps, stages) x split size, against the
configuration a row plan gets today, for a few hundred to a thousand rows over a long context (GPU).

    python -m benchmarks.attention_tiles [--out FILE.json]

Qwen3-0.6B's attention shape (16 q / 8 KV heads of 128), bf16, pages of 16. Four row sets: kv-deviation's rows at
r = 0.15 of bench_blend_speed's composed request (4,160 tokens) and chunk-heads' there, and r = 0.15 of the
prefill-bound RAG request (8,736 tokens), scattered and as the context's last rows. Each configuration replaces
`tile_config`'s answer for the launch; medians of CUDA-graph replays (triton.testing.do_bench_cudagraph) after a
first call that compiles it; the roofline is the causal products at attention_planned's FA3_TFLOPS."""
import argparse
import importlib
import json

import torch
import triton.testing

from benchmarks.attention_planned import D, DOC, FA3_TFLOPS, H, KV, QUESTION
from chunkwise.engine.model import PLANNED_SPLIT_SIZE, PLANNED_TILE_ROWS
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.testing import paginate, random_kv
from chunkwise.kernels.tiling import shared_memory

pa = importlib.import_module("chunkwise.kernels.paged_attention")   # the package re-exports the function's name
PAGE = 16
CONFIGS = [(m, n, w, s) for m in (64, 128, 256) for n in (64, 128) for w in (4, 8) for s in (1, 2, 3, 4)
           if not (m == 256 and w == 4) and not (m == 64 and w == 8)]
SPLITS = (None, 1024, 2048)


def row_sets(gen: torch.Generator):
    """(name, context length, row positions)."""
    for ctx, rows, kind in ((4160, 602, "kv-deviation"), (4160, 603, "chunk-heads"), (8736, 1234, "kv-deviation"),
                            (8736, 1234, "contiguous")):
        question = torch.arange(ctx - QUESTION, ctx)
        if kind == "kv-deviation":
            candidates = torch.arange(DOC, ctx - QUESTION)
            pick = candidates[torch.randperm(len(candidates), generator=gen)[:rows - QUESTION]].sort().values
            pos = torch.cat([pick, question])
        elif kind == "chunk-heads":
            pos = torch.cat([torch.arange(d * DOC, d * DOC + 77) for d in range(1, 8)] + [question])
        else:
            pos = torch.arange(ctx - rows, ctx)
        yield f"{kind} {len(pos)} of {ctx}", ctx, pos


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write every timing as JSON here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    tile_config, forced = pa.tile_config, []
    # what a row plan's launches take on this GPU: tile_config's answer under PLANNED_TILE_ROWS, PLANNED_SPLIT_SIZE
    today = tile_config(D, H // KV, torch.bfloat16, shared_memory("cuda"), PLANNED_TILE_ROWS), PLANNED_SPLIT_SIZE
    pa.tile_config = lambda *a, **k: forced[0] if forced else tile_config(*a, **k)
    results = []
    for name, ctx, pos in row_sets(gen):
        cache = paginate([random_kv(ctx, KV, D, torch.bfloat16, gen, "cuda")], PAGE, gen)
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        n, positions = len(pos), pos.cuda()
        q = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).cuda()
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        roof = 4 * H * D * float((pos + 1).sum()) / (FA3_TFLOPS * 1e12) * 1e6
        ref = pa.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, lens, qsl, D ** -0.5,
                                 max_rows=PLANNED_TILE_ROWS, positions=positions).float()
        timed = []
        for cfg in CONFIGS:
            forced[:] = [cfg]
            for split in SPLITS:
                ws = paged_split_workspace(n, H, q.dtype, cache.k_cache, cache.page_tables, split) if split else None

                def run():
                    return pa.paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, lens, qsl,
                                              D ** -0.5, out=out, positions=positions, split_size=split,
                                              workspace=ws)
                run()
                diff = ((out.float() - ref).norm() / ref.norm()).item()
                timed.append((1e3 * triton.testing.do_bench_cudagraph(run, rep=30), cfg, split, diff))
        forced.clear()
        timed.sort(key=lambda t: t[0])
        today_us = next(t[0] for t in timed if (t[1], t[2]) == today)
        print(f"{name}: roofline {roof:.1f} us; today {today} {today_us:.1f} us ({100 * roof / today_us:.0f}%)",
              flush=True)
        for us, cfg, split, diff in timed[:5]:
            print(f"   {us:7.1f} us ({100 * roof / us:3.0f}%)  {cfg} split {split}  rel diff {diff:.1e}", flush=True)
        results.append(dict(rows=name, roofline_us=roof, today_us=today_us,
                            timed=[dict(us=us, config=cfg, split=split, rel_diff=diff) for us, cfg, split, diff in timed]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
