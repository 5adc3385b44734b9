"""Overlap scheduling changes when the host learns a step's tokens, never what they are: the async engine's
outputs equal the synchronous engine's, streamed and final, under stop tokens, max_tokens, logprobs, seeded
sampling, aborts mid-flight, preemption in a small pool and prefix-cache hits; and it leaks nothing. The core
streams nothing of a request after its finish or abort, not even the token its step in flight computed."""
import pytest
from hypothesis import event, example, given, note, settings, strategies as st

from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from tests.draws import costly

# Shared heads (pages of 2 tokens) for prefix-cache hits; the longest needs 7 of the pool's 10 pages, so
# two or three requests at once preempt.
PROMPTS = [[5, 9, 14, 3, 22, 8, 17], [5, 9, 14, 3, 40, 41], [60, 61, 62, 63, 64, 65, 66, 67, 68], [7, 7],
           [5, 9, 14, 3, 22, 8, 17, 30]]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def engines():
    """A sync and an async engine. One layer: the cheapest real forward. Deterministic mode: a token's bits do
    not depend on its batch-mates, which differ between the two (overlap admits a step later and computes
    a finished request's token in vain), so even logprobs compare exactly. Every decode is laid out as a
    split-KV decode, as on a GPU (deterministic mode still attends to it in one pass)."""
    ckpt = tiny_checkpoint("qwen3", num_hidden_layers=1)
    return {mode: Engine(ckpt, page_size=2, num_pages=10, max_model_len=32, max_num_batched_tokens=12,
                         deterministic=True, split_kv_threshold=0, async_scheduling=mode) for mode in (False, True)}


@pytest.fixture(scope="module")
def solo(engines):
    """Each prompt's greedy tokens alone: stop tokens are drawn from them, so that requests do stop."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engines[False].generate(PROMPTS, [params] * len(PROMPTS))]


def requests():
    """One request: (prompt, max_tokens, stop at the solo token with this index, logprobs, seed for sampling
    at temperature 1 (None: greedy), chunk size, arrival step, abort once this many tokens streamed)."""
    return st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS),
                     st.none() | st.integers(0, MAX_TOKENS - 1), st.sampled_from([None, 2]),
                     st.none() | st.integers(0, 3), st.none() | st.integers(1, 4), st.integers(0, 2),
                     st.none() | st.integers(1, MAX_TOKENS - 1))


def drive(engine, specs, solo):
    """Streams the requests through engine.step(); returns, per request, its output and its streamed tokens."""
    arrivals = sorted(range(len(specs)), key=lambda k: specs[k][6])
    rids, outputs, streamed, steps = {}, {}, {}, 0
    while arrivals or engine.has_unfinished():
        while arrivals and (specs[arrivals[0]][6] <= steps or not engine.has_unfinished()):
            k = arrivals.pop(0)
            i, max_tokens, stop_at, logprobs, seed, chunk, _, _ = specs[k]
            stop = () if stop_at is None else (solo[i][stop_at],)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop, logprobs=logprobs,
                                    temperature=0.0 if seed is None else 1.0, seed=seed)
            rids[engine.add_request(PROMPTS[i], params, chunk)] = k
            streamed[k] = []
        for o in engine.step():
            k = rids[o.request_id]
            assert k not in outputs, f"request {k} streamed after it ended"
            streamed[k] += o.new_token_ids
            if o.finished:
                outputs[k] = o.output
        steps += 1
        for rid, k in rids.items():
            abort_after = specs[k][7]
            if k not in outputs and abort_after is not None and len(streamed[k]) >= abort_after:
                outputs[k] = engine.abort(rid)
    pool = engine.page_pool
    assert pool.num_free_pages == pool.num_pages, "pages leaked"
    assert not engine.executor.sampler.generators, "a finished request's generator was kept"
    return [(outputs[k], streamed[k]) for k in range(len(specs))]


@costly(max_examples=max(2, settings().max_examples // 5))
@given(st.lists(requests(), min_size=1, max_size=3))
# Preemption in the 10-page pool (both modes); request 0 stops on its 3rd token while its next step runs (a
# wasted token under overlap), request 1 is aborted mid-flight, request 2 asks for logprobs and arrives late
# enough to hit request 0's cached head.
@example([(0, 5, 2, None, None, None, 0, None), (2, 5, None, None, None, 3, 0, 2), (4, 4, None, 2, None, None, 2, None),
          (3, 5, None, None, None, None, 0, None)])
# Seeded sampling beside greedy decodes, a late arrival, max_tokens 1.
@example([(1, 4, None, None, 3, 2, 0, None), (3, 1, None, None, None, None, 1, None),
          (0, 5, 0, None, None, 1, 2, None)])
def test_async_outputs_equal_sync_outputs(engines, solo, specs):
    sync, overlap = (drive(engines[mode], specs, solo) for mode in (False, True))
    for k, ((s, s_streamed), (a, a_streamed)) in enumerate(zip(sync, overlap)):
        note(f"request {k} {specs[k]}: sync {s.token_ids} {s.finish_reason}, async {a.token_ids} {a.finish_reason}")
        event(f"finish reason {s.finish_reason}")
        assert a_streamed == a.token_ids and s_streamed == s.token_ids, "streamed tokens differ from the output"
        abort_after = specs[k][7]
        if abort_after is None:
            assert (a.token_ids, a.finish_reason, a.logprobs) == (s.token_ids, s.finish_reason, s.logprobs), \
                f"request {k}"
            continue
        # Aborted as soon as it had streamed abort_after tokens. One step() call may deliver two steps' tokens
        # under overlap (the one in flight, then a step with logprobs or seeded sampling postprocessed at once),
        # so it may hold one token more there; the tokens both hold are the same.
        for out in (s, a):
            assert out.finish_reason != "abort" or len(out.token_ids) >= abort_after
        n = min(len(a.token_ids), len(s.token_ids))
        assert a.token_ids[:n] == s.token_ids[:n], f"request {k}"
        if s.logprobs is not None:
            assert a.logprobs[:n] == s.logprobs[:n], f"request {k}"


def core_outputs(core, rid, steps: int) -> list:
    """The core's outputs for request `rid` over `steps` calls of `core.step()` (a call after its finish too)."""
    return [o for _ in range(steps) for o in core.step() if o.request_id == rid]


