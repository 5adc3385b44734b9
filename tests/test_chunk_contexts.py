"""Chunks computed under a context (`register_chunk(prompt, after=...)`, issue #50 §1), on both engines.

Promises tested here:
- exact mode: a prompt opening with [context, chunk] reuses the full pages of context + chunk through the prefix
  cache, whether or not the context ends on a page boundary, and its output is the concatenated ids' output
  (a Hypothesis property over contexts, orders, page sizes, pins and tight pools; pins survive pressure);
- blend mode: a chunk in a prompt that opens with one of its registered contexts places that variant's K/V, moved by
  (its start - the context's length); the longest such context wins; without one it falls back to the isolated
  variant, and without that to no variant (computed like text); `ChunkReuse.context` says which. The K/V are checked
  against an oracle built here from one forward of context + chunk, and the fast engine's blend against the
  reference's (K/V, tokens, report);
- bad `after` (another engine's chunk, an unknown one, a bad type, empty, outside the vocabulary, too long) is
  refused by name before anything is issued or computed.
"""
from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.chunks import NO_CONTEXT, Blend, Chunk, ChunkContext, ChunkRegistry
from chunkwise.engine import Engine, SamplingParams
from chunkwise.reference import Engine as RefEngine
from chunkwise.reference.model import rotate
from blend_parity import blends_equal
from tests.draws import costly

pytestmark = pytest.mark.correctness

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
MAX_MODEL_LEN = 128
LAYERS = 4   # blend tests: check layers 1..3 differ from a full recompute


def seeded_ids(length: int, seed) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def concat(prompt) -> list[int]:
    return [t for p in prompt for t in (p.token_ids if isinstance(p, Chunk) else p)]


# ---- blend mode: the variant placed, against an oracle from one forward -------------------------------------------
def test_the_variant_is_the_longest_registered_context_the_prompt_opens_with():
    registry = ChunkRegistry("test")
    head, system, doc = [3, 4, 5], [6, 7], [8, 9, 10]
    after_head = registry.issue(doc, ChunkContext(tuple(head)))
    registry.issue(doc, ChunkContext(tuple(head + system)))
    only_elsewhere = registry.issue([11, 12], ChunkContext((20, 21)))
    _, pieces = registry.pieces([head, system, [1], after_head, only_elsewhere], None, 0)
    assert [p.context for p in pieces[3:]] == [ChunkContext(tuple(head + system)), None]
    _, pieces = registry.pieces([head, [1, 2], after_head], None, 0)   # opens with head only
    assert pieces[-1].context == ChunkContext(tuple(head))
    _, pieces = registry.pieces([[3, 4], after_head], None, 0)          # a context must end before the chunk
    assert pieces[-1].context is None
    registry.issue(doc)                                                  # the isolated variant: the fallback
    _, pieces = registry.pieces([[3, 4], after_head], None, 0)
    assert pieces[-1].context == NO_CONTEXT


_engines: dict = {}


def fast_engine(tiny_ckpt, family: str, page_size: int) -> Engine:
    """A deterministic fast engine of a four-layer checkpoint, with a registry of its own."""
    return Engine(str(tiny_ckpt(family, num_hidden_layers=LAYERS)), dtype="float32", device="cpu", page_size=page_size,
                  num_pages=200, max_model_len=192, deterministic=True)


def reference(tiny_ckpt, family: str, page_size: int) -> RefEngine:
    key = family, page_size
    if key not in _engines:
        _engines[key] = RefEngine(str(tiny_ckpt(family, num_hidden_layers=LAYERS)), dtype="float32", device="cpu",
                                  page_size=page_size)
    return _engines[key]


