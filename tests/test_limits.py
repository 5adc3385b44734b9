"""Every limit a request or an engine's configuration is checked against, on both sides: exactly at the limit is
accepted and runs to completion (the reference's tokens), one past is refused with a ValueError naming the value,
and the engine is whole afterwards and serves the next request.

The sizes derived from the configuration (pages per sequence from max_model_len and page_size, splits per
sequence from the split size, steps from the token budget, CUDA-graph buckets from max_num_seqs) are drawn with
it, independently, so every remainder is reached; `@example`s pin the edges (remainder 0, 1 and page_size - 1, a
page larger than max_model_len, a request of exactly max_model_len)."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import chunkwise.reference
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine import kv_cache
from chunkwise.engine_config import DTYPES, EngineConfig
from chunkwise.open_config import open_config
from tests.draws import costly

pytestmark = pytest.mark.correctness

# Draws besides the pinned ones outside the ci profile (which runs the @examples alone: tests/draws.py).
FEW = max(2, settings().max_examples // 5)
FEWEST = max(1, settings().max_examples // 10)


@pytest.fixture(scope="module")
def ref(reference_engine):
    """The reference of the `ckpt` fixture's checkpoint (tiny Qwen3), max_model_len 1024."""
    return reference_engine("qwen3")


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 11 * seed) % (VOCAB - 3) + 3 for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_whole(eng: Engine) -> None:
    assert not eng.has_unfinished()
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages, "pages leaked"


def run_and_compare(eng: Engine, ref, prompts, params) -> list:
    outs = eng.generate(prompts, params)
    assert not any(o.error for o in outs), [o.error for o in outs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
    assert all(len(o.token_ids) == p.max_tokens for o, p in
               zip(outs, params if isinstance(params, list) else [params] * len(outs)))
    assert_whole(eng)
    return outs


# The cheap tests first: under -x a broken check fails in seconds.

# ---- the vocabulary and logprobs --------------------------------------------------------------------------------

@pytest.mark.parametrize("token", [0, 1, VOCAB - 2, VOCAB - 1, -1, VOCAB, VOCAB + 1])
def test_token_ids_inside_the_vocabulary_are_served_and_outside_refused(ckpt, ref, token):
    """A prompt holding the id, and the id as a stop token: served on both engines from 0 to vocab_size - 1."""
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=32)
    prompt = [5, token, 9]
    if 0 <= token < VOCAB:
        run_and_compare(eng, ref, [prompt], greedy(2))
        params = SamplingParams(max_tokens=2, stop_token_ids=[token])
        assert eng.generate([prompt], params)[0].token_ids == ref.generate([prompt], params)[0].token_ids
        return
    with pytest.raises(ValueError, match=f"prompt 0 holds token id {token}, outside the vocabulary \\[0, {VOCAB}\\)"):
        eng.generate([prompt], greedy(2))
    with pytest.raises((ValueError, TypeError), match=f"stop_token_ids.*{token}"):
        eng.generate([[5, 9]], SamplingParams(max_tokens=2, stop_token_ids=[token]))
    assert_whole(eng)
    run_and_compare(eng, ref, [[5, 9]], greedy(2))


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_stop_token_drawn_as_the_last_allowed_token_finishes_with_stop_on_both_engines(ckpt, ref, max_tokens):
    """max_tokens and a stop token meet at the same token: both engines say "stop" (as vLLM does), with the same
    tokens; one token sooner the stop alone ends it, and without the stop the limit does ("length")."""
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=32)
    prompt = prompt_of(5)
    free = ref.generate([prompt], greedy(max_tokens))[0]
    assert free.finish_reason == "length"
    last = free.token_ids[-1]
    if last in free.token_ids[:-1]:
        pytest.skip("the last token also comes earlier: the stop would end the request sooner")
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[last], ignore_eos=True)
    outs = [e.generate([prompt], params)[0] for e in (eng, ref)]
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(free.token_ids, "stop")] * 2
    assert_whole(eng)


