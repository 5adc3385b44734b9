"""Tensor parallelism on CPU (gloo, float32, the Triton interpreter): Engine(tensor_parallel_size=2) against one
rank and against the reference.

Four tiny shapes, each crossing one way the sharding can go wrong: MHA (two KV heads per rank, q/k/v/o biases:
o_proj's bias must be added once, after the all-reduce), GQA (Qwen2: one KV head per rank, sharded q/k/v biases;
a pool so tight that requests are preempted and their page-table rows rewritten; transformers initialises
biases to zero, so both get random ones here, or a bias bug would be invisible), MQA (one KV head replicated on
both ranks, and a vocabulary of 383 whose last slice is padded) and Gemma 3 (MQA too, sliding window 8, q/k norm,
tied embeddings, embedding scale). Prompts are chunked and the page size is 3, so chunks and pages cut the
prompts at many places. Greedy tokens must equal the reference's exactly; prefill_kv's K/V (every KV head, each
once) within the strict tier's tolerance of one rank's and the reference's (float32, different summation orders:
the row-parallel sums add the ranks' partial products, so K/V past the first layer differ in the last bits).
One engine per shape for the whole module: spawning a worker costs seconds. A `slow` test adds greedy tokens
against one rank's; tests/test_tensor_parallel_modes.py covers split-KV, cascade and deterministic mode.
"""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity_report import assert_same_tokens, kv_mismatch

import chunkwise.reference
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine_config import EngineConfig
from chunkwise.model_config import ModelConfig
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.model_runner import ModelRunner
from chunkwise.engine.distributed.tensor_parallel import TensorParallel

DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.correctness