def test_a_request_finished_by_a_stop_token_gets_no_token_from_the_step_launched_before_its_finish(engines, solo):
    """Under overlap the step after the one that samples a stop token is launched before the host learns that
    token: the request is in it and computes a token in vain. The core streams nothing of it: the request's
    outputs end with the stop token, whatever steps run after. (The facade drops outputs of a finished request,
    so only the core's own outputs show it; the server's driver sends those as they are.)"""
    engine = engines[True]
    core = engine.core
    tokens = solo[0]
    stop = tokens[2]
    expected = tokens[:tokens.index(stop) + 1]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=(stop,))
    rid = core.add_requests(engine.frontend.requests([PROMPTS[0]], params))[0]
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in core.step() if o.request_id == rid]
    # The precondition of a wasted token: the step launched before the stop token was known holds the request.
    assert core._in_flight is not None and rid in [s.seq_id for s in core._in_flight.batch.seqs]
    outs += core_outputs(core, rid, 2)   # postprocesses that step, then an idle one
    assert [o.new_token_ids for o in outs] == [[t] for t in expected], "a token streamed after the stop token"
    assert [o.finished for o in outs] == [False] * (len(expected) - 1) + [True]
    assert outs[-1].finish_reason == "stop" and outs[-1].output.token_ids == expected
    assert not core.has_unfinished() and core._in_flight is None
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages, "pages leaked"


def test_a_request_aborted_while_its_step_runs_gets_no_token_from_that_step(engines, solo):
    """An abort between steps, under overlap, ends a request whose next step is on the device: its abort output
    holds the tokens streamed so far and the core streams nothing of it after, not the token that step computed."""
    engine = engines[True]
    core = engine.core
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    rid = core.add_requests(engine.frontend.requests([PROMPTS[2]], params))[0]
    outs = []
    while len(outs) < 2:
        outs += [o for o in core.step() if o.request_id == rid]
    assert core._in_flight is not None and rid in [s.seq_id for s in core._in_flight.batch.seqs]
    aborted = core.abort(rid)
    assert aborted.finish_reason == "abort" and aborted.output.token_ids == solo[2][:2]
    assert core_outputs(core, rid, 2) == [], "the aborted request's token in flight was streamed"
    assert not core.has_unfinished() and core._in_flight is None
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages, "pages leaked"
