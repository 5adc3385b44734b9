"""chunkwise.Engine's contract beyond parity: bad input, failure and abort isolation, streaming, seeded sampling."""
import numpy as np
import pytest
import torch

import chunkwise.engine.model
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.engine import Engine, SamplingParams

PROMPTS = [[5, 9, 14, 3, 22, 8, 17], [5, 9, 14, 3, 40, 41], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)



@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine(ckpt, page_size=4, num_pages=64, max_model_len=64)


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt's greedy tokens when it runs alone."""
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("prompt, chunks, match", [
    ([], None, "prompt 0 is empty"),
    ([3, 384, 5], None, "token id 384"),
    ([3, -1, 5], None, "token id -1"),
    ([3, 2 ** 63, 5], None, "token id 9223372036854775808"),   # past int64: no bound check may overflow
    ([3, np.int64(-2), 5], None, "token id -2"),
    ([3, 4, 5], [3, 0], "chunk size 0"),
    ([3, 4, 5], [2, 2], "sum to 4"),
    ([3] * 60, None, "exceed max_model_len 64"),
])
def test_bad_request_raises_value_error_naming_the_value(engine, prompt, chunks, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], GREEDY, chunk_sizes=[chunks])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("t", [5e-324, 1e-6])
def test_a_temperature_that_vanishes_in_float32_generates_the_greedy_tokens(engine, solo, t):
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, temperature=t))[0]
    assert out.finish_reason == "length" and out.token_ids == solo[0]


@pytest.mark.parametrize("call, match", [
    (lambda e: e.generate(42, GREEDY), "prompts must be .* got int 42"),
    (lambda e: e.generate(None, GREEDY), "prompts must be .* got NoneType None"),
    (lambda e: e.generate([3.5], GREEDY), "prompt 0 must be a string or a list of token ids, got float 3.5"),
    (lambda e: e.generate([[3, True, 5]], GREEDY), "prompt 0 holds bool True, which is not an integer token id"),
    (lambda e: e.generate([[3, 4.0, 5]], GREEDY), "prompt 0 holds float 4.0, which is not an integer token id"),
    (lambda e: e.add_request(42, GREEDY), "expected one prompt .* got int 42"),
    (lambda e: e.add_request(None, GREEDY), "expected one prompt .* got NoneType None"),
    (lambda e: e.add_request([3.5], GREEDY), r"expected one prompt .* got list \[3.5\]"),
    (lambda e: e.prefill_kv(None), "expected one prompt .* got NoneType None"),
])
def test_wrong_prompt_type_raises_type_error_naming_the_value(engine, call, match):
    """Wrong types are TypeErrors, as in SamplingParams; values out of range stay ValueErrors (above)."""
    with pytest.raises(TypeError, match=match):
        call(engine)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kw, match", [
    (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
    (dict(num_pages=10 ** 12), "num_pages=1000000000000"),
    (dict(num_pages=0), "num_pages must be an integer >= 1, got 0"),
    (dict(dtype="float64"), "dtype 'float64'"),
])
def test_bad_engine_arguments_raise_value_error(ckpt, kw, match):
    with pytest.raises(ValueError, match=match):
        Engine(ckpt, **kw)


def test_numpy_integer_token_ids_are_plain_token_ids(engine, solo):
    outs = engine.generate([[np.int64(t) for t in PROMPTS[0]], np.asarray(PROMPTS[1], np.int32)], GREEDY)
    assert [o.token_ids for o in outs] == solo[:2]
    assert {type(t) for o in outs for t in o.prompt_token_ids} == {int}


def test_failed_request_leaves_other_requests_unchanged(engine, solo):
    with pytest.raises(ValueError, match="prompt 1 holds token id 999"):
        engine.generate([PROMPTS[0], [1, 999], PROMPTS[2]], GREEDY)
    assert not engine.has_unfinished()
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == solo


def test_abort_frees_pages_and_leaves_other_requests_unchanged(engine, solo):
    free = engine.page_pool.num_free_pages
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    for _ in range(2):
        done.update({r.request_id: r.output for r in engine.step() if r.finished})
    done[rids[1]] = engine.abort(rids[1])
    assert engine.abort(rids[1]) is None, "a finished request cannot be aborted again"
    while engine.has_unfinished():
        done.update({r.request_id: r.output for r in engine.step() if r.finished})
    outs = [done[r] for r in rids]
    assert outs[1].finish_reason == "abort" and len(outs[1].token_ids) < GREEDY.max_tokens
    assert outs[1].token_ids == solo[1][:len(outs[1].token_ids)]
    assert [outs[0].token_ids, outs[2].token_ids] == [solo[0], solo[2]]
    assert engine.page_pool.num_free_pages == free


