"""Why a mixed step costs the same at a 256- or 512-token budget: prefill attention of one serving-sized chunk at
long context, time per layer with 256- and 128-row tiles, and whether the two give the same bits (GPU).

    python -m benchmarks.attention_rows

Qwen3-0.6B's attention shape (16 q / 8 KV heads of 128), bf16, pages of 16, one sequence: a chunk of 256 or 512
new tokens ending at 512..2048 tokens of context, as a serving step's prefill is. Such a chunk fills few programs
(its query blocks times the KV heads, far fewer than the SMs), so a layer's attention takes as long as its last
block's sweep over the whole context, whatever the chunk's length: the step's critical path. Times are
triton.testing.do_bench medians; the x28 column is a whole model's layers."""
import torch
import triton.testing

from chunkwise.kernels import paged_attention
from chunkwise.kernels.testing import paginate, query_start_loc, random_kv

gen = torch.Generator().manual_seed(0)
H, KV, D = 16, 8, 128
for ctx, chunk in ((2048, 512), (2048, 256), (1024, 512), (512, 512)):
    kvs = [random_kv(ctx, KV, D, torch.bfloat16, gen, "cuda")]
    cache = paginate(kvs, 16, gen)
    q = torch.randn(chunk, H, D, generator=gen).to(torch.bfloat16).cuda()
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qsl = query_start_loc([chunk], "cuda")
    outs, ms = {}, {}
    for rows in (256, 128):
        f = lambda: paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, lens, qsl, D ** -0.5,
                                    max_rows=rows)
        outs[rows] = f().clone()
        ms[rows] = triton.testing.do_bench(f, warmup=50, rep=200)
    print(f"chunk {chunk} ending at {ctx}: 256 rows {1e3 * ms[256]:.1f} us, 128 rows {1e3 * ms[128]:.1f} us per "
          f"layer (x28: {28 * ms[256]:.2f} / {28 * ms[128]:.2f} ms); same bits: {torch.equal(outs[256], outs[128])}",
          flush=True)