@pytest.mark.parametrize("logprobs", [0, VOCAB, VOCAB + 1])
def test_logprobs_up_to_the_vocabulary_size_are_served_and_one_more_refused(ckpt, ref, logprobs):
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=32)
    params = greedy(2, logprobs=logprobs)
    if logprobs > VOCAB:
        for engine in (eng, ref):
            with pytest.raises(ValueError, match=f"logprobs={logprobs} exceeds the vocabulary size {VOCAB}"):
                engine.generate([[5, 9]], params)
        assert_whole(eng)
        return
    out, want = eng.generate([[5, 9]], params)[0], ref.generate([[5, 9]], params)[0]
    assert out.token_ids == want.token_ids
    for got, exp, token in zip(out.logprobs, want.logprobs, out.token_ids):
        assert len(got) == len(exp) == max(1, logprobs) and token in got
        assert got.keys() == exp.keys()
        torch.testing.assert_close(torch.tensor([got[t] for t in exp]), torch.tensor(list(exp.values())),
                                   rtol=0, atol=1e-4)
    assert_whole(eng)


# ---- every other lower bound of the engine's configuration ------------------------------------------------------

@pytest.mark.parametrize("field, low", [
    ("page_size", 1), ("num_pages", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
    ("max_prefill_tokens_with_decodes", 1),
    ("split_kv_threshold", 0), ("split_size", 64)])
def test_each_engine_argument_at_its_lower_bound_serves_and_one_below_is_refused(ckpt, ref, field, low):
    """At the bound the engine serves a request its size allows (one page of one token holds a 1-token prompt
    and 1 token); below it the value is named. split_size is bounded by the split-KV tile (64 here)."""
    kw = dict(page_size=4, num_pages=16, max_model_len=32)
    kw[field] = low
    if field == "num_pages":
        kw["page_size"] = 2
    run_and_compare(Engine(ckpt, **kw), ref, [[5, 9]] if field != "num_pages" else [[5]], greedy(2))
    kw[field] = low - 1
    with pytest.raises(ValueError, match=f"{field} must be .*{low - 1}"):
        Engine(ckpt, **kw)


# ---- max_model_len x page_size x split size: a request of exactly max_model_len ---------------------------------

@costly(max_examples=max(3, settings().max_examples // 3))
@example(page_size=4, max_model_len=16, tail=1, split_size=None)      # max_model_len % page_size == 0
@example(page_size=4, max_model_len=17, tail=2, split_size=None)      # 1: the last page holds one token
@example(page_size=5, max_model_len=19, tail=3, split_size=None)      # page_size - 1
@example(page_size=17, max_model_len=9, tail=2, split_size=None)      # one page, larger than max_model_len
@example(page_size=1, max_model_len=2, tail=1, split_size=None)       # the smallest request: 1 + 1
@example(page_size=7, max_model_len=129, tail=2, split_size=64)       # split-KV: the last split holds 1 position
@example(page_size=16, max_model_len=128, tail=3, split_size=64)      # ... ends exactly on a split boundary
@given(page_size=st.integers(1, 17), max_model_len=st.integers(2, 140), tail=st.integers(1, 3),
       split_size=st.sampled_from([None, 64, 128]))
def test_a_request_of_exactly_max_model_len_runs_whatever_the_page_and_split_sizes(
        ckpt, ref, page_size, max_model_len, tail, split_size):
    """prompt + max_tokens == max_model_len is served (its last token is sampled, never cached, so the cache holds
    max_model_len - 1 tokens), one more token in either is refused naming the numbers; decodes take split-KV when
    split_size is given, paged attention otherwise."""
    max_tokens = min(tail, max_model_len - 1)
    prompt = prompt_of(max_model_len - max_tokens)
    eng = Engine(ckpt, page_size=page_size, max_model_len=max_model_len, max_num_seqs=2,
                 split_kv_threshold=0 if split_size else None, split_size=split_size)
    run_and_compare(eng, ref, [prompt], greedy(max_tokens))
    for p, n in ((prompt, max_tokens + 1), (prompt + [5], max_tokens)):
        with pytest.raises(ValueError, match=f"prompt 0: {len(p)} tokens \\+ max_tokens {n} exceed "
                                             f"max_model_len {max_model_len}"):
            eng.generate([p], greedy(n))
        assert_whole(eng)
    assert eng.generate([prompt], greedy(max_tokens))[0].token_ids == ref.generate([prompt], greedy(max_tokens))[0].token_ids


@pytest.mark.parametrize("limit", [2, 24])
def test_max_model_len_is_accepted_from_2_to_max_position_embeddings_and_refused_past_them(limit):
    """The checkpoint's max_position_embeddings (here `limit`, the tiny model's weights otherwise) bounds
    max_model_len, and a request of exactly that many tokens runs on both engines."""
    path = tiny_checkpoint("qwen3", max_position_embeddings=limit)
    eng, ref = Engine(path, page_size=5), chunkwise.reference.Engine(path)
    assert eng.max_model_len == ref.max_model_len == limit
    run_and_compare(eng, ref, [prompt_of(limit - 1)], greedy(1))
    assert Engine(path, max_model_len=2).max_model_len == 2
    for bad in (1, limit + 1):
        for engine in (Engine, chunkwise.reference.Engine):
            with pytest.raises(ValueError, match=f"max_model_len must be an integer in \\[2, {limit}\\].* got {bad}"):
                engine(path, max_model_len=bad)


# ---- the page pool ---------------------------------------------------------------------------------------------

@costly(max_examples=FEW)
@example(page_size=4, num_pages=3, short=0, max_tokens=2)     # 12 cached tokens fill 3 pages exactly
@example(page_size=4, num_pages=3, short=3, max_tokens=1)     # 9: one token into the last page
@example(page_size=1, num_pages=2, short=0, max_tokens=1)
@given(page_size=st.integers(1, 8), num_pages=st.integers(1, 5), short=st.integers(0, 7), max_tokens=st.integers(1, 3))
def test_a_request_needing_exactly_every_page_runs_and_one_page_more_is_refused(
        ckpt, ref, page_size, num_pages, short, max_tokens):
    """The pool holds prompt + max_tokens - 1 tokens (the last sampled token is never cached): a request filling
    all num_pages pages, to any depth of the last one, runs; one filling a page more is refused by name."""
    cached = num_pages * page_size - min(short, page_size - 1)     # tokens the request leaves in the cache
    max_tokens = min(max_tokens, cached)
    prompt = prompt_of(cached + 1 - max_tokens)
    eng = Engine(ckpt, page_size=page_size, num_pages=num_pages, max_model_len=64)
    run_and_compare(eng, ref, [prompt], greedy(max_tokens))
    over = prompt + [7] * (num_pages * page_size + 1 - cached)
    with pytest.raises(ValueError, match=f"prompt 0: {len(over)} prompt tokens \\+ max_tokens {max_tokens} need "
                                         f"{num_pages + 1} pages of {page_size} tokens, the pool has {num_pages}"):
        eng.generate([over], greedy(max_tokens))
    assert_whole(eng)
    run_and_compare(eng, ref, [prompt], greedy(max_tokens))   # again, now from the prefix cache


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_kv_pool_of_every_dtype_holds_the_pages_its_memory_holds_and_refuses_one_more(ckpt, monkeypatch, dtype):
    """A page's bytes are what its K and V tensors take in the engine's dtype (torch's own element size): with
    memory for exactly 40 such pages and a CPU cap of 10, the default pool is 10 pages, num_pages=40 is accepted
    and 41 refused by name. (A float16 page counted as 4-byte elements would get 5 pages and refuse 40.)"""
    def config(num_pages):
        return open_config(EngineConfig(ckpt, dtype=dtype, device="cpu", page_size=4, max_model_len=64,
                                        num_pages=num_pages))

    def pool(num_pages=None):
        c = config(num_pages)
        return kv_cache.pool_size(c, c.model_config.num_kv_heads, torch.device("cpu"))
    one = kv_cache.KVCache(config(1), config(1).model_config.num_kv_heads, torch.device("cpu"))
    assert all(t.dtype == DTYPES[dtype] for layer in one.layers for t in layer)
    per_page = sum(t.nbytes for layer in one.layers for t in layer)   # numel * torch's element_size
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: SimpleNamespace(available=40 * per_page))
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_CAP", 10 * per_page)
    assert pool() == 10
    assert pool(40) == 40
    with pytest.raises(ValueError, match="^num_pages=41 of page_size=4 needs"):
        pool(41)


# ---- max_num_seqs and the CUDA-graph buckets derived from it ------------------------------------------------------

def steps_of(eng: Engine) -> list:
    """The ScheduledBatch of every step the runner runs, in order."""
    batches, real = [], eng.executor.runner.run

    def spy(batch, *args):
        batches.append((list(batch.seqs), list(batch.num_new_tokens)))
        return real(batch, *args)
    eng.executor.runner.run = spy
    return batches


@costly(max_examples=FEW)
@example(max_num_seqs=1, extra=1)
@example(max_num_seqs=3, extra=0)
@given(max_num_seqs=st.integers(1, 5), extra=st.integers(0, 2))
def test_max_num_seqs_requests_run_together_and_one_more_waits(ckpt, ref, max_num_seqs, extra):
    eng = Engine(ckpt, page_size=4, max_model_len=32, max_num_seqs=max_num_seqs)
    batches = steps_of(eng)
    prompts = [prompt_of(3 + i, seed=i) for i in range(max_num_seqs + extra)]
    run_and_compare(eng, ref, prompts, greedy(2))
    assert max(len(seqs) for seqs, _ in batches) == max_num_seqs
    assert len(batches[0][0]) == max_num_seqs, "the first step admitted fewer than max_num_seqs requests"


@costly(max_examples=FEWEST)
@example(max_num_seqs=5, decodes=5, cascade=False)     # a bucket of its own: the largest is max_num_seqs
@example(max_num_seqs=17, decodes=9, cascade=True)     # padded to 16
@example(max_num_seqs=3, decodes=3, cascade=True)
@given(max_num_seqs=st.integers(1, 18), decodes=st.integers(1, 18), cascade=st.booleans())
def test_graph_buckets_from_any_max_num_seqs_stage_every_decode_batch_as_eager_steps_compute_it(
        ckpt, ref, max_num_seqs, decodes, cascade):
    """Each decode-only step runs over the CUDA graphs' static inputs (staged into the smallest bucket that holds
    it, as a replay would be; eagerly here) and its logits equal the eager step's; the engine goes on with them
    and generates the reference's tokens."""
    decodes = min(decodes, max_num_seqs)
    shared = prompt_of(70)   # a prefix of a whole split, so cascade steps group the decodes
    prompts = [shared + prompt_of(1 + i % 4, seed=i + 1) for i in range(decodes)]
    eng = Engine(ckpt, page_size=8, max_model_len=96, max_num_seqs=max_num_seqs, split_size=64, split_kv_threshold=0,
                 cascade_attention=cascade, enforce_eager=True, async_scheduling=False)
    runner = eng.executor.runner
    graphs = runner.graphs
    graphs.allocate(max_num_seqs)
    assert max(graphs.buckets) == max_num_seqs and min(graphs.buckets) == 1
    eager, staged = runner.forward, []

    def forward(host):
        logits, _ = eager(host)
        if host.num_prefill or len(host.logits_indices) != len(host.rows):
            return logits, None
        static = graphs.static_forward(host, runner.tables.table, runner.last_tokens)
        torch.testing.assert_close(static, logits, rtol=1e-5, atol=1e-5)
        staged.append(len(host.rows))
        return static, None
    runner.forward = forward
    params = greedy(2)
    eng.generate(prompts[:1], greedy(1))   # caches the shared prefix
    outs = eng.generate(prompts, params)
    assert not any(o.error for o in outs), [o.error for o in outs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
    assert staged and max(staged) == decodes


# ---- max_num_batched_tokens -------------------------------------------------------------------------------------

@costly(max_examples=FEW)
@example(budget=6, over=0)     # a prompt of exactly the budget: one step
@example(budget=6, over=1)     # one token more: two
@example(budget=1, over=2)
@given(budget=st.integers(1, 12), over=st.integers(-1, 1))
def test_a_prompt_of_exactly_the_token_budget_takes_one_step_and_one_token_more_takes_two(ckpt, ref, budget, over):
    n = max(1, budget + over)
    eng = Engine(ckpt, page_size=4, max_model_len=32, max_num_batched_tokens=budget)
    batches = steps_of(eng)
    run_and_compare(eng, ref, [prompt_of(n)], greedy(2))
    assert all(sum(tokens) <= budget for _, tokens in batches)
    prefill = [sum(tokens) for _, tokens in batches][:-1]   # the steps before the one decode (max_tokens 2)
    assert prefill == [budget] * (n // budget) + ([n % budget] if n % budget else [])


# ---- every other EngineConfig value, both sides of its limit (no engine is built: milliseconds each) -------------

@pytest.mark.parametrize("field, accepted, refused", [
    ("gpu_memory_utilization", [1.0, 1e-9, 1], [0.0, 1.0000001, -0.5, True, "0.5", None]),
    ("max_pinned_fraction", [0.0, 0, 0.999], [1.0, 1, -1e-9, False, "0.5"]),
    ("page_size", [1, np.int64(3)], [0, -1, 2.0, True, None]),
    ("max_num_seqs", [1], [0, 1.5, False]),
    ("max_num_batched_tokens", [1], [0, "8"]),
    ("num_pages", [None, 1], [0, 3.0]),
    ("split_kv_threshold", [None, 0, 1], [-1, 0.5]),
    ("max_graph_tokens", [0, 1, 512], [-1, 2.0, True, None]),
    ("split_size", [None, 64, 128], [0, 32, 96, 64.0]),
    ("max_model_len", [None, 2, 1024], [1, 1025, 2.0]),
    ("enable_prefix_caching", [True, False], [1, "yes", None]),
    ("enforce_eager", [False], [0]),
    ("cascade_attention", [True], [None]),
    ("deterministic", [False, True], ["true"]),
    ("custom_all_reduce", [False], [1]),
    ("async_scheduling", [None, True, False], [0, "no"]),
    ("dtype", ["float32", "bfloat16", "float16", torch.float16], ["float64", torch.float64, "fp16", None, 32]),
    ("device", [None, "cpu", torch.device("cpu")], ["tpu", "not a device", 3.5]),
    ("tensor_parallel_size", [1, 2, 4], [0, 3, 8, 2.0]),
    ("attention_backend", ["triton"], ["fa2", "FA3", None, 3]),
])
def test_each_engine_config_value_inside_its_limits_is_accepted_and_outside_refused_naming_it(
        ckpt, field, accepted, refused):
    """The tiny Qwen3 (4 query heads, 2 KV heads, intermediate 128, head_dim 16: split-KV tiles of 64, 1024
    positions): tensor parallelism splits or replicates KV heads, so 4 ranks are accepted and 3 or 8 are not."""
    for value in accepted:
        config = open_config(EngineConfig(ckpt, **{field: value}))
        if value is not None and field not in ("dtype", "device"):
            assert getattr(config, field) == value
    for value in refused:
        with pytest.raises(ValueError, match=field) as e:
            open_config(EngineConfig(ckpt, **{field: value}))
        assert repr(value) in str(e.value) or str(value) in str(e.value), e.value


def test_engine_config_defaults_resolve_as_documented_on_the_cpu(ckpt):
    config = open_config(EngineConfig(ckpt))
    assert (config.dtype, config.device, config.max_model_len) == (torch.float32, torch.device("cpu"), 1024)
    assert (config.split_kv_threshold, config.split_size, config.async_scheduling) == (256, 512, False)
    assert config.max_pages_per_seq == 64 and EngineConfig(ckpt, page_size=5, max_model_len=11).max_pages_per_seq == 3
    assert EngineConfig(ckpt, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_deterministic_tensor_parallelism_stops_at_two_ranks(ckpt):
    assert EngineConfig(ckpt, deterministic=True, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="deterministic=True supports tensor_parallel_size up to 2, got 4"):
        EngineConfig(ckpt, deterministic=True, tensor_parallel_size=4)


def test_fa3_is_refused_where_it_cannot_run_naming_why(ckpt, monkeypatch):
    """Without vLLM, on the CPU, beside deterministic mode; and `fa3_unavailable` on a (faked) CUDA device of
    another architecture, dtype or head_dim. The tiny Qwen3's head_dim is 16."""
    from chunkwise.kernels import fa3
    monkeypatch.setattr(fa3, "library", lambda: (None, "No module named 'vllm'"))
    with pytest.raises(ValueError, match="attention_backend='fa3' cannot run here: vLLM's FlashAttention-3 library "
                                         "is not available: No module named 'vllm'"):
        open_config(EngineConfig(ckpt, attention_backend="fa3"))
    monkeypatch.setattr(fa3, "library", lambda: (object(), None))
    with pytest.raises(ValueError, match="attention_backend='fa3' cannot run here: it runs on CUDA devices only, "
                                         "got cpu"):
        open_config(EngineConfig(ckpt, attention_backend="fa3", device="cpu"))
    with pytest.raises(ValueError, match="attention_backend='fa3' does not combine with deterministic=True"):
        EngineConfig(ckpt, attention_backend="fa3", deterministic=True)
    cuda = torch.device("cuda", 0)
    for capability, dtype, head_dim, why in [
            ((8, 0), torch.bfloat16, 128, r"Hopper GPUs \(compute capability 9.x\) only; cuda:0 is 8.0"),
            ((10, 0), torch.float16, 128, "cuda:0 is 10.0"),
            ((9, 0), torch.float32, 128, "float16 or bfloat16, got torch.float32"),
            ((9, 0), torch.bfloat16, 20, "head_dim must be a multiple of 8 up to 256, got 20"),
            ((9, 0), torch.bfloat16, 264, "got 264"),
            ((9, 0), torch.float16, 256, None)]:
        monkeypatch.setattr(fa3, "capability", lambda device, c=capability: c)
        got = fa3.fa3_unavailable(cuda, dtype, head_dim)
        assert (got is None) if why is None else re.search(why, got), (capability, dtype, head_dim, got)


def test_the_default_cpu_pool_holds_every_running_sequence_at_full_length_below_the_cap(ckpt, monkeypatch):
    """max_num_seqs sequences of max_model_len tokens (pages rounded up: 9 tokens take 3 pages of 4) when memory
    allows; a machine without room for one page refuses the engine naming the page size."""
    def pool(**kw):
        c = open_config(EngineConfig(ckpt, device="cpu", page_size=4, max_model_len=9, **kw))
        return kv_cache.pool_size(c, c.model_config.num_kv_heads, torch.device("cpu"))
    assert pool(max_num_seqs=3) == 9 and pool(max_num_seqs=1) == 3
    per_page = kv_cache.page_bytes(open_config(EngineConfig(ckpt)).model_config, 4, torch.float32)
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * per_page - 1))
    with pytest.raises(ValueError, match="^page_size=4: one page of KV cache takes"):
        pool(max_num_seqs=3)
