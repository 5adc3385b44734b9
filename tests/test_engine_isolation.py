"""A bad request or a failing step never hurts the engine: clear errors before anything is queued, faults
inside a step contained to that step's requests, threads sharing one engine, one EngineConfig.

The engines here schedule with overlap (as on a GPU), so a fault may strike a step while the one before it
is still in flight; the fault state machine draws the synchronous engine too."""
import threading

import pytest
import torch
from hypothesis import given, note, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import chunkwise.reference
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine_config import REFERENCE_IGNORED, EngineConfig
from chunkwise.engine import Engine, SamplingParams

PROMPTS = [[5, 9, 14, 3, 22, 8, 17], [5, 9, 14, 3, 40, 41], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [7, 7]]
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)



@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine(ckpt, page_size=4, num_pages=40, max_model_len=64, async_scheduling=True)


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt's greedy tokens when it runs alone."""
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def assert_idle_and_whole(eng):
    assert not eng.has_unfinished()
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages, "pages leaked"
    assert not eng.executor.sampler.generators, "a finished request's generator was kept"
    eng.executor.runner.tables.apply(eng.page_pool.take_changes())   # the releases the next step would carry
    assert not eng.executor.runner.tables.seq_ids, "a finished request kept its page-table row"


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.generate([[1, 2]], GREEDY, chunk_sizes=2.5), TypeError, "chunk_sizes must be .* got float 2.5"),
    (lambda e: e.generate([[1, 2]], GREEDY, chunk_sizes=[2.5, 7.5]), TypeError, r"chunk_sizes\[0\] is float 2.5"),
    (lambda e: e.generate([[1, 2]], GREEDY, chunk_sizes={0: [1, 1]}), TypeError, "got dict"),
    (lambda e: e.generate([[1, 2, 3]], GREEDY, chunk_sizes=[1, 2]), ValueError, r"pass \[\[1, 2\]\]"),
    (lambda e: e.generate([[1, 2]], {"max_tokens": 4}), TypeError, "sampling_params must be a SamplingParams.*dict"),
    (lambda e: e.generate([[1, 2]], SamplingParams(logprobs=1000)), ValueError, "logprobs=1000 exceeds .* 384"),
    (lambda e: e.generate([[1, 2]], SamplingParams(stop_token_ids=(3, 384))), ValueError, r"stop_token_ids \[384\]"),
    (lambda e: e.add_request([[1, 2], [3]], GREEDY), TypeError, r"expected one prompt .* got list \[\[1, 2\], \[3\]\]"),
    (lambda e: e.add_request([], GREEDY), ValueError, "prompt 0 is empty"),
    (lambda e: e.abort(12345), ValueError, "no request with id 12345"),
])
def test_bad_request_is_refused_by_name_and_leaves_the_engine_whole(engine, solo, call, error, match):
    with pytest.raises(error, match=match):
        call(engine)
    assert_idle_and_whole(engine)
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == solo[0]


