"""Composite prompts of registered chunks (chunkwise/chunks.py), exact mode, on both engines.

Exact mode's promise: a composite prompt (Chunks, text and id lists, in any order) gives the tokens of the
concatenated ids, and reuses K/V only where the prefix cache holds them under exactly the same prefix
(docs/ARCHITECTURE.md, lesson 2); `chunk_reuse` reports per piece what the cache supplied. Pinned chunks' pages
survive eviction pressure until unpinned, within `max_pinned_fraction` of the pool. Bad input (an unknown,
unpinned or foreign handle, an unknown reuse mode, the pin cap) is refused by name with nothing leaked; so are
a Blend's bad ratio or policy.
"""
from __future__ import annotations

import random
import re

import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.chunks import DEFAULT_BLEND, Blend, Chunk, ChunkReuse, blend_params, check_reuse
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine_config import EngineConfig
from chunkwise.requests import validate_requests
from tests.draws import costly

pytestmark = pytest.mark.correctness

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
MAX_MODEL_LEN = 160


def seeded_ids(length: int, seed) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@pytest.fixture(scope="module")
def ref(reference_engine):
    return reference_engine("qwen3")


_ref_tokens: dict[tuple, list[int]] = {}


def reference_tokens(ref, ids) -> list[int]:
    key = tuple(ids)
    if key not in _ref_tokens:
        _ref_tokens[key] = ref.generate([list(ids)], PARAMS)[0].token_ids
    return _ref_tokens[key]


def concat(prompt) -> list[int]:
    return [t for p in prompt for t in (p.token_ids if isinstance(p, Chunk) else p)]


def assert_pool_whole(eng: Engine) -> None:
    """No request holds a page; only the pinned chunks' pages are in use, one reference per pin."""
    assert not eng.has_unfinished()
    pool = eng.page_pool
    pins: dict[int, int] = {}
    for pages in eng.chunks.pinned.values():
        for p in pages:
            pins[p] = pins.get(p, 0) + 1
    assert pool.pins == pins, "pinned pages disagree with the pinned chunks"
    assert all(pool.pages[p].ref_count == n for p, n in pins.items())
    assert pool.num_free_pages == pool.num_pages - len(pins), "pages leaked"


def assert_report(out, prompt, page_size: int) -> None:
    """chunk_reuse: one record per piece, in order, counting the cached prefix's tokens where they lie."""
    report = out.chunk_reuse
    assert len(report) == len(prompt)
    start = 0
    for piece, r in zip(prompt, report):
        n = len(piece)
        assert isinstance(r, ChunkReuse)
        assert r.chunk == (piece if isinstance(piece, Chunk) else None)
        assert (r.num_tokens, r.blended) == (n, 0)
        assert r.exact + r.recomputed == n and r.exact >= 0
        assert r.exact == max(0, min(start + n, out.num_cached_tokens) - start)
        start += n
    assert out.num_cached_tokens % page_size == 0


