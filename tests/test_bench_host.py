"""The benchmarks' CPU tier (benchmarks/bench_host.py) on tiny counts: its engine runs the stand-in forward
(chunkwise/engine/stand_in_model.py) through `Engine.model_class`, with Model's signatures, so its steps succeed;
a step that fails, or a loop that never reaches its state, fails the benchmark at once instead of spinning."""
import inspect

import pytest

from benchmarks.bench_host import (MAX_MODEL_LEN, HostOnlyEngine, checked, decode_params, host_only_engine,
                                   prefill_all, step_until, submit)
from chunkwise.engine.model import Model
from chunkwise.engine.stand_in_model import HashLogitsModel

NUM_SEQS, PROMPT_LEN, BUDGET = 4, 10, 16   # the prompts take three steps of the budget
# The harness's logic, on the host wherever the suite runs: on a GPU machine a module's engine may hold the memory.
DEVICE = "cpu"


def test_the_stand_in_has_the_models_constructor_and_forward_signatures():
    assert inspect.signature(HashLogitsModel.__init__) == inspect.signature(Model.__init__)
    assert inspect.signature(HashLogitsModel.forward) == inspect.signature(Model.forward)


def decoded(sampling: str, steps: int) -> list[list[int]]:
    """Each sequence's tokens after prefilling and `steps` decode steps, each of which decodes every sequence."""
    eng = host_only_engine(NUM_SEQS, max_num_batched_tokens=BUDGET, device=DEVICE)
    assert isinstance(eng.executor.runner.model, HashLogitsModel)
    submit(eng, decode_params(sampling, PROMPT_LEN), NUM_SEQS, PROMPT_LEN)
    tokens = {o.request_id: list(o.new_token_ids) for o in prefill_all(eng, NUM_SEQS, PROMPT_LEN)}
    for _ in range(steps):
        outs = checked(eng.step())
        assert sorted(o.request_id for o in outs) == sorted(tokens) and all(len(o.new_token_ids) == 1 for o in outs)
        assert not any(o.finished for o in outs)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    return [tokens[r] for r in sorted(tokens)]


@pytest.mark.parametrize("sampling", ["greedy", "top-p"])
def test_the_host_only_engine_prefills_every_prompt_then_decodes_every_sequence_each_step(sampling):
    tokens = decoded(sampling, steps=3)
    assert tokens == decoded(sampling, steps=3)            # the same tokens every run
    assert len({t for seq in tokens for t in seq}) > 1     # and not one token over and over


class FailingModel(HashLogitsModel):
    def forward(self, inp, kv_caches, place=True):
        raise RuntimeError("the forward broke")


class FailingEngine(HostOnlyEngine):
    model_class = FailingModel


def test_a_step_that_fails_its_requests_fails_the_loop_naming_the_error():
    eng = FailingEngine("tiny-qwen3", max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS, max_num_batched_tokens=BUDGET,
                        device=DEVICE)
    submit(eng, decode_params("greedy", PROMPT_LEN), NUM_SEQS, PROMPT_LEN)
    with pytest.raises(AssertionError, match=r"a step failed requests \[0, 1.*RuntimeError.*the forward broke"):
        prefill_all(eng, NUM_SEQS, PROMPT_LEN)


def test_a_loop_that_never_gets_there_stops_at_its_step_cap():
    eng = host_only_engine(NUM_SEQS, max_num_batched_tokens=BUDGET, device=DEVICE)
    submit(eng, decode_params("greedy", PROMPT_LEN), NUM_SEQS, PROMPT_LEN)
    seen = []
    with pytest.raises(AssertionError, match=r"not done after 5 steps \(waiting: 0, running: 4\)"):
        step_until(eng, lambda outs: seen.append(outs) and False, max_steps=5)
    assert len(seen) == 5


def test_the_prefill_loop_allows_twice_the_budgets_steps_plus_one():
    """A prompt computed one token a step is prefilled in its 8th step, within the cap; three prompts of which the
    engine runs two at once never all decode together, and the loop stops at 2 * ceil(30 / 16) + 1 steps."""
    eng = host_only_engine(1, max_num_batched_tokens=1, device=DEVICE)
    submit(eng, decode_params("greedy", 8), 1, 8)
    assert len(prefill_all(eng, 1, 8)) == 1
    eng = host_only_engine(2, max_num_batched_tokens=BUDGET, device=DEVICE)
    submit(eng, decode_params("greedy", PROMPT_LEN), 3, PROMPT_LEN)
    with pytest.raises(AssertionError, match=r"not done after 5 steps \(waiting: 1, running: 2\)"):
        prefill_all(eng, 3, PROMPT_LEN)