def test_request_larger_than_the_pool_names_its_prompt(ckpt):
    eng = Engine(ckpt, page_size=4, num_pages=5, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1: 30 prompt tokens .* need 8 pages .* pool has 5 \(num_pages\)"):
        eng.generate([[1] * 3, [1] * 30], SamplingParams(max_tokens=2))
    assert_idle_and_whole(eng)


@pytest.mark.parametrize("kw, error, match", [
    (dict(page_size=10 ** 9), ValueError, r"page_size=1000000000: one page of KV cache takes"),
    (dict(gpu_memory_utilization=5.0), ValueError, "gpu_memory_utilization must be a number in \\(0, 1\\], got 5.0"),
    (dict(device="meta"), ValueError, "device 'meta' is not supported"),
    (dict(device="nonsense"), ValueError, "device 'nonsense' is not a device"),
    (dict(enable_prefix_caching="yes"), ValueError, "enable_prefix_caching must be a bool"),
    (dict(split_size=100), ValueError, "split_size must be a multiple of 64"),
    (dict(max_num_seqs=True), ValueError, "max_num_seqs must be an integer >= 1, got True"),
    (dict(num_pagse=4), TypeError, "num_pagse"),
])
def test_bad_engine_argument_is_refused_by_name(ckpt, kw, error, match):
    with pytest.raises(error, match=match):
        Engine(ckpt, max_model_len=64, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(ckpt):
    with pytest.raises(ValueError, match="CUDA is not available"):
        Engine(ckpt, device="cuda")


def test_reference_engine_validates_the_same_fields_and_ignores_the_paging_ones(ckpt):
    with pytest.raises(TypeError, match="num_pagse"):
        chunkwise.reference.Engine(ckpt, num_pagse=4)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        chunkwise.reference.Engine(ckpt, page_size=0)
    assert set(REFERENCE_IGNORED) < set(EngineConfig.__dataclass_fields__)
    paged = chunkwise.reference.Engine(ckpt, page_size=3, num_pages=7, split_size=64, tensor_parallel_size=2, max_model_len=64)
    plain = chunkwise.reference.Engine(ckpt, max_model_len=64)
    assert [o.token_ids for o in paged.generate(PROMPTS[:2], GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS[:2], GREEDY)]


def test_engine_config_is_frozen_and_resolved(ckpt):
    cfg = Engine(ckpt, max_model_len=64, num_pages=8).engine_config
    assert cfg.dtype == torch.float32 and cfg.device.type in ("cpu", "cuda") and cfg.max_model_len == 64
    with pytest.raises(AttributeError):
        cfg.page_size = 8


def test_default_cpu_pool_is_sized_for_the_running_sequences_not_the_ram(ckpt):
    eng = Engine(ckpt, device="cpu", max_model_len=64, max_num_seqs=4, page_size=8)
    assert eng.page_pool.num_pages == 4 * 8


def fail_on(engine, monkeypatch, part: str, when):
    """Make executor.<part> raise whenever when() is true."""
    real = getattr(engine.executor, part)

    def faulty(*args, **kwargs):
        if when():
            raise RuntimeError(f"injected fault in {part}")
        return real(*args, **kwargs)
    monkeypatch.setattr(engine.executor, part, faulty)


@pytest.mark.parametrize("part", ["execute", "sample"])
def test_a_failing_step_ends_only_its_requests_with_the_error(engine, solo, monkeypatch, part):
    calls = []
    fail_on(engine, monkeypatch, part, lambda: calls.append(1) or len(calls) == 2)
    outs = engine.generate(PROMPTS[:2], GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all(f"injected fault in {part}" in o.error for o in outs)
    assert all(o.token_ids == s[:len(o.token_ids)] for o, s in zip(outs, solo))
    assert_idle_and_whole(engine)
    monkeypatch.undo()
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == solo


@pytest.mark.parametrize("part", ["execute", "sample"])
def test_a_failing_step_leaves_the_step_before_it_whole(engine, solo, monkeypatch, part):
    """Under overlap the step before a failing one may still be in flight when it fails: that step is
    postprocessed as if nothing had failed. Here it gives request 0 its last token (request 0 is not in the
    third step, which fails), and request 1 ends with the tokens of the steps before the failing one."""
    calls = []
    fail_on(engine, monkeypatch, part, lambda: calls.append(1) or len(calls) == 3)
    outs = engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, ignore_eos=True), GREEDY])
    assert (outs[0].token_ids, outs[0].finish_reason) == (solo[0][:2], "length")
    assert (outs[1].token_ids, outs[1].finish_reason) == (solo[1][:2], "error")
    assert_idle_and_whole(engine)


def test_a_step_failing_to_launch_still_releases_the_page_table_rows_it_carried(engine, monkeypatch):
    """The step after a request finishes carries the release of its page-table row; when that step fails before
    the runner applied its page changes, the release goes out again with the next ones: an idle engine holds no
    row."""
    short = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True))
    long = engine.add_request(PROMPTS[1], GREEDY)
    finished = []
    while short not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    fail_on(engine, monkeypatch, "execute", lambda: True)
    outs = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in outs] == [(long, "error")]
    monkeypatch.undo()
    assert_idle_and_whole(engine)


CONTEXT: dict = {}   # the engine, the solo outputs and the fault switch of the running state machine


