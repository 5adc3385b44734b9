"""Prefill attention of a blend's rows: a few hundred rows scattered over a long context (explicit positions), one
pass against the context split across programs, per tile height, time per layer (GPU).

    python -m benchmarks.attention_planned [--out FILE.json]

Qwen3-0.6B's attention shape (16 q / 8 KV heads of 128), bf16, pages of 16, one sequence of 4,160 tokens (8
documents of 512 and a 64-token question, benchmarks/bench_blend_speed.py's composed request): the rows a blend
computes after its check layers (a random share r of the 3,584 candidate rows, the question's 64 always), and
chunk-heads' (the first rows of each document after the first, and the question), and each count again as the
context's last rows (contiguous). Medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph) after a warm-up that compiles every variant; the roofline is the causal
products' FLOPs (each row over the keys at or before it) at the measured paged FA3 rate (HOPPER.md: ~500 TFLOP/s)."""
import argparse
import json

import torch
import triton.testing

from chunkwise.kernels import paged_attention
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.testing import paginate, random_kv

H, KV, D = 16, 8, 128
DOCS, DOC, QUESTION = 8, 512, 64
CTX = DOCS * DOC + QUESTION
FA3_TFLOPS = 500
SPLITS = (None, 512, 1024, 2048)
TILE_ROWS = (64, 128, 256)


def patterns(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Each pattern's row positions (ascending)."""
    candidates = torch.arange(DOC, DOCS * DOC)   # the first document is exact (an opening)
    question = torch.arange(DOCS * DOC, CTX)
    out = {}
    for r in (0.15, 0.3, 0.5):
        k = round(r * len(candidates))
        pick = candidates[torch.randperm(len(candidates), generator=gen)[:k]]
        out[f"kv-deviation r={r}"] = torch.cat([pick.sort().values, question])
    heads = round(0.15 * DOC)
    out["chunk-heads r=0.15"] = torch.cat([torch.arange(d * DOC, d * DOC + heads) for d in range(1, DOCS)]
                                          + [question])
    # The same row counts as one contiguous run at the context's end (a chunk after a cached prefix): what the
    # counts cost when nothing is scattered.
    for n in sorted(len(p) for name, p in out.items() if name.startswith("kv-deviation")):
        out[f"contiguous, last {n}"] = torch.arange(CTX - n, CTX)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cache = paginate([random_kv(CTX, KV, D, torch.bfloat16, gen, "cuda")], 16, gen)
    lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
    variants = [(s, r) for s in SPLITS for r in TILE_ROWS]
    results = []
    print(f"{'pattern':<22} {'rows':>5} {'roof us':>7} " + " ".join(f"{f'{s or 1}/{r}':>9}" for s, r in variants),
          flush=True)
    for name, pos in patterns(gen).items():
        n = len(pos)
        positions = pos.to("cuda")
        q = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).cuda()
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        spaces = {(s, r): paged_split_workspace(n, H, q.dtype, cache.k_cache, cache.page_tables, s, r)
                  for s, r in variants if s}

        def run(split, rows):
            return paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, lens, qsl, D ** -0.5,
                                   out=out, max_rows=rows, positions=positions, split_size=split,
                                   workspace=spaces[split, rows] if split else None)
        ref = run(None, 128).float().clone()
        us, err = {}, {}
        for v in variants:
            err[v] = ((run(*v).float() - ref).norm() / ref.norm()).item()
            us[v] = 1e3 * triton.testing.do_bench_cudagraph(lambda: run(*v), rep=100)
        flops = 4 * H * D * float((pos + 1).sum())
        roof = flops / (FA3_TFLOPS * 1e12) * 1e6
        best = min(variants, key=lambda v: us[v])
        results.append(dict(pattern=name, rows=n, roofline_us=roof, us={f"{s}/{r}": us[s, r] for s, r in variants},
                            max_rel_diff=max(err.values())))
        print(f"{name:<22} {n:>5} {roof:>7.1f} " + " ".join(f"{us[v]:>9.1f}" for v in variants)
              + f"  best {best[0]}/{best[1]} {us[best]:.1f} us ({100 * roof / us[best]:.0f}% of roofline; max rel "
              f"diff {max(err.values()):.1e})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
