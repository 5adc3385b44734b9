"""vLLM's FlashAttention-3 as the prefill backend (`attention_backend="fa3"`) on a Hopper GPU: the adaptor
against the float32 reference, a row's bits across chunk starts and batch-mates, and the engine against the
reference engine. Skipped where FA3 cannot run (no vLLM, no Hopper). Error measure and bounds:
tests/test_kernels_gpu.py's.
"""
import pytest
import torch

import chunkwise.reference
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine import model as engine_model
from chunkwise.kernels import paged_attention_ref
from chunkwise.kernels.fa3 import fa3_paged_attention, fa3_unavailable
from chunkwise.kernels.testing import paginate, query_start_loc, random_kv, rel_err
from logprobs_close import MIN_AGREED_SHARE, TOP_K, check_logprobs_close
from test_kernels_gpu import REL_BOUND

WHY = fa3_unavailable(torch.device("cuda"), torch.bfloat16, 128) if torch.cuda.is_available() else "no CUDA"
pytestmark = [pytest.mark.gpu, pytest.mark.correctness, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

def _attend(fn, cache, q, q_lens, seq_lens, scale, window=None, **split):
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    return fn(q, cache.k_cache, cache.v_cache, cache.page_tables, seq_lens, query_start_loc(q_lens, q.device),
              scale, sliding_window=window, out=torch.full_like(q, float("nan")), **split)


@pytest.mark.parametrize("heads, kv_heads, head_dim, window, page_size", [
    (32, 8, 128, None, 16), (16, 8, 64, None, 1), (4, 1, 256, 512, 16), (8, 1, 128, 300, 7), (16, 2, 96, None, 64)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa3_matches_the_reference_across_head_dims_windows_and_page_sizes(dtype, split, heads, kv_heads, head_dim,
                                                                             window, page_size):
    """Chunks after cached prefixes, a fresh prompt and decodes in one batch, in one pass and split as FA3
    chooses; the pool's unread slots are NaN."""
    seqs = [(3000, 1500), (1024, 1024), (0, 777)] + [(97 * i + 5, 1) for i in range(20)]
    gen = torch.Generator().manual_seed(0)
    cache = paginate([random_kv(p + c, kv_heads, head_dim, dtype, gen, "cuda") for p, c in seqs], page_size, gen)
    q = torch.randn(sum(c for _, c in seqs), heads, head_dim, generator=gen).to(dtype).cuda()
    q_lens, seq_lens, scale = [c for _, c in seqs], [p + c for p, c in seqs], head_dim ** -0.5
    out = _attend(fa3_paged_attention, cache, q, q_lens, seq_lens, scale, window, split=split)
    ref = _attend(paged_attention_ref, cache, q.float(), q_lens, seq_lens, scale, window)
    assert rel_err(out, ref) < REL_BOUND[dtype]


@pytest.mark.parametrize("page_size", [16, 7])
def test_fa3_rows_keep_their_bits_across_chunk_starts_and_batch_mates(page_size):
    """What the adaptor's num_splits=1 buys: a prompt chunked anywhere, beside other prompts and decodes, gives
    each row the bits of the whole prompt computed alone."""
    gen = torch.Generator().manual_seed(2)
    length, dtype = 6144, torch.bfloat16
    kv = random_kv(length, 8, 128, dtype, gen, "cuda")
    q = torch.randn(length, 32, 128, generator=gen).to(dtype).cuda()
    whole = _attend(fa3_paged_attention, paginate([kv], page_size, gen), q, [length], [length], 128 ** -0.5)
    mates = [random_kv(n, 8, 128, dtype, gen, "cuda") for n in (3000, 5)]
    cache = paginate([mates[0], kv, mates[1]], page_size, gen)
    start, pieces = 0, []
    for end in (1, 64, 4096, 4097, 5000, 6144):
        q_b = torch.cat([q[:3], q[start:end], q[:1]])   # batch-mates: a chunk of 3 rows and a decode
        out = _attend(fa3_paged_attention, cache, q_b, [3, end - start, 1], [3000, end, 5], 128 ** -0.5)
        pieces.append(out[3:3 + end - start])
        start = end
    assert torch.equal(torch.cat(pieces), whole)


# Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128) in 4 layers: graphs of up to 1024 rows capture fast.
SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, initializer_range=0.02)


def test_the_engine_with_fa3_prefill_agrees_with_the_reference_in_eager_steps_and_graphs(monkeypatch):
    """Prompts of 600-2500 tokens in steps of up to 2048 rows, chunked at odd places (eager steps), then one of
    900 alone and one of 300 alone: steps that replay CUDA graphs (max_graph_tokens 1024) with FA3 captured in
    them, in one pass and split. The adaptor must be what ran."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fa3_paged_attention(*args, **kwargs)

    monkeypatch.setattr(engine_model, "fa3_paged_attention", counted)
    ckpt = tiny_checkpoint("qwen3", seed=0, **SHAPE)
    gen = torch.Generator().manual_seed(0)
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=4096, num_pages=2048, max_num_batched_tokens=2048,
                 max_graph_tokens=1024, attention_backend="fa3")
    assert any(512 < n <= 1024 for n in calls) and any(n <= 512 for n in calls), f"graphs captured {calls}"
    ref = chunkwise.reference.Engine(ckpt, dtype="bfloat16", max_model_len=4096)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    agreed = []
    for lens, chunks in (([600, 1500, 2500, 900], [None, [700, 1, 799], 1024, [513, 387]]), ([900], None),
                         ([300], None)):
        prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lens]
        graphs, eager = (eng.executor.runner.launches["mixed", kind] for kind in ("graph", "eager"))
        calls.clear()
        opt = eng.generate(prompts, params, chunk_sizes=chunks)
        if chunks is None:   # the one prefill step replayed a graph, which captured FA3
            assert eng.executor.runner.launches["mixed", "graph"] == graphs + 1 and not calls, calls
        else:
            assert eng.executor.runner.launches["mixed", "eager"] > eager and any(n > 1024 for n in calls), calls
        out = ref.generate(prompts, params)
        agreed += [check_logprobs_close(o, r, f"{len(lens)} prompts, request {i}") for i, (o, r) in
                   enumerate(zip(opt, out))]
    assert sum(agreed) >= MIN_AGREED_SHARE * params.max_tokens * len(agreed), agreed
