"""The engine core's own contract: token ids out (no text), prefix jobs that sample nothing and leave no page
behind, a stats snapshot that counts what the pool holds, and a server that reads the engine through it."""
import ast
from pathlib import Path

import pytest

from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.core import CoreOutput, PrefixOutput

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 9, 14, 3, 22, 8, 17, 30, 31, 32]   # 10 tokens: 2 full pages of 4, and 2 tokens over
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(request, ckpt):
    return Engine(ckpt, page_size=4, num_pages=16, max_model_len=64, async_scheduling=request.param)


def drain(engine, rid) -> list:
    """The core's outputs for request `rid` until its last one."""
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.core.step() if o.request_id == rid]
    return outs


def test_core_outputs_carry_token_ids_and_no_text(engine):
    request = engine.frontend.requests([PROMPT], GREEDY)[0]
    rid = engine.core.add_requests([request])[0]
    outs = drain(engine, rid)
    assert all(type(o) is CoreOutput and not hasattr(o, "new_text") for o in outs)
    final = outs[-1].output
    assert final.token_ids == [t for o in outs for t in o.new_token_ids] and len(final.token_ids) == 4
    assert final.text == ""
    assert final.token_ids == engine.generate([PROMPT], GREEDY)[0].token_ids


def test_a_prefix_job_samples_nothing_caches_its_full_pages_and_frees_the_rest(engine):
    free_before = engine.page_pool.num_free_pages
    cached_before = engine.stats().pages_cached
    request = engine.frontend.requests([PROMPT + [77]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    rid = engine.core.compute_prefix(request)
    outs = drain(engine, rid)
    assert [type(o) for o in outs] == [PrefixOutput] and outs[0].error is None and outs[0].kv is None
    assert not engine.has_unfinished()
    assert engine.page_pool.num_free_pages == free_before, "a prefix job kept a page"
    assert len(engine.page_pool.chain_pages(PROMPT + [77])) == 2
    assert engine.stats().pages_cached >= cached_before
    assert engine.core.abort(rid) is None


def test_a_chunk_computed_over_several_overlapped_steps_is_pinned_whole(ckpt):
    """A prefix job is done when the step computing its last tokens is postprocessed, not when it is launched:
    under overlap scheduling its pages are cached only then."""
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=64, max_num_batched_tokens=4, async_scheduling=True)
    ids = PROMPT + [40, 41, 42, 43, 44, 45]   # 16 tokens: 4 full pages, 4 steps of the budget
    chunk = eng.register_chunk(ids, pin=True)
    assert eng.chunks.pinned[chunk.chunk_id] == eng.page_pool.chain_pages(ids) and len(eng.page_pool.pins) == 4
    out = eng.generate([[chunk, [7, 8]]], GREEDY)[0]
    assert [(r.exact, r.recomputed) for r in out.chunk_reuse] == [(16, 0), (0, 2)]
    eng.unpin(chunk)
    assert eng.stats().pages_used == 0 and eng.stats().pages_pinned == 0


def test_stats_count_waiting_running_used_cached_and_pinned_pages(ckpt):
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=64, max_num_seqs=1, async_scheduling=False)
    empty = eng.stats()
    assert (empty.num_waiting, empty.num_running, empty.num_pages, empty.pages_used, empty.pages_cached,
            empty.pages_pinned) == (0, 0, 16, 0, 0, 0)
    chunk = eng.register_chunk(PROMPT[:8], pin=True)
    assert eng.stats().pages_pinned == 2 and eng.stats().pages_used == 2 and eng.stats().pages_cached == 0
    a = eng.add_request(PROMPT, GREEDY)
    eng.add_request([40, 41, 42], GREEDY)
    assert (eng.stats().num_waiting, eng.stats().num_running) == (2, 0)
    eng.step()
    s = eng.stats()
    assert (s.num_waiting, s.num_running) == (1, 1)
    assert s.pages_used == 2 + 1   # a shares the pinned pages and holds one page for its last 2 tokens and more
    eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    eng.unpin(chunk)
    s = eng.stats()
    assert (s.num_waiting, s.num_running, s.pages_used, s.pages_pinned) == (0, 0, 0, 0)
    assert s.pages_cached == eng.page_pool.num_pages - len(eng.page_pool.free_page_ids) > 0


def test_no_server_module_reads_an_engines_scheduler_or_page_pool():
    """The server reads the engine through `stats()`: no attribute named scheduler or page_pool in chunkwise/serve/."""
    reads = []
    for path in sorted((ROOT / "chunkwise" / "serve").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "page_pool"):
                reads.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not reads, reads