class ComputedPrefixes:
    """An independent model of what the prefix cache may hold: every full-page prefix some request computed."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.prefixes: set[tuple[int, ...]] = set()

    def add(self, tokens: list[int]) -> None:
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            self.prefixes.add(tuple(tokens[:end]))

    def most(self, prompt: list[int]) -> int:
        """The most tokens a new request may find cached: computed before under the same prefix, short of its
        last token."""
        best = 0
        for end in range(self.page_size, len(prompt), self.page_size):
            if tuple(prompt[:end]) not in self.prefixes:
                break
            best = end
        return best


def test_a_composite_prompts_id_array_is_its_ids_and_is_checked_against_the_vocabulary(
        tiny_ckpt_with_byte_tokenizer):
    """validate_requests gives a composite prompt its ids as one int64 array (each chunk's made once, joined with
    its other pieces'), from which the page pool takes its bytes and the runner its ids: it equals the prompt's ids
    for chunks of one length, text and id pieces in any order, and is what the vocabulary check reads (the last id
    passes, vocab_size is refused by name). A plain prompt has none."""
    import numpy as np

    from chunkwise.chunks import ChunkRegistry
    from chunkwise.model_config import ModelConfig
    from chunkwise.tokenizer import load_tokenizer

    ckpt = tiny_ckpt_with_byte_tokenizer
    cfg, tok = ModelConfig.from_dir(ckpt), load_tokenizer(ckpt)
    registry = ChunkRegistry("test")
    a, b = registry.issue(seeded_ids(6, "a")), registry.issue(seeded_ids(6, "b"))   # one length
    prompts = [[a, [5, 6, 7], b, "hi", a], [b, a], [[9], b, [VOCAB - 1]], [a]]
    for _ in range(2):   # the chunks' arrays made, then reused
        for r in validate_requests(cfg, tok, MAX_MODEL_LEN, prompts, chunks=registry):
            assert r.prompt_array.dtype == np.int64 and r.prompt_array.tolist() == r.prompt_token_ids
    assert validate_requests(cfg, tok, MAX_MODEL_LEN, [[5, 6, 7]], chunks=registry)[0].prompt_array is None
    # A sequence's id array (the pool's page bytes, the runner's step ids) is its tokens over any range, across the
    # prompt's end into generated tokens, and for a plain prompt too
    from chunkwise.engine.sequence import Sequence
    for r in validate_requests(cfg, tok, MAX_MODEL_LEN, [[a, [5, 6, 7], b], [8, 9, 10]], chunks=registry):
        seq = Sequence.from_request(r)
        seq.token_ids += [11, 12]
        n = len(seq.token_ids)
        for lo, hi in [(0, n), (0, n - 2), (3, n - 2), (3, n - 1), (n - 2, n), (4, 4)]:
            got = seq.id_array(lo, hi)
            assert got.dtype == np.int64 and got.tolist() == seq.token_ids[lo:hi], (lo, hi)
    with pytest.raises(ValueError, match=rf"prompt 1 holds token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        validate_requests(cfg, tok, MAX_MODEL_LEN, [[a], [b, [3, VOCAB, -1]]], chunks=registry)


def test_the_registry_refuses_a_chunk_id_outside_the_vocabulary_itself_naming_it():
    """ChunkRegistry.chunk_ids checks a chunk's ids against the vocabulary before anything is registered or computed
    (the last id passes, vocab_size is refused by name): not left to the prompt check of the computation after it."""
    from chunkwise.chunks import ChunkRegistry

    registry = ChunkRegistry("test")
    assert registry.chunk_ids([5, VOCAB - 1], None, VOCAB) == [5, VOCAB - 1]
    with pytest.raises(ValueError, match=rf"the chunk holds token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        registry.chunk_ids([5, VOCAB], None, VOCAB)


@st.composite
def scenarios(draw):
    page_size = draw(st.sampled_from([2, 3, 4, 8]))
    num_chunks = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 12)) for _ in range(num_chunks)]
    pins = [draw(st.booleans()) for _ in range(num_chunks)]
    requests = []
    for _ in range(draw(st.integers(1, 3))):
        order = draw(st.permutations(range(num_chunks)))[:draw(st.integers(1, num_chunks))]
        lead, question = draw(st.integers(0, 3)), draw(st.integers(0, 4))   # plain id pieces, 0: none
        requests.append((tuple(order), lead, question))
    return dict(page_size=page_size, lengths=lengths, pins=pins, requests=requests, seed=draw(st.integers(0, 999)),
                extra_pages=draw(st.integers(0, 3)), batch=draw(st.booleans()), async_scheduling=draw(st.booleans()),
                budget=draw(st.sampled_from([8, 64])))


def build(s, ckpt, ref):
    """The scenario's engines, chunks registered on both, and its composite prompts on each."""
    ps = s["page_size"]
    chunk_ids = [seeded_ids(n, (s["seed"], i)) for i, n in enumerate(s["lengths"])]
    pinned_pages = sum(len(c) // ps for c, pin in zip(chunk_ids, s["pins"]) if pin)
    layouts = []
    for r, (order, lead, question) in enumerate(s["requests"]):
        layouts.append(([("id", seeded_ids(lead, (s["seed"], "lead", r)))] if lead else [])
                       + [("chunk", i) for i in order]
                       + ([("id", seeded_ids(question, (s["seed"], "q", r)))] if question else []))
    longest = max(sum(len(chunk_ids[x]) if k == "chunk" else len(x) for k, x in lay) for lay in layouts)
    need = -(-(longest + PARAMS.max_tokens - 1) // ps)
    num_pages = max(2 * pinned_pages, need + pinned_pages) + s["extra_pages"]
    eng = Engine(ckpt, page_size=ps, num_pages=num_pages, max_model_len=MAX_MODEL_LEN, max_pinned_fraction=0.5,
                 max_num_batched_tokens=s["budget"], async_scheduling=s["async_scheduling"])
    fast_chunks = [eng.register_chunk(c, pin=pin) for c, pin in zip(chunk_ids, s["pins"])]
    ref_chunks = [ref.register_chunk(c, pin=pin) for c, pin in zip(chunk_ids, s["pins"])]

    def prompts(chunks):
        return [[chunks[x] if k == "chunk" else x for k, x in lay] for lay in layouts]
    return eng, fast_chunks, ref_chunks, prompts(fast_chunks), prompts(ref_chunks)


def run_and_check(eng, ref, prompts, ref_prompts, computed: ComputedPrefixes, pinned, batch: bool):
    """Both engines' composite outputs (the reference's when ref_prompts are given) equal the reference's tokens
    for the concatenated ids; the fast engine's cache hits were computed before under the same prefix, and
    cover every pinned opening chunk."""
    ps = eng.page_size
    outs = eng.generate(prompts, PARAMS) if batch else [None] * len(prompts)
    for i, p in enumerate(prompts):
        ids = concat(p)
        bound = computed.most(ids)
        if not batch:
            outs[i] = out = eng.generate(p, PARAMS)[0]
            note(f"prompt {[len(x) for x in p]}: cached {out.num_cached_tokens} (at most {bound})")
            assert out.num_cached_tokens <= bound, "a cache hit that was never computed under this prefix"
        out = outs[i]   # in a batch, a request may also hit pages its batch-mates computed: no bound
        assert out.prompt_token_ids == ids
        assert out.token_ids == reference_tokens(ref, ids), f"composite {p} differs from its concatenated ids"
        assert_report(out, p, ps)
        opening = p[0]
        if isinstance(opening, Chunk) and opening in pinned:
            assert out.num_cached_tokens >= min(len(opening) // ps * ps, (len(ids) - 1) // ps * ps), \
                "a pinned opening chunk was not reused"
        computed.add(ids + out.token_ids[:-1])
    if ref_prompts:
        for p, ref_out in zip(prompts, ref.generate(ref_prompts, PARAMS)):
            assert ref_out.prompt_token_ids == concat(p)
            assert ref_out.token_ids == reference_tokens(ref, concat(p))
            assert ref_out.chunk_reuse == tuple(ChunkReuse(r.chunk, r.num_tokens, 0, 0, r.num_tokens)
                                                for r in ref_out.chunk_reuse)


@costly(max_examples=max(3, settings().max_examples // 2), deadline=None)   # seconds each; the @examples pin the edges
@given(s=scenarios())
@example(s=dict(page_size=4, lengths=[9, 6, 5], pins=[True, False, True], seed=1, extra_pages=0, batch=False,
                async_scheduling=False, budget=64,
                requests=[((0, 1), 0, 2), ((0, 1, 2), 0, 3), ((2, 0), 1, 0)]))
@example(s=dict(page_size=2, lengths=[12, 3], pins=[True, True], seed=2, extra_pages=1, batch=True,
                async_scheduling=True, budget=8, requests=[((1, 0), 0, 1), ((0,), 2, 0), ((0, 1), 0, 4)]))
def test_composites_equal_the_concatenated_ids_and_pinned_chunks_survive_pressure(s, ckpt, ref):
    note(repr(s))
    eng, chunks, ref_chunks, prompts, ref_prompts = build(s, ckpt, ref)
    pinned = {c for c, pin in zip(chunks, s["pins"]) if pin}
    computed = ComputedPrefixes(eng.page_size)
    for c in chunks:   # registration computed each chunk as a prompt's opening
        computed.add(list(c.token_ids))
    run_and_check(eng, ref, prompts, ref_prompts, computed, pinned, s["batch"])
    assert_pool_whole(eng)
    # Pressure: a prompt of fresh tokens taking every page not pinned evicts every unpinned cached page.
    pool = eng.page_pool
    room = (pool.num_pages - pool.num_pinned_pages) * eng.page_size - (PARAMS.max_tokens - 1)
    filler = seeded_ids(min(room, MAX_MODEL_LEN - PARAMS.max_tokens), (s["seed"], "filler"))
    eng.generate([filler], PARAMS)
    computed.add(filler)
    for c in pinned:
        pages = pool.chain_pages(c.token_ids)
        assert len(pages) == len(c) // eng.page_size, f"pinned {c} lost pages to eviction"
        assert all(p in pool.pins for p in pages)
    run_and_check(eng, ref, prompts, None, computed, pinned, s["batch"])
    for c in pinned:
        eng.unpin(c)
    for c in ref_chunks:
        if c.chunk_id in ref.chunks.pinned:
            ref.unpin(c)
    assert_pool_whole(eng)
    assert pool.num_pinned_pages == 0


def test_a_pinned_system_chunk_is_reused_exactly_after_pressure_and_a_document_after_it(ckpt, ref):
    """The RAG shape: [sys, docA, q] computes docA after sys; [sys, docA, q2] then reuses both, page by page;
    [docA, sys, ...] (docA without sys before it) reuses none of them."""
    eng = Engine(ckpt, page_size=4, num_pages=16, max_model_len=MAX_MODEL_LEN, max_pinned_fraction=0.5)
    sys_ids, doc_ids = seeded_ids(10, "sys"), seeded_ids(9, "doc")
    sys_chunk, doc = eng.register_chunk(sys_ids, pin=True), eng.register_chunk(doc_ids)
    assert len(eng.page_pool.pins) == 2
    first = eng.generate([sys_chunk, doc, [7, 8]], PARAMS)[0]
    assert [(r.exact, r.recomputed) for r in first.chunk_reuse] == [(8, 2), (0, 9), (0, 2)]
    eng.generate([seeded_ids(54, "filler")], PARAMS)   # 14 pages: every page but the 2 pinned ones
    second = eng.generate([sys_chunk, doc, [9]], PARAMS)[0]
    assert [(r.exact, r.recomputed) for r in second.chunk_reuse] == [(8, 2), (0, 9), (0, 1)], \
        "only the pinned pages survive the pressure"
    third = eng.generate([sys_chunk, doc, [5, 6, 7]], PARAMS)[0]
    assert [(r.exact, r.recomputed) for r in third.chunk_reuse] == [(10, 0), (6, 3), (0, 3)]
    swapped = eng.generate([doc, sys_chunk, [5]], PARAMS)[0]
    assert [(r.exact, r.recomputed) for r in swapped.chunk_reuse] == [(0, 9), (0, 10), (0, 1)], \
        "docA's pages cached after sys were reused at the prompt's start"
    for out, ids in ((first, sys_ids + doc_ids + [7, 8]), (second, sys_ids + doc_ids + [9]),
                     (third, sys_ids + doc_ids + [5, 6, 7]), (swapped, doc_ids + sys_ids + [5])):
        assert out.token_ids == reference_tokens(ref, ids) == eng.generate([ids], PARAMS)[0].token_ids
    eng.unpin(sys_chunk)
    assert_pool_whole(eng)
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages


def test_pieces_do_not_set_chunk_sizes_but_explicit_chunk_sizes_win(ckpt):
    eng = Engine(ckpt, page_size=4, num_pages=32, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    a, b = eng.register_chunk(seeded_ids(5, "a")), eng.register_chunk(seeded_ids(7, "b"))
    seqs = eng.frontend.requests([[a, [3, 4], b]], PARAMS, None)
    assert seqs[0].chunk_sizes is None and seqs[0].prompt_token_ids == concat([a, [3, 4], b]), \
        "a composite prompt's pieces split its prefill: the budget should"
    assert [p.num_tokens for p in seqs[0].pieces] == [5, 2, 7]
    assert eng.frontend.requests([[a, [3, 4], b]], PARAMS, [[7, 7]])[0].chunk_sizes == [7, 7]
    assert eng.frontend.requests([[a, [3, 4], b]], PARAMS, 6)[0].chunk_sizes == [6, 6, 2]
    blended = validate_requests(eng.model_config, None, MAX_MODEL_LEN, [a, [3, 4], b], PARAMS, reuse="blend",
                                chunks=eng.chunks)
    assert blended[0].chunk_sizes == [14]   # a blended prompt stays one step
    assert eng.frontend.requests([[1, 2, 3]], PARAMS, None)[0].chunk_sizes is None   # a plain prompt: the budget splits it
    assert eng.generate([[1, 2, 3]], PARAMS)[0].chunk_reuse is None


def record_steps(eng: Engine) -> list[list[int]]:
    """From now on, each scheduled step's tokens per sequence, in the scheduler's own order."""
    steps: list[list[int]] = []
    schedule = eng.scheduler.schedule

    def recorded():
        batch = schedule()
        if not batch.is_empty:
            steps.append(list(batch.num_new_tokens))
        return batch
    eng.scheduler.schedule = recorded
    return steps


@st.composite
def composites(draw):
    """Pieces of a composite prompt: ("chunk", i) of the drawn chunks (repeats allowed), ids, or text."""
    chunk_lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    piece = st.one_of(st.tuples(st.just("chunk"), st.integers(0, len(chunk_lengths) - 1)),
                      st.tuples(st.just("ids"), st.integers(1, 5)),
                      st.tuples(st.just("text"), st.text("ab \u00e9\u65e5", min_size=1, max_size=5)))
    pieces = draw(st.lists(piece, min_size=1, max_size=4))
    if not any(kind == "chunk" for kind, _ in pieces):
        pieces.insert(draw(st.integers(0, len(pieces))), ("chunk", 0))
    return dict(chunk_lengths=chunk_lengths, pieces=pieces, pins=draw(st.lists(st.booleans(), min_size=3, max_size=3)),
                page_size=draw(st.sampled_from([2, 3, 4, 8])), budget=draw(st.integers(3, 32)),
                seed=draw(st.integers(0, 999)))


STEP_PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)   # a decode step after the prefill


@costly(max_examples=max(3, settings().max_examples // 3), deadline=None)   # ~10 s per example on one core
@given(c=composites())
@example(c=dict(chunk_lengths=[9, 5], pieces=[("chunk", 0), ("ids", 3), ("chunk", 1), ("text", "ab")],
                pins=[True, False, False], page_size=4, budget=24, seed=0))   # 4 pieces, one budget-sized step
@example(c=dict(chunk_lengths=[6], pieces=[("ids", 2), ("chunk", 0), ("ids", 5)], pins=[False, False, False],
                page_size=3, budget=4, seed=1))                               # budget cuts across the pieces
def test_a_composite_is_scheduled_as_the_plain_prompt_of_its_ids(c, tiny_ckpt_with_byte_tokenizer):
    """Any composite, any budget, any page size: the steps (tokens per step, from where the cache ends) and the
    tokens are those of the plain prompt of the same ids on an engine whose cache holds the same chunks."""
    note(repr(c))
    engines, chunk_ids = [], [seeded_ids(n, (c["seed"], i)) for i, n in enumerate(c["chunk_lengths"])]
    for _ in range(2):
        eng = Engine(tiny_ckpt_with_byte_tokenizer, page_size=c["page_size"], num_pages=64,
                     max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=c["budget"], max_pinned_fraction=0.5)
        handles = [eng.register_chunk(ids, pin=pin) for ids, pin in zip(chunk_ids, c["pins"])]
        engines.append((eng, handles))
    (comp, handles), (plain, _) = engines
    prompt = [handles[x] if kind == "chunk" else seeded_ids(x, (c["seed"], j)) if kind == "ids" else x
              for j, (kind, x) in enumerate(c["pieces"])]
    tok = comp.tokenizer
    ids = [t for p in prompt for t in (p.token_ids if isinstance(p, Chunk) else
                                       tok.encode(p, add_special_tokens=False) if isinstance(p, str) else p)]
    comp_steps, plain_steps = record_steps(comp), record_steps(plain)
    out = comp.generate(prompt, STEP_PARAMS)[0]
    expected = plain.generate([ids], STEP_PARAMS)[0]
    note(f"composite steps {comp_steps}, plain steps {plain_steps}, cached {out.num_cached_tokens}")
    assert out.prompt_token_ids == ids
    assert out.num_cached_tokens == expected.num_cached_tokens, "the composite did not start where the cache ends"
    assert comp_steps == plain_steps, "a composite prompt's steps differ from its plain prompt's"
    assert comp_steps[0] == [min(c["budget"], len(ids) - out.num_cached_tokens)]
    assert out.token_ids == expected.token_ids
    assert [(r.num_tokens, r.exact) for r in out.chunk_reuse] == \
        [(r.num_tokens, r.exact) for r in reuse_report_of(prompt, ids, tok, out.num_cached_tokens)]


def reuse_report_of(prompt, ids, tok, num_cached: int) -> list[ChunkReuse]:
    """The per-piece report an independent count gives: the cached prefix's tokens where each piece lies."""
    out, start = [], 0
    for p in prompt:
        n = len(p) if isinstance(p, Chunk) else len(tok.encode(p, add_special_tokens=False)) if isinstance(p, str) \
            else len(p)
        exact = max(0, min(start + n, num_cached) - start)
        out.append(ChunkReuse(p if isinstance(p, Chunk) else None, n, exact, 0, n - exact))
        start += n
    assert start == len(ids)
    return out


def test_a_composite_whose_leading_chunk_is_cached_starts_where_the_cache_ends(ckpt):
    """[chunk of 10, ids of 3] with pages of 4: the chunk's two full pages are cached at registration, so one step
    computes the 5 tokens after them, as for the plain prompt."""
    eng = Engine(ckpt, page_size=4, num_pages=32, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)
    sys_chunk = eng.register_chunk(seeded_ids(10, "lead"), pin=True)
    steps = record_steps(eng)
    out = eng.generate([sys_chunk, [5, 6, 7]], STEP_PARAMS)[0]
    assert out.num_cached_tokens == 8
    assert steps == [[5], [1]]
    assert [(r.exact, r.recomputed) for r in out.chunk_reuse] == [(8, 2), (0, 3)]


def test_composites_work_in_add_request_and_prefill_kv_on_both_engines(ckpt, ref):
    from parity_report import assert_kv_close

    eng = Engine(ckpt, page_size=4, num_pages=32, max_model_len=MAX_MODEL_LEN)
    ids_a, ids_b = seeded_ids(6, "kv-a"), seeded_ids(5, "kv-b")
    a, b = eng.register_chunk(ids_a, pin=True), eng.register_chunk(ids_b)
    ra, rb = ref.register_chunk(ids_a), ref.register_chunk(ids_b)
    ids = ids_b + [9] + ids_a
    assert_kv_close(ref, ids, eng.prefill_kv([b, [9], a]), ref.prefill_kv([rb, [9], ra]), "composite prefill_kv")
    assert_kv_close(ref, ids, eng.prefill_kv(ids), ref.prefill_kv(ids), "plain prefill_kv")
    rid = eng.add_request([a, [9], b], PARAMS)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    final = outs[-1].output
    assert final.token_ids == reference_tokens(ref, ids_a + [9] + ids_b)
    assert [r.chunk for r in final.chunk_reuse] == [a, None, b]
    eng.unpin(a)
    assert_pool_whole(eng)


# ---- bad input --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine(ckpt, page_size=4, num_pages=20, max_model_len=64, max_pinned_fraction=0.25)


@pytest.fixture(scope="module")
def other(ckpt):
    return Engine(ckpt, page_size=4, num_pages=20, max_model_len=64)


BAD = [
    ("unpin of an unknown handle", lambda e, o: e.unpin(Chunk((5, 6), 999, e.chunks.name)), ValueError,
     r"Chunk\(id=999, 2 tokens.* is unknown"),
    ("unpin of an unpinned handle", lambda e, o: e.unpin(e.register_chunk([5, 6, 7, 8, 9])), ValueError,
     r"Chunk\(id=\d+, 5 tokens.* is not pinned"),
    ("unpin twice", lambda e, o: [e.unpin(c) for c in [e.register_chunk([5, 6, 7, 8], pin=True)] * 2],
     ValueError, "is not pinned"),
    ("unpin of a non-chunk", lambda e, o: e.unpin([5, 6]), TypeError, r"must be a Chunk .* got list \[5, 6\]"),
    ("another engine's chunk in generate", lambda e, o: e.generate([o.register_chunk([5, 6]), [7]], PARAMS),
     ValueError, r"prompt 0 piece 0 Chunk\(id=\d+, 2 tokens, engine='chunkwise.Engine#\d+'\) belongs to another"),
    ("another engine's chunk in add_request", lambda e, o: e.add_request([[7], o.register_chunk([5, 6])], PARAMS),
     ValueError, "prompt 0 piece 1 .* belongs to another engine"),
    ("another engine's chunk in prefill_kv", lambda e, o: e.prefill_kv(o.register_chunk([5, 6])),
     ValueError, "belongs to another engine"),
    ("another engine's chunk to unpin", lambda e, o: e.unpin(o.register_chunk([5, 6, 7, 8], pin=True)),
     ValueError, "belongs to another engine"),
    ("an unknown reuse mode", lambda e, o: e.generate([[5, 6]], PARAMS, reuse="fuzzy"), ValueError,
     r"prompt 0: reuse must be one of \['exact', 'blend'\] or a Blend, got 'fuzzy'"),
    ("an unknown reuse mode in add_request", lambda e, o: e.add_request([e.register_chunk([5, 6]), [7]], PARAMS,
                                                                        reuse="Blend"),
     ValueError, r"reuse must be one of \['exact', 'blend'\] or a Blend, got 'Blend'"),
    ("a bare ratio as the reuse mode", lambda e, o: e.generate([[5, 6]], PARAMS, reuse=0.15), TypeError,
     "reuse must be a reuse mode or one per prompt; got float 0.15"),
    ("the pin cap", lambda e, o: e.register_chunk(list(range(3, 30)), pin=True), ValueError,
     r"pinning 6 more pages would exceed the cap: 0 pages are pinned, max_pinned_fraction=0.25 of 20 pages "
     r"allows 5"),
    ("a bad piece", lambda e, o: e.generate([[e.register_chunk([5]), 3.5]], PARAMS), TypeError,
     "prompt 0 piece 1 must be a Chunk, a string or a list of token ids, got float 3.5"),
    ("a piece outside the vocabulary", lambda e, o: e.generate([e.register_chunk([5]), [VOCAB]], PARAMS),
     ValueError, f"prompt 0 holds token id {VOCAB}"),
    ("an empty piece", lambda e, o: e.generate([e.register_chunk([5]), []], PARAMS), ValueError,
     r"prompt 0 piece 1 has no tokens"),
    ("a chunk registered as a chunk", lambda e, o: e.register_chunk(e.register_chunk([5])), TypeError,
     "register_chunk takes text or a list of token ids"),
    ("a chunk outside the vocabulary", lambda e, o: e.register_chunk([5, -1]), ValueError,
     "the chunk holds token id -1"),
    ("text without a tokenizer", lambda e, o: e.register_chunk("hello"), ValueError,
     "the chunk is text but the checkpoint has no tokenizer"),
    ("pin not a bool", lambda e, o: e.register_chunk([5], pin="yes"), ValueError, "pin must be a bool, got 'yes'"),
]


@pytest.mark.parametrize("call, error, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_chunk_input_is_refused_by_name_and_leaves_the_engine_whole(engine, other, ref, call, error, match):
    held = dict(engine.page_pool.pins)
    with pytest.raises(error, match=match):
        call(engine, other)
    assert engine.page_pool.pins == held, "a refused call changed the pins"
    assert_pool_whole(engine)
    ids = seeded_ids(9, "healthy")
    assert engine.generate([ids], PARAMS)[0].token_ids == reference_tokens(ref, ids)


def test_the_pin_cap_counts_pages_once_and_a_pin_leaving_a_queued_request_no_room_is_refused(ckpt):
    eng = Engine(ckpt, page_size=4, num_pages=12, max_model_len=64, max_pinned_fraction=0.5)
    a = eng.register_chunk(seeded_ids(16, "cap"), pin=True)           # 4 pages
    again = eng.register_chunk(list(a.token_ids) + [5, 6, 7, 8], pin=True)   # shares a's 4 pages: 1 more
    assert eng.page_pool.num_pinned_pages == 5
    rid = eng.add_request(seeded_ids(24, "queued"), SamplingParams(max_tokens=5, ignore_eos=True))   # 7 pages
    with pytest.raises(ValueError, match=f"request {rid}: 24 prompt tokens .* need 7 pages .* 6 of them pinned"):
        eng.register_chunk(seeded_ids(4, "one more"), pin=True)
    assert eng.page_pool.num_pinned_pages == 5
    while eng.has_unfinished():
        eng.step()
    eng.unpin(again)
    eng.unpin(a)
    assert_pool_whole(eng)
    assert eng.page_pool.num_free_pages == 12


def test_reference_engine_registers_and_unpins_alike(ref, engine):
    chunk = ref.register_chunk([5, 6, 7], pin=True)
    assert chunk.token_ids == (5, 6, 7) and chunk.engine.startswith("chunkwise.reference.Engine#")
    out = ref.generate([chunk, [8]], PARAMS)[0]
    assert out.prompt_token_ids == [5, 6, 7, 8] and out.token_ids == reference_tokens(ref, [5, 6, 7, 8])
    assert out.chunk_reuse == (ChunkReuse(chunk, 3, 0, 0, 3), ChunkReuse(None, 1, 0, 0, 1))
    with pytest.raises(ValueError, match="belongs to another engine"):
        ref.generate([engine.register_chunk([5]), [8]], PARAMS)
    ref.unpin(chunk)
    with pytest.raises(ValueError, match="is not pinned"):
        ref.unpin(chunk)


@pytest.mark.parametrize("value", [-0.1, 1.0, 2, float("nan"), True, "half"])
def test_max_pinned_fraction_outside_0_1_is_refused_by_name(ckpt, value):
    with pytest.raises(ValueError, match=f"max_pinned_fraction must be a number in \\[0, 1\\), got {value!r}"):
        EngineConfig(ckpt, max_pinned_fraction=value)


@pytest.mark.parametrize("reuse, expected", [("exact", None), ("blend", DEFAULT_BLEND), (Blend(0.3, "chunk-heads"),
                                                                                         Blend(0.3, "chunk-heads"))])
def test_blend_params_resolves_the_reuse_modes(reuse, expected):
    assert blend_params(reuse) == expected
    assert check_reuse(reuse) == ("exact" if expected is None else expected)


def test_the_bare_blend_is_the_one_default_configuration_wherever_it_is_named(monkeypatch):
    """Setting chunkwise.chunks.DEFAULT_BLEND re-points "blend" for the engines and the server's extension, whose
    fields override it one by one."""
    from chunkwise.serve.app import _reuse
    from chunkwise.serve.protocol import ReuseOptions

    class Blends:   # the server's engine, as _reuse asks it
        def check_blend(self, blend, index):
            assert isinstance(blend, Blend)

    chosen = Blend(0.4, "adaptive")
    monkeypatch.setattr("chunkwise.chunks.DEFAULT_BLEND", chosen)
    assert blend_params("blend") is chosen and check_reuse("blend", 2) is chosen
    assert _reuse(Blends(), ReuseOptions(reuse="blend")) == chosen
    assert _reuse(Blends(), ReuseOptions(reuse="blend", recompute_ratio=0.1)) == Blend(0.1, "adaptive")
    assert _reuse(Blends(), ReuseOptions(reuse="blend", policy="chunk-heads")) == Blend(0.4, "chunk-heads")


@pytest.mark.parametrize("reuse", ["fuzzy", "", None, 0.15, ("blend",)])
def test_blend_params_refuses_other_modes_by_name(reuse):
    with pytest.raises(ValueError, match=re.escape(f"got {reuse!r}")):
        blend_params(reuse)
    with pytest.raises(ValueError, match=re.escape(f"prompt 3: reuse must be one of ['exact', 'blend'] or a Blend, "
                                                   f"got {reuse!r}")):
        check_reuse(reuse, 3)


@pytest.mark.parametrize("ratio", [1.5, -0.1, True, False, float("nan"), float("inf"), "0.5", None])
def test_blend_refuses_a_ratio_outside_0_1_by_name(ratio):
    with pytest.raises(ValueError, match=re.escape(f"recompute_ratio must be a number in [0, 1], got {ratio!r}")):
        Blend(ratio)


@pytest.mark.parametrize("ratio", [0, 0.0, 0.15, 1, 1.0])
def test_blend_takes_ratios_in_0_1_and_is_frozen(ratio):
    b = Blend(ratio, "chunk-heads")
    assert b.recompute_ratio == ratio and b.policy == "chunk-heads"
    with pytest.raises(AttributeError):
        b.recompute_ratio = 0.5


@pytest.mark.parametrize("policy", ["cacheblend", "", None, "KV-deviation"])
def test_blend_refuses_an_unknown_policy_by_name(policy):
    with pytest.raises(ValueError, match=re.escape(f"policy must be one of ['kv-deviation', 'chunk-heads', 'adaptive'], "
                                                   f"got {policy!r}")):
        Blend(0.1, policy)