def test_a_stand_in_model_is_refused_by_name_under_tensor_parallelism():
    with pytest.raises(ValueError, match="model_class HashLogitsModel is not supported with tensor_parallel_size=2"):
        HostOnlyEngine("tiny-qwen3", max_model_len=64, tensor_parallel_size=2)


@pytest.mark.parametrize("mode", ["plain", "exact", "blend r=0.15", "chunk-heads r=0.15"])
def test_a_composed_request_runs_on_the_host_only_engine_and_reports_its_reuse(mode):
    """The composed-request benchmark's body on tiny counts: each mode reaches its first token, the stand-in forward's
    time is counted apart, and what the request reused is the mode's (a blend's stand-in selection keeps the
    check layers' counts: every chunk token after the exact first document is blended or recomputed)."""
    import random

    from benchmarks.bench_host import COMPOSED_MODES, composed_engine, composed_host_seconds, composed_prompt
    from chunkwise.engine.blend import check_ratios, num_kept

    page, doc_len, per_request, question = 16, 32, 3, 8
    eng, docs = composed_engine(doc_len, num_docs=4, per_request=per_request, question_len=question, device=DEVICE)
    prompt, reuse = composed_prompt(docs, random.Random(0), COMPOSED_MODES[mode], eng.model_config.vocab_size,
                                    per_request, question)
    host, forward, out = composed_host_seconds(eng, prompt, reuse)
    assert host > 0 and forward > 0 and len(out.token_ids) == 1
    if mode == "plain":
        assert out.chunk_reuse is None and out.num_cached_tokens == doc_len   # the first document's pages
        return
    first, *rest = out.chunk_reuse
    assert (first.exact, first.blended, first.recomputed) == (doc_len, 0, 0)
    chunks = rest[:-1]
    if mode == "exact":
        assert all(r.exact == r.blended == 0 for r in chunks)
        return
    candidates = sum(r.blended + r.recomputed for r in chunks)   # every chunk token: each page is cached
    assert candidates == (per_request - 1) * doc_len
    recomputed = sum(r.recomputed for r in chunks)
    if mode == "chunk-heads r=0.15":
        assert [r.recomputed for r in chunks] == [round(0.15 * doc_len)] * (per_request - 1)
    else:   # the last check layer's count
        assert recomputed == num_kept(check_ratios(0.15, 4)[-1], candidates) == num_kept(0.15, candidates)
    assert rest[-1].recomputed == question and page == eng.page_size


@pytest.mark.parametrize("mode", ["blend r=0.15", "chunk-heads r=0.15"])
def test_a_blend_staged_into_a_blend_graphs_static_inputs_selects_as_the_eager_step(mode):
    """The benchmark's "staged" blends (the blend graphs' staging, as a GPU runs a blended step, the stand-in over
    the static inputs where the graph would be replayed) take the graph path and give the eager step's token and
    report: the stand-in's padded selection keeps the rows its eager selection keeps."""
    import random

    from benchmarks.bench_host import COMPOSED_MODES, composed_engine, composed_host_seconds, composed_prompt

    outs = []
    for staged in (False, True):
        eng, docs = composed_engine(32, num_docs=4, per_request=3, question_len=8, staged=staged, device=DEVICE)
        prompt, reuse = composed_prompt(docs, random.Random(0), COMPOSED_MODES[mode], eng.model_config.vocab_size, 3, 8)
        outs.append(composed_host_seconds(eng, prompt, reuse)[2])
        assert eng.executor.runner.launches["blend", "graph"] == staged   # an eager blended step counts as mixed
    eager, staged = outs

    def counts(out):
        return [(r.exact, r.blended, r.recomputed) for r in out.chunk_reuse]

    assert staged.token_ids == eager.token_ids and counts(staged) == counts(eager)
    assert sum(r.blended for r in staged.chunk_reuse) > 0
