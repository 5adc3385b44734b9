"""Tensor parallelism (CPU, gloo, float32) through the engine's other decode paths and modes, against one rank:
split-KV and cascade decodes on each rank's heads, deterministic mode's bitwise promise on two ranks, and four ranks
sharing two KV heads (each replicated on two ranks).
`slow`: each test starts its own tensor-parallel engines (one per process at a time, so not beside the module
engines of tests/test_tensor_parallel.py).
"""
from __future__ import annotations

import pytest
from parity_report import assert_same_tokens, kv_mismatch

import chunkwise.reference
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams

pytestmark = [pytest.mark.correctness, pytest.mark.slow]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def test_split_kv_and_cascade_decodes_equal_one_rank(random_prompt):
    """Decodes through split-KV (threshold 0, 64-token splits) on each rank's heads, and, for prompts that share
    a cached 68-token prefix, through cascade attention (its groups travel with the step to the worker)."""
    ckpt = tiny_checkpoint("qwen3")
    kw = dict(page_size=4, max_model_len=128, num_pages=128, max_num_batched_tokens=128, split_kv_threshold=0,
              split_size=64)
    base = random_prompt(70, 384, seed=1)
    prompts = [base + [10 + i, 20 + i] for i in range(3)]
    with Engine(ckpt, tensor_parallel_size=2, **kw) as tp:
        cascades = []
        prepare = tp.runner.prepare

        def spy(batch):
            host, sampled = prepare(batch)
            cascades.append(host.cascade is not None)
            return host, sampled
        tp.runner.prepare = spy
        got = [tp.generate([prompts[0]], GREEDY)[0].token_ids]   # caches the shared prefix's pages
        got += [o.token_ids for o in tp.generate(prompts[1:], GREEDY)]
    one = Engine(ckpt, **kw)
    want = [one.generate([prompts[0]], GREEDY)[0].token_ids] + [o.token_ids for o in one.generate(prompts[1:], GREEDY)]
    assert any(cascades), "no step took cascade attention: the test lost its power"
    assert_same_tokens(chunkwise.reference.Engine(ckpt, max_model_len=128), prompts, got, want,
                       "qwen3, tensor_parallel_size=2 against 1, split-KV and cascade decodes")


@pytest.mark.parametrize("case", ["TIGHT", "MIXED"])
def test_deterministic_mode_holds_on_two_ranks(case, random_prompt):
    """Two ranks sum each element once (a + b on both), so deterministic mode's promise holds: every token and
    every K/V bit as the prompt alone and unchunked gives, under preemption, chunking and batching."""
    import test_deterministic as det
    from deterministic_cases import assert_bitwise, run_case, solo_run

    ckpt = tiny_checkpoint("qwen3")
    prompts = [random_prompt(n, det.VOCAB, seed=i) for i, n in enumerate(det.PROMPT_LENS[:3])]
    kw = dict(max_model_len=det.MAX_MODEL_LEN, tensor_parallel_size=2)
    tokens, kv = solo_run(ckpt, prompts, det.MAX_TOKENS, **kw)
    scenario = getattr(det, case)
    assert_bitwise(run_case(ckpt, prompts, scenario, det.MAX_TOKENS, **kw), scenario, tokens, kv)


def test_four_ranks_replicate_each_of_two_kv_heads(random_prompt):
    """Four ranks over 4 query / 2 KV heads: each KV head lives on two ranks (ranks 0-1 hold head 0, 2-3 head 1),
    each rank one query head; prefill_kv takes each KV head once, from ranks 0 and 2."""
    ckpt = tiny_checkpoint("llama")
    prompts = [random_prompt(n, 384, seed=n) for n in (3, 11)]
    chunks = [None, [4, 7]]
    ref = chunkwise.reference.Engine(ckpt, max_model_len=64)
    with Engine(ckpt, tensor_parallel_size=4, page_size=3, max_model_len=64, num_pages=32) as tp:
        got = [o.token_ids for o in tp.generate(prompts, GREEDY, chunk_sizes=chunks)]
        kv = tp.prefill_kv(prompts[1], chunk_sizes=chunks[1])
    assert_same_tokens(ref, prompts, got, [o.token_ids for o in ref.generate(prompts, GREEDY)],
                       "llama 4/2 heads, tensor_parallel_size=4")
    for name, a, b in zip("KV", kv, ref.prefill_kv(prompts[1])):
        msg = kv_mismatch(a, b, name)
        assert msg is None, f"tensor_parallel_size=4 against the reference: {msg}"