class FaultyTraffic(RuleBasedStateMachine):
    """Arrivals, steps, aborts and injected faults in any order: a request either finishes with exactly
    the tokens it makes alone, or ends by abort/error with a prefix of them; the pool ends whole."""

    @initialize(overlap=st.booleans())
    def setup(self, overlap):
        self.engine, self.solo = CONTEXT["engines"][overlap], CONTEXT["solo"]
        self.live: dict[int, int] = {}      # request id -> prompt index
        self.got: dict[int, list[int]] = {}

    @rule(i=st.integers(0, len(PROMPTS) - 1), chunk=st.one_of(st.none(), st.integers(1, 5)))
    def arrive(self, i, chunk):
        rid = self.engine.add_request(PROMPTS[i], GREEDY, chunk)
        self.live[rid] = i
        self.got[rid] = []

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(fault=st.sampled_from([None, "execute", "sample"]))   # which part of the step raises, if any
    def step(self, fault):
        CONTEXT["fault"] = fault
        for r in self.engine.step():
            i = self.live[r.request_id]
            self.got[r.request_id] += r.new_token_ids
            assert self.got[r.request_id] == self.solo[i][:len(self.got[r.request_id])]
            if r.finished:
                out = r.output
                assert out.token_ids == self.got[r.request_id]
                note(f"request {r.request_id}: {out.finish_reason}")
                if out.finish_reason == "error":
                    assert fault and f"injected fault in {fault}" in out.error
                else:
                    assert out.finish_reason == "length" and out.token_ids == self.solo[i]
                del self.live[r.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        out = self.engine.abort(rid)
        assert out.finish_reason == "abort" and out.token_ids == self.got[rid]
        del self.live[rid]

    @invariant()
    def pages_in_use_are_the_running_requests_pages(self):
        pool = self.engine.page_pool
        held = {p for s in self.engine.scheduler.running for p in s.page_table}
        assert pool.num_pages - pool.num_free_pages == len(held)

    def teardown(self):
        CONTEXT["fault"] = None
        while self.engine.has_unfinished():
            for r in self.engine.step():
                self.live.pop(r.request_id, None)
        assert not self.live, f"requests never finished: {self.live}"
        assert_idle_and_whole(self.engine)


def test_injected_faults_never_leak_pages_stall_requests_or_change_other_outputs(monkeypatch):
    # One layer and a small pool: every step is a real forward, so this is the cheapest engine that still
    # preempts and shares prefix pages. A sync and an overlap-scheduling one; solo outputs from the first.
    engines = {overlap: Engine(tiny_checkpoint("qwen3", num_hidden_layers=1), page_size=2, num_pages=24,
                               max_model_len=32, async_scheduling=overlap) for overlap in (False, True)}
    solo = [engines[False].generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    CONTEXT.update(engines=engines, solo=solo, fault=None)
    for engine in engines.values():
        fail_on(engine, monkeypatch, "execute", lambda: CONTEXT["fault"] == "execute")
        fail_on(engine, monkeypatch, "sample", lambda: CONTEXT["fault"] == "sample")
    run_state_machine_as_test(FaultyTraffic, settings=settings(max_examples=settings().max_examples,
                                                              stateful_step_count=15))


def test_threads_sharing_one_engine_get_their_own_outputs(engine, solo):
    results, errors = {}, []

    def batch(k):
        try:
            results[k] = [o.token_ids for o in engine.generate(PROMPTS[k:] + PROMPTS[:k], GREEDY)]
        except Exception as exc:   # surfaced below with the thread's index
            errors.append((k, exc))

    def stream():
        try:
            rid = engine.add_request(PROMPTS[3], GREEDY)
            toks = []
            while True:
                outs = [r for r in engine.step() if r.request_id == rid]
                toks += [t for r in outs for t in r.new_token_ids]
                if any(r.finished for r in outs):
                    break
            results["stream"] = toks
        except Exception as exc:
            errors.append(("stream", exc))

    threads = [threading.Thread(target=batch, args=(k,)) for k in range(3)] + [threading.Thread(target=stream)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread sharing the engine hung"
    assert not errors, errors
    for k in range(3):
        assert results[k] == solo[k:] + solo[:k], f"thread {k}"
    assert results["stream"] == solo[3]
    assert_idle_and_whole(engine)


@given(st.data())
def test_any_sampling_params_that_pass_validation_run_and_leave_the_engine_whole(engine, solo, data):
    """Validation is complete: whatever SamplingParams it lets through run to the end (no step fails on
    them), and the engine serves the next request as before."""
    params = SamplingParams(
        max_tokens=data.draw(st.integers(1, 3)), temperature=data.draw(st.sampled_from([0.0, 0.5, 2.0])),
        top_k=data.draw(st.integers(0, VOCAB)), top_p=data.draw(st.sampled_from([0.1, 0.9, 1.0])),
        logprobs=data.draw(st.one_of(st.none(), st.integers(0, VOCAB))), seed=data.draw(st.integers(0, 9)))
    out = engine.generate([PROMPTS[2]], params)[0]
    assert out.finish_reason in ("length", "stop"), out.error
    assert_idle_and_whole(engine)
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == solo[0]