MODELS = {
    "mha": ("llama", dict(num_key_value_heads=4, attention_bias=True)),
    "gqa": ("qwen2", {}),
    "mqa": ("llama", dict(num_key_value_heads=1, vocab_size=383)),
    "gemma3": ("gemma3_text", {}),
}
ENGINE_KW = dict(page_size=3, max_model_len=64, max_num_batched_tokens=32)
# gqa: 10 pages for requests needing 19, so some are preempted and recomputed.
NUM_PAGES = {"mha": 64, "gqa": 10, "mqa": 64, "gemma3": 64}
LENGTHS, CHUNKS = [1, 13, 22], [None, [5, 8], [3, 1, 18]]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def with_random_biases(ckpt, out):
    """A copy of the checkpoint whose bias tensors (zeros as transformers initialises them) are random."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(ckpt, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith(".bias"):
            weights[name] = 0.2 * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    """(name, checkpoint, TP=2 engine, TP=1 engine, reference), one set per shape."""
    family, overrides = MODELS[request.param]
    ckpt = tiny_checkpoint(family, **overrides)
    if request.param in ("mha", "gqa"):
        ckpt = with_random_biases(ckpt, tmp_path_factory.mktemp("biased") / ckpt.name)
    kw = dict(ENGINE_KW, num_pages=NUM_PAGES[request.param])
    # Overlap scheduling (the GPU default; off by default on CPU): each worker feeds step k+1 with step k's tokens
    # as it got them itself (from the vocabulary slices' maxima). The TP=1 engine runs synchronously.
    with Engine(ckpt, tensor_parallel_size=2, async_scheduling=True, **kw) as tp:
        yield request.param, ckpt, tp, Engine(ckpt, **kw), chunkwise.reference.Engine(ckpt, max_model_len=64)


@pytest.mark.parametrize("heads, kv_heads, size", [
    (4, 4, 2), (8, 2, 2), (8, 2, 4), (8, 2, 8), (4, 1, 4), (12, 3, 6), (16, 8, 4), (6, 6, 3), (8, 4, 8)])
def test_each_ranks_query_heads_read_its_kv_heads_as_on_one_device(heads, kv_heads, size):
    """Split (size divides kv_heads) or replicated (kv_heads divides size): local query head j reads local KV
    head j // local group, which must be the KV head its global query head reads on one device; every query
    head is on exactly one rank, every KV head on at least one, and the vocabulary slices tile it."""
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=383, hidden_size=heads * 8, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     head_dim=8))
    ranks = [TensorParallel(r, size, cfg, torch.device("cpu")) for r in range(size)]
    group = heads // kv_heads
    for tp in ranks:
        q, kv = list(tp.q_heads), list(tp.kv_heads)
        local_group = len(q) // len(kv)
        assert [kv[j // local_group] for j in range(len(q))] == [h // group for h in q], f"rank {tp.rank}"
    assert sorted(h for tp in ranks for h in tp.q_heads) == list(range(heads))
    assert {h for tp in ranks for h in tp.kv_heads} == set(range(kv_heads))
    assert [v for tp in ranks for v in tp.vocab] == list(range(383))
    assert all(len(tp.vocab) <= tp.vocab_rows for tp in ranks)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 4), vocab=st.integers(1, 23), rows=st.integers(1, 4), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_argmax_over_the_vocabulary_slices_is_torch_argmax_over_the_whole_vocabulary(size, vocab, rows, dtype,
                                                                                       data):
    """Each rank's slice maxima, gathered (simulated here, every rank in one process), give every rank
    torch.argmax of the whole logits: values from a few integers, all negative or not, so maxima tie within a
    slice and across slices (the lowest id wins), and padding columns hold larger values that must never win (a
    vocabulary of 1 to 23 leaves ranks with padding or with no column at all)."""
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=vocab, hidden_size=8, intermediate_size=16,
                                     num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8))
    ranks = [TensorParallel(r, size, cfg, torch.device("cpu")) for r in range(size)]
    p = ranks[0].vocab_rows
    offset = data.draw(st.sampled_from([0, -10]), label="offset")
    full = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab),
                                           min_size=rows, max_size=rows), label="logits"), dtype=dtype) + offset
    padded = torch.full((rows, size * p), 100.0, dtype=dtype)   # padding columns: far above every logit
    padded[:, :vocab] = full
    want = torch.argmax(full, dim=-1)
    for rank, got in enumerate(simulated_argmax(ranks, [padded[:, r * p:(r + 1) * p] for r in range(size)])):
        assert got.dtype == torch.int64 and torch.equal(got, want), f"rank {rank}: {got} against {want}"


def simulated_argmax(ranks: list[TensorParallel], slices: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's argmax_logits of its slice, the collective simulated in this process: a first pass records what
    each rank sends, a second hands every rank all of it."""
    sent = {}
    for tp in ranks:
        object.__setattr__(tp, "all_gather", lambda x, r=tp.rank: sent.setdefault(r, x).expand(len(ranks), *x.shape))
        tp.argmax_logits(slices[tp.rank])
    gathered = torch.stack([sent[r] for r in range(len(ranks))])
    for tp in ranks:
        object.__setattr__(tp, "all_gather", lambda x: gathered)
    return [tp.argmax_logits(slices[tp.rank]) for tp in ranks]


@pytest.mark.parametrize("row", [
    [-math.inf] * 7, [1.0, math.nan, 3.0, math.nan, 2.0, 0.0, 1.0], [1.0, 2.0, 3.0, 9.0, math.nan, 9.0, 1.0],
    [math.inf, 2.0, math.nan, math.inf, 0.0, 1.0, 3.0], [0.0, 1.0, 2.0, 3.0, 4.0, math.inf, math.inf]])
def test_argmax_over_the_vocabulary_slices_takes_nan_and_infinities_as_torch_argmax_does(row):
    """torch.argmax takes the first NaN as the largest, and the first of equal infinities; with 3 ranks of slices
    of 3 over a vocabulary of 7, the last slice is padded and NaN or infinity can sit in any slice."""
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=7, hidden_size=8, intermediate_size=16,
                                     num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8))
    ranks = [TensorParallel(r, 3, cfg, torch.device("cpu")) for r in range(3)]
    full = torch.tensor([row])
    padded = torch.cat([full, torch.zeros(1, 2)], dim=1)
    for got in simulated_argmax(ranks, [padded[:, 3 * r:3 * r + 3] for r in range(3)]):
        assert got.tolist() == torch.argmax(full, -1).tolist()