def moved_variant_kv(eng, chunk: Chunk, start: int, stored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of a placed variant: the chunk's first `stored` tokens' K/V from one forward of context + chunk,
    K rotated by (start - len(context)), as blend mode with nothing recomputed must place them."""
    n_ctx = len(chunk.context)
    k_all, v_all = eng.prefill_kv(list(chunk.context.token_ids + chunk.token_ids))
    k_own, v_own = k_all[:, n_ctx:n_ctx + stored], v_all[:, n_ctx:n_ctx + stored]
    cfg = eng.model_config
    moved = [rotate(k_own[layer].transpose(0, 1), torch.full((stored,), start - n_ctx),
                    cfg.rope_for(layer).inv_freq(cfg.head_dim)).transpose(0, 1) for layer in range(cfg.num_layers)]
    return torch.stack(moved), v_own


def stored_tokens(chunk: Chunk, page_size: int) -> int:
    """The chunk's tokens that lie in full pages of context + chunk (the rest, its tail, is computed like text)."""
    return max(0, (len(chunk.context) + len(chunk)) // page_size * page_size - len(chunk.context))


@pytest.mark.parametrize("family, page_size", [("qwen3", 4), ("gemma3_text", 3)])
@pytest.mark.parametrize("which", ["reference", "fast"])
def test_a_chunk_after_its_context_places_the_conditioned_kv_moved_by_start_less_the_context(tiny_ckpt, which, family,
                                                                                              page_size):
    if which == "fast":
        eng = fast_engine(tiny_ckpt, family, page_size)
    else:   # a registry of its own
        eng = RefEngine(str(tiny_ckpt(family, num_hidden_layers=LAYERS)), dtype="float32", device="cpu",
                        page_size=page_size)
    head, system = seeded_ids(5, "head"), seeded_ids(6, "system")
    docs = [seeded_ids(n, ("doc", n)) for n in (13, 10, 9)]
    after_system = eng.register_chunk(docs[0], after=[head, system])
    after_head = eng.register_chunk(docs[0], after=head)                  # a second variant of the same ids
    alone = eng.register_chunk(docs[1])                                   # isolated only
    elsewhere = eng.register_chunk(docs[2], after=seeded_ids(4, "other"))   # no variant fits the prompts below
    prompt = [head, system, [5, 6], alone, after_head, elsewhere, [7, 8]]
    k, v = eng.prefill_kv(prompt, reuse=Blend(0.0))
    start = len(head) + len(system) + 2
    # the longest context the prompt opens with: head + system, though the handle given was registered after head
    for chunk, used in ((alone, alone), (after_head, after_system)):
        stored = stored_tokens(used, page_size)
        k_want, v_want = moved_variant_kv(eng, used, start, stored)
        torch.testing.assert_close(k[:, start:start + stored], k_want, atol=2e-5, rtol=1e-5)
        assert torch.equal(v[:, start:start + stored], v_want)
        start += len(chunk)
    report = eng.generate([prompt], ONE, reuse=Blend(0.0))[0].chunk_reuse
    assert [r.context for r in report] == [None, None, None, NO_CONTEXT, after_system.context, None, None]
    assert [(r.blended, r.recomputed) for r in report[3:5]] == [
        (stored_tokens(alone, page_size), len(alone) - stored_tokens(alone, page_size)),
        (stored_tokens(after_system, page_size), len(docs[0]) - stored_tokens(after_system, page_size))]
    assert (report[5].blended, report[5].recomputed) == (0, len(docs[2]))   # no variant: computed like text
    # the prompt opening with head alone uses the variant after head
    out = eng.generate([[head, [9], after_system]], ONE, reuse=Blend(0.0))[0]
    assert out.chunk_reuse[-1].context == after_head.context


# ---- exact mode ----------------------------------------------------------------------------------------------------
@st.composite
def scenarios(draw):
    """A context, chunks each registered after it or alone (pinned or not), prompts opening with the context (as ids
    or as a registered chunk) or not, in drawn orders; a pool only just big enough."""
    page_size = draw(st.sampled_from([2, 3, 4, 8]))
    num_chunks = draw(st.integers(1, 3))
    return dict(page_size=page_size, context=draw(st.integers(1, 11)),
                lengths=[draw(st.integers(1, 12)) for _ in range(num_chunks)],
                after=[draw(st.booleans()) for _ in range(num_chunks)],
                pins=[draw(st.booleans()) for _ in range(num_chunks)],
                context_as_chunk=draw(st.booleans()),
                requests=[(draw(st.booleans()), tuple(draw(st.permutations(range(num_chunks)))),
                           draw(st.integers(0, 3))) for _ in range(draw(st.integers(1, 3)))],
                extra_pages=draw(st.integers(0, 2)), seed=draw(st.integers(0, 999)))


@pytest.fixture(scope="module")
def ref(reference_engine):
    return reference_engine("qwen3")


@costly(max_examples=max(1, settings().max_examples // 5), deadline=None)   # seconds each on one core; the @examples pin the edges
@given(s=scenarios())
@example(s=dict(page_size=4, context=7, lengths=[9, 6], after=[True, True], pins=[True, False], context_as_chunk=False,
                requests=[(True, (0, 1), 2), (True, (1, 0), 0), (False, (0,), 1)], extra_pages=0, seed=1))
@example(s=dict(page_size=3, context=6, lengths=[12, 2], after=[True, False], pins=[True, True], context_as_chunk=True,
                requests=[(True, (0, 1), 1), (True, (1, 0), 3)], extra_pages=0, seed=2))   # context on a page edge
def test_a_prompt_opening_with_context_and_chunk_reuses_their_pages_exactly(s, ckpt, ref):
    note(repr(s))
    ps = s["page_size"]
    context = seeded_ids(s["context"], (s["seed"], "context"))
    docs = [seeded_ids(n, (s["seed"], i)) for i, n in enumerate(s["lengths"])]
    afters = [context if a else None for a in s["after"]]
    pinned_pages = sum((len(d) + (len(a) if a else 0)) // ps for d, a, p in zip(docs, afters, s["pins"]) if p)
    longest = len(context) + sum(map(len, docs)) + 3 + PARAMS.max_tokens
    num_pages = pinned_pages + -(-longest // ps) + s["extra_pages"]
    eng = Engine(ckpt, page_size=ps, num_pages=num_pages, max_model_len=MAX_MODEL_LEN, max_pinned_fraction=0.75,
                 async_scheduling=False)
    opening = eng.register_chunk(context) if s["context_as_chunk"] else context
    chunks = [eng.register_chunk(d, pin=p, after=a) for d, p, a in zip(docs, s["pins"], afters)]
    assert [c.context for c in chunks] == [ChunkContext(tuple(a)) if a else NO_CONTEXT for a in afters]
    ref_chunks = [ref.register_chunk(d, after=a) for d, a in zip(docs, afters)]
    for r, (opens, order, question) in enumerate(s["requests"]):
        q = [seeded_ids(question, (s["seed"], "q", r))] if question else []
        prompt = ([opening] if opens else []) + [chunks[i] for i in order] + q
        ref_prompt = ([context] if opens else []) + [ref_chunks[i] for i in order] + q
        ids = concat(prompt)
        want = ref.generate([ids], PARAMS)[0].token_ids
        out = eng.generate([prompt], PARAMS)[0]
        note(f"prompt {[len(p) for p in prompt]}: cached {out.num_cached_tokens}")
        assert out.token_ids == want, "a prompt opening with a conditioned chunk differs from its concatenated ids"
        assert ref.generate([ref_prompt], PARAMS)[0].token_ids == want
        first = chunks[order[0]]
        if opens and s["after"][order[0]] and s["pins"][order[0]]:   # its pages survived every eviction
            whole = len(context) + len(first)
            assert out.num_cached_tokens >= min(whole, len(ids) - 1) // ps * ps, \
                "the pinned conditioned chunk's pages were not reused"
        assert all(r.context is None for r in out.chunk_reuse)   # exact mode places no variant
    # Pressure: fresh prompts filling the pool; the pinned variants keep every page of context + chunk.
    pool = eng.page_pool
    room = (pool.num_pages - pool.num_pinned_pages) * ps - (PARAMS.max_tokens - 1)
    eng.generate([seeded_ids(min(room, MAX_MODEL_LEN - PARAMS.max_tokens), (s["seed"], "filler"))], PARAMS)
    for c, pin in zip(chunks, s["pins"]):
        if pin:
            ids = list(c.context.token_ids + c.token_ids)
            pages = pool.chain_pages(ids)
            assert len(pages) == len(ids) // ps and all(p in pool.pins for p in pages), f"{c} lost pages"
    assert not eng.has_unfinished()
    assert pool.num_free_pages == pool.num_pages - pool.num_pinned_pages, "pages leaked"


# ---- blend mode: the fast engine against the reference -----------------------------------------------------------
def blend_cases():
    return st.tuples(st.sampled_from([("qwen3", 4), ("llama", 2), ("gemma3_text", 3), ("mistral", 8)]),
                     st.builds(Blend, st.sampled_from([0.0, 0.15, 0.5]), st.sampled_from(["kv-deviation",
                                                                                           "chunk-heads"])),
                     st.permutations(range(3)), st.integers(1, 9), st.integers(0, 999))


@costly(max_examples=max(1, settings().max_examples // 5), deadline=None)   # ~7 s an example on one core
@given(case=blend_cases())
@example(case=(("qwen3", 4), Blend(0.15), (2, 0, 1), 6, 1))
@example(case=(("gemma3_text", 3), Blend(0.3, "chunk-heads"), (0, 1, 2), 5, 2))
def test_the_fast_engines_conditioned_blend_equals_the_references(tiny_ckpt, case):
    """Contexts that end off page boundaries, variants after it and after a prefix of it, an isolated one; the
    prompt opens with the context, then fresh text (so both engines blend every chunk: the fast engine's exact hit
    covers the context only)."""
    (family, page_size), blend, order, n_ctx, seed = case
    eng, ref = fast_engine(tiny_ckpt, family, page_size), reference(tiny_ckpt, family, page_size)
    context = seeded_ids(n_ctx, ("context", seed))
    docs = [seeded_ids(n, ("doc", seed, n)) for n in (11, 14, 7)]
    afters = [context, context[:max(1, n_ctx // 2)], None]
    fast = [eng.register_chunk(d, after=a) for d, a in zip(docs, afters)]
    slow = [ref.register_chunk(d, after=a) for d, a in zip(docs, afters)]
    tail = seeded_ids(3, ("question", seed))
    prompt = [context, [4, 5]] + [fast[i] for i in order] + [tail]
    ref_prompt = [context, [4, 5]] + [slow[i] for i in order] + [tail]
    note(f"prompt {[len(p) for p in prompt]}")
    out, out_ref = blends_equal(eng, ref, prompt, ref_prompt, blend, PARAMS)
    # the reference has no prefix cache: the context's cached pages are exact there, recomputed here
    got, want = out.chunk_reuse, out_ref.chunk_reuse
    assert got[0].exact + got[0].recomputed == want[0].recomputed
    assert [(r.num_tokens, r.exact, r.blended, r.recomputed, r.context) for r in got[1:]] == \
           [(r.num_tokens, r.exact, r.blended, r.recomputed, r.context) for r in want[1:]]
    assert [r.context for r in got[2:5]] == [fast[i].context for i in order]


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(ckpt):
    return (Engine(ckpt, page_size=4, num_pages=32, max_model_len=64, async_scheduling=False),
            RefEngine(ckpt, dtype="float32", device="cpu", max_model_len=64))


@pytest.mark.parametrize("which", ["fast", "reference"])
def test_a_bad_context_is_refused_by_name_and_nothing_is_issued_or_kept(pair, which):
    eng = pair[0] if which == "fast" else pair[1]
    other = pair[1] if which == "fast" else pair[0]
    foreign = other.register_chunk([5, 6, 7])
    unknown = Chunk((5, 6), 999, eng.chunks.name)
    issued, variants = eng.chunks.num_issued, {k: set(v) for k, v in eng.chunks.variants.items()}
    free = eng.page_pool.num_free_pages if which == "fast" else None
    doc = [9] * 6
    for after, error, says in [(foreign, ValueError, "another engine"), ([[5], foreign], ValueError, "another engine"),
                               (unknown, ValueError, "unknown"), ({"ids": [5]}, TypeError, "after"),
                               ([[5], 3.5], TypeError, "after[1]"), ([], ValueError, "no tokens"),
                               ([5, VOCAB], ValueError, str(VOCAB)), ([5] * 60, ValueError, "max_model_len"),
                               ("text", ValueError, "tokenizer")]:
        with pytest.raises(error, match=re.escape(says)):
            eng.register_chunk(doc, after=after)
    assert eng.chunks.num_issued == issued and eng.chunks.variants == variants
    if free is not None:
        assert eng.page_pool.num_free_pages == free and not eng.has_unfinished()
    # a context given as a registered chunk stands for its ids, as in a prompt
    ctx = eng.register_chunk([5, 6, 7])
    assert eng.register_chunk(doc, after=[ctx, [8]]).context == ChunkContext((5, 6, 7, 8))