def test_streaming_with_late_arrivals_matches_generate(engine, solo):
    streamed = {engine.add_request(PROMPTS[0], GREEDY): 0}
    seen: dict[int, list[int]] = {}
    finished = set()
    outputs = {}
    steps = 0
    while engine.has_unfinished() or steps == 0:
        for r in engine.step():
            seen.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finished:
                finished.add(r.request_id)
                outputs[r.request_id] = r.output
        steps += 1
        if steps in (2, 4):   # arrive while the first request decodes
            streamed[engine.add_request(PROMPTS[steps // 2], GREEDY)] = steps // 2
    assert finished == set(streamed)
    for rid, i in streamed.items():
        assert seen[rid] == solo[i], f"request {rid} (prompt {i})"
        assert outputs[rid].finish_reason == "length" and outputs[rid].token_ids == solo[i]


def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt, engine):
    params = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    other = Engine(ckpt, page_size=7, num_pages=32, max_model_len=64)
    batched = other.generate([PROMPTS[2], PROMPTS[0]],
                             [SamplingParams(max_tokens=3, temperature=1.0, seed=9), params])[1].token_ids
    assert alone == batched
    reseeded = engine.generate([PROMPTS[0]] * 3, [SamplingParams(max_tokens=5, temperature=1.0, seed=s,
                                                                 ignore_eos=True) for s in range(3)])
    assert len({tuple(o.token_ids) for o in reseeded}) > 1, "different seeds should not all agree"


def test_top_k_one_sampling_equals_greedy_and_logprobs_hold_the_token(engine, solo):
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.7, top_k=1, seed=3,
                                                       ignore_eos=True, logprobs=3))[0]
    assert out.token_ids == solo[1]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) >= 3
        assert lp[token] == pytest.approx(max(lp.values()))
        assert all(v <= 0 for v in lp.values())


def test_prefill_kv_is_bitwise_invariant_to_page_size_and_page_placement(ckpt):
    """The same chunking on another page size, in other physical pages, caches the same bits: the kernels
    tile at absolute positions, and nothing else differs between the two runs.

    Not claimed here: bitwise invariance to the chunking itself. The model's projections are torch matmuls,
    and on CPU a row's bits depend on how many rows the matmul has (measured: x[:m] @ w.T differs from
    (x @ w.T)[:m] in the last bit for m <= 3), so a 1-token chunk's K differs from the whole prompt's by ~1e-6
    before any kernel runs. Parity against the reference covers chunking within tolerance.
    """
    # No prefix caching: otherwise the second call would read the first one's pages.
    a = Engine(ckpt, page_size=4, num_pages=64, max_model_len=64, enable_prefix_caching=False)
    b = Engine(ckpt, page_size=7, num_pages=64, max_model_len=64, enable_prefix_caching=False)
    b.generate([PROMPTS[0]], GREEDY)     # its freed pages go to the back of the free list: b uses other pages
    cfg = a.model_config
    for chunks in ([1, 6, 4], None):
        ka, va = a.prefill_kv(PROMPTS[2], chunk_sizes=chunks)
        kb, vb = b.prefill_kv(PROMPTS[2], chunk_sizes=chunks)
        assert ka.shape == (cfg.num_layers, len(PROMPTS[2]), cfg.num_kv_heads, cfg.head_dim)
        assert torch.isfinite(ka).all() and torch.isfinite(va).all()
        for name, x, y in (("K", ka, kb), ("V", va, vb)):
            diff = (x != y).nonzero()
            assert not len(diff), f"chunks {chunks}: {name} differs first at (layer, position, head, dim) " \
                                  f"{diff[0].tolist()}: {x[tuple(diff[0])]} (page 4) vs {y[tuple(diff[0])]} (page 7)"
    assert not a.has_unfinished() and not b.has_unfinished()


def test_prefill_kv_serves_a_prompt_that_fills_the_whole_pool(ckpt):
    """prefill_kv computes the prompt only: a prompt of exactly num_pages pages is served, as generate serves it
    with max_tokens=1 (its prefix job samples nothing: it holds the prompt's pages until the step computing them is
    done), and it caches the bits a roomier pool caches."""
    prompt = PROMPTS[1][:4]
    tight = Engine(ckpt, page_size=2, num_pages=2, max_model_len=64)
    roomy = Engine(ckpt, page_size=2, num_pages=64, max_model_len=64)
    for eng in (tight, roomy):   # both then take the prompt's first page from the prefix cache
        assert len(eng.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids) == 1
    (k, v), (k_roomy, v_roomy) = tight.prefill_kv(prompt), roomy.prefill_kv(prompt)
    assert torch.equal(k, k_roomy) and torch.equal(v, v_roomy)
    assert tight.page_pool.num_free_pages == 2 and not tight.has_unfinished()
    with pytest.raises(ValueError, match="need 3 pages of 2 tokens, the pool has 2"):
        tight.prefill_kv(PROMPTS[1][:5])


def test_short_prefill_steps_split_their_context_and_still_match_the_reference(ckpt, reference_engine, monkeypatch,
                                                                              random_prompt):
    """Prefill steps of up to PREFILL_SPLIT_ROWS rows split their context across programs (here every 64
    positions, so 40-token chunks of a 150-token prompt merge up to three splits, beside a decoding request): greedy
    tokens equal the float32 reference's."""
    monkeypatch.setattr(chunkwise.engine.model, "PREFILL_SPLIT_SIZE", 64)
    prompts = [random_prompt(150, VOCAB, seed=1), random_prompt(9, VOCAB, seed=2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng = Engine(ckpt, page_size=16, max_model_len=160, max_num_batched_tokens=40, split_kv_threshold=0)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference_engine("qwen3").generate(prompts, params)]