def _two_rank_tp(device: str) -> TensorParallel:
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8))
    return TensorParallel(0, 2, cfg, torch.device(device))


def test_the_custom_all_reduce_is_on_by_default_and_built_unless_opted_out():
    """On by default (as vLLM's and SGLang's on NVLink GPUs); custom_all_reduce=False keeps NCCL for every sum."""
    from chunkwise.engine.executor.workers import with_configured_all_reduce
    tp = SimpleNamespace(with_custom_all_reduce=lambda dtype, timeout: "built")
    assert EngineConfig("m").custom_all_reduce is True
    assert with_configured_all_reduce(tp, EngineConfig("m")) == "built"
    assert with_configured_all_reduce(tp, EngineConfig("m", custom_all_reduce=False)) is tp


def test_the_custom_all_reduce_is_off_on_cpu_without_a_warning():
    """Off CUDA (gloo) it never runs and is never expected to: every all-reduce stays with the process group, and
    the default says nothing."""
    from datetime import timedelta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _two_rank_tp("cpu").with_custom_all_reduce(torch.float32, timedelta(seconds=1)).custom is None


def test_the_custom_all_reduce_off_on_gpus_that_cannot_run_it_says_why(monkeypatch):
    """On CUDA devices without it (no peer access or NVLink atomics, N outside 2..8), a warning names the reason
    and NCCL serves every all-reduce."""
    from datetime import timedelta
    import chunkwise.engine.distributed.tensor_parallel as tensor_parallel
    monkeypatch.setattr(tensor_parallel, "unusable", lambda rank, size, device: "cuda:0 cannot access cuda:1's memory")
    with pytest.warns(UserWarning, match="custom all-reduce off, NCCL serves every all-reduce: cuda:0 cannot access"):
        assert _two_rank_tp("cuda:0").with_custom_all_reduce(torch.bfloat16, timedelta(seconds=1)).custom is None


@pytest.mark.parametrize("max_rows, budget, max_model_len", [
    (1024, 8192, 4096), (1000, 8192, 512), (1024, 1040, 4096), (1024, 1024, 4096), (1007, 1008, 64),
    (1008, 1010, 2048)])
def test_the_warm_up_reaches_every_token_class_above_the_custom_all_reduce(max_rows, budget, max_model_len):
    """Steps of more rows than the custom all-reduce holds take NCCL and the unfused norm, which the small warm-up
    steps never reach: the warm-up adds one step of each token class Triton specialises on (a multiple of 16 or
    not) that a real step above that bound can fall in, within the step budget, no sequence longer than a real
    one."""
    from types import SimpleNamespace as NS
    runner = NS(model=NS(tp=NS(custom=NS(max_rows=max_rows))),
                engine_config=NS(max_model_len=max_model_len, max_num_batched_tokens=budget))
    prefills = ModelRunner._above_custom_all_reduce(runner)
    totals = [sum(chunks) for chunks in prefills]
    assert all(max_rows < t <= budget for t in totals), totals
    assert all(0 < n <= max_model_len for chunks in prefills for n in chunks), prefills
    reachable = {t % 16 == 0 for t in range(max_rows + 1, budget + 1)}
    assert sorted(t % 16 == 0 for t in totals) == sorted(reachable), (totals, reachable)


def test_each_rank_caches_only_its_kv_heads(case):
    name, _, tp, one, _ = case
    cfg = tp.model_config
    local = cfg.num_kv_heads // 2 if cfg.num_kv_heads >= 2 else 1
    assert tp.executor.runner.kv.layers[0][0].shape[2] == local
    assert one.executor.runner.kv.layers[0][0].shape[2] == cfg.num_kv_heads


def test_greedy_tokens_equal_the_reference(case):
    name, _, tp, _, ref = case
    prompts = prompts_for(tp.model_config.vocab_size)
    got = [o.token_ids for o in tp.generate(prompts, GREEDY, chunk_sizes=CHUNKS)]
    assert_same_tokens(ref, prompts, got, [o.token_ids for o in ref.generate(prompts, GREEDY)],
                       f"{name}, tensor_parallel_size=2, page_size=3, chunks {CHUNKS}")
    assert tp.page_pool.num_free_pages == tp.page_pool.num_pages


@pytest.mark.slow
def test_greedy_tokens_equal_one_rank(case):
    name, _, tp, one, ref = case
    prompts = prompts_for(tp.model_config.vocab_size)
    assert_same_tokens(ref, prompts, [o.token_ids for o in tp.generate(prompts, GREEDY, chunk_sizes=CHUNKS)],
                       [o.token_ids for o in one.generate(prompts, GREEDY, chunk_sizes=CHUNKS)],
                       f"{name}, tensor_parallel_size=2 against 1, page_size=3, chunks {CHUNKS}")


# The gather does not depend on the attention's shape: mqa's odd vocabulary (383, uneven slices) and gemma3's
# tied head (the embedding's slices) are the cases that differ at the logits.
@pytest.mark.parametrize("case", ["mqa", "gemma3"], indirect=True)
@pytest.mark.parametrize("asks", ["logprobs", "sampling"])
def test_logprobs_and_sampled_requests_get_the_whole_logits_as_one_rank_has_them(case, asks):
    """Greedy tokens come from each rank's vocabulary slice; a step whose rows ask for logprobs (greedy or not)
    or sample gathers the whole logits first. Logprobs and seeded samples then match one rank's (float32: the
    logits differ only in their last bits), beside a plain greedy request in the same steps."""
    name, _, tp, one, _ = case
    prompts = prompts_for(tp.model_config.vocab_size)[:2]
    first = (SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3) if asks == "logprobs" else
             SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, top_k=20, seed=7))
    params = [first, SamplingParams(max_tokens=5, ignore_eos=True)]
    runner_tp = tp.executor.runner.model.tp
    all_gather, widths = runner_tp.all_gather, []

    def all_gather_counted(x):
        widths.append(x.shape[-1])
        return all_gather(x)
    object.__setattr__(runner_tp, "all_gather", all_gather_counted)
    try:
        if asks == "logprobs":   # once per model: greedy steps alone
            greedy_only = tp.generate(prompts, [params[1]] * 2)
            greedy_widths, widths[:] = widths[:], []
            # Greedy steps gather [rows, 2] (the slices' maxima) and nothing as wide as a vocabulary slice.
            assert greedy_widths and set(greedy_widths) == {2}, greedy_widths
            assert [o.token_ids for o in greedy_only] == [o.token_ids for o in one.generate(prompts, [params[1]] * 2)]
        got, want = tp.generate(prompts, params), one.generate(prompts, params)
    finally:
        object.__delattr__(runner_tp, "all_gather")
    assert runner_tp.vocab_rows in widths, widths
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"{name} request {i}: {g.token_ids} against one rank's {w.token_ids}"
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), f"{name} request {i}: {a}, {b}"
    assert [g.logprobs is None for g in got] == [asks != "logprobs", True]


def test_prefill_kv_gathers_every_kv_head_once(case):
    name, _, tp, one, ref = case
    prompt = prompts_for(tp.model_config.vocab_size)[2]
    got = tp.prefill_kv(prompt, chunk_sizes=CHUNKS[2])
    cfg = tp.model_config
    assert got[0].shape == (cfg.num_layers, len(prompt), cfg.num_kv_heads, cfg.head_dim)
    for against, want in (("tensor_parallel_size=1", one.prefill_kv(prompt, chunk_sizes=CHUNKS[2])),
                          ("the reference", ref.prefill_kv(prompt))):
        for kv, a, b in zip("KV", got, want):
            msg = kv_mismatch(a, b, kv)
            assert msg is None, f"{name}: {msg} (tensor_parallel_size=2 against {against})"

