"""Blend mode in the fast engine (chunkwise/engine/blend/): chunks' own K/V placed at new positions, a share of
their tokens recomputed.

Its promises, each tested here: at recompute ratio 1 it is a full recompute, bit for bit exact mode's in
deterministic mode (the anchor tying it to the harness); a token not recomputed carries its chunk's own K/V, K
rotated to its new position; a blended request's approximate pages never serve another request as exact ones;
`chunk_reuse` counts what each policy recomputed; at any ratio and policy the K/V and tokens equal the reference
engine's blend (chunkwise/reference/blend.py, dense PyTorch, the algorithm's oracle); batch-mates keep their bits;
a config that cannot blend is refused by name with nothing leaked. Four-layer tiny models, so that check layers (1..3) differ from a full
recompute (with two layers every K/V is fresh by layer 1).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.chunks import NO_CONTEXT, Blend, Chunk, ChunkContext, Piece
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.blend import check_ratios, num_kept
from chunkwise.reference import Engine as RefEngine
from chunkwise.reference.model import rotate
from blend_parity import blends_equal
from tests.draws import costly

pytestmark = pytest.mark.correctness

LAYERS = 4
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
FAMILIES = ("qwen3", "gemma3_text", "llama", "mistral")   # q/k-norm, sliding + global RoPE, GQA, sliding window
_engines: dict[tuple, Engine | RefEngine] = {}


def engine(tiny_ckpt, family: str, page_size: int, dtype: str = "float32", **kw) -> Engine:
    """A deterministic engine per (family, page size, dtype), kept for the module."""
    key = family, page_size, dtype, tuple(sorted(kw.items()))
    if key not in _engines:
        _engines[key] = Engine(str(tiny_ckpt(family, num_hidden_layers=LAYERS)), dtype=dtype, device="cpu",
                               page_size=page_size, num_pages=kw.pop("num_pages", 400), max_model_len=192,
                               deterministic=True, **kw)
    return _engines[key]


def reference(tiny_ckpt, family: str, page_size: int) -> RefEngine:
    """The reference engine of `engine`'s checkpoint; page_size says which tokens of a chunk the fast one stores."""
    key = "reference", family, page_size
    if key not in _engines:
        _engines[key] = RefEngine(str(tiny_ckpt(family, num_hidden_layers=LAYERS)), dtype="float32", device="cpu",
                                  page_size=page_size)
    return _engines[key]


def counts(r) -> tuple[int, int, int, int]:
    return r.num_tokens, r.exact, r.blended, r.recomputed


def seeded_ids(length: int, seed) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def concat(prompt) -> list[int]:
    return [t for p in prompt for t in (p.token_ids if isinstance(p, Chunk) else p)]


@st.composite
def compositions(draw, max_chunks=4):
    """(chunk lengths, a prompt layout: ("chunk", i) or ("text", ids) pieces, ending in text or a chunk)."""
    lengths = draw(st.lists(st.integers(1, 24), min_size=1, max_size=max_chunks))
    order = draw(st.permutations(range(len(lengths))))
    layout = []
    for i in order:
        if draw(st.booleans()):
            layout.append(("text", seeded_ids(draw(st.integers(1, 5)), draw(st.integers(0, 99)))))
        layout.append(("chunk", i))
    if draw(st.booleans()):
        layout.append(("text", seeded_ids(draw(st.integers(1, 6)), draw(st.integers(0, 99)))))
    return lengths, layout


def build(eng: Engine, lengths, layout, seed) -> list:
    chunks = [eng.register_chunk(seeded_ids(n, (seed, i, n))) for i, n in enumerate(lengths)]
    return [chunks[x] if kind == "chunk" else x for kind, x in layout]


POLICIES = ["kv-deviation", "chunk-heads", "adaptive"]


@costly(max_examples=max(1, settings().max_examples // 5))   # a pinned composition besides: ~10 s an example on one core
@example(family="llama", page_size=3, comp=((13, 9, 17), [("chunk", 1), ("text", [5, 6]), ("chunk", 0), ("chunk", 2)]),
         policy="adaptive", seed=5)
@given(family=st.sampled_from(FAMILIES), page_size=st.sampled_from([1, 2, 3, 4, 8]), comp=compositions(),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 10**6))
def test_blend_at_ratio_one_is_bitwise_exact_mode_in_deterministic_mode(tiny_ckpt, family, page_size, comp, policy,
                                                                        seed):
    eng = engine(tiny_ckpt, family, page_size)
    prompt = build(eng, *comp, seed)
    note(f"prompt {prompt}")
    blend = Blend(1.0, policy)
    k_b, v_b = eng.prefill_kv(prompt, reuse=blend)
    out_b = eng.generate([prompt], PARAMS, reuse=blend)[0]   # blended pages are not cached: exact runs afresh
    k_e, v_e = eng.prefill_kv(concat(prompt))
    out_e = eng.generate([concat(prompt)], PARAMS)[0]
    assert torch.equal(k_b, k_e) and torch.equal(v_b, v_e)
    assert out_b.token_ids == out_e.token_ids
    assert all(r.blended == 0 for r in out_b.chunk_reuse), out_b.chunk_reuse


PINNED_LAYOUT = ((13, 9, 17), [("chunk", 1), ("text", [5, 6]), ("chunk", 0), ("chunk", 2), ("text", [7, 8, 9])])


@costly(max_examples=max(2, settings().max_examples // 3))   # seven pinned cases carry the edges: every policy, page size 1, the window
@example(family="qwen3", page_size=4, comp=PINNED_LAYOUT, blend=Blend(0.3, "chunk-heads"), seed=1)
@example(family="llama", page_size=2, comp=PINNED_LAYOUT, blend=Blend(0.3), seed=2)
@example(family="gemma3_text", page_size=1, comp=PINNED_LAYOUT, blend=Blend(0.1), seed=3)
@example(family="qwen3", page_size=1, comp=((12, 8), [("chunk", 0), ("text", [5]), ("chunk", 1)]),
         blend=Blend(0.25, "chunk-heads"), seed=4)   # ends on a chunk's stored token: the prompt's last is still computed
@example(family="qwen3", page_size=2, comp=PINNED_LAYOUT, blend=Blend(0.3, "adaptive"), seed=6)
@example(family="gemma3_text", page_size=1, comp=PINNED_LAYOUT, blend=Blend(0.15, "adaptive"), seed=7)
@example(family="gemma3_text", page_size=1, comp=([17, 13], [("chunk", 0), ("text", [188]), ("chunk", 1)]),
         blend=Blend(0.3, "adaptive"), seed=0)   # places go to tokens past the sliding window: deviation is noise
@given(family=st.sampled_from(FAMILIES), page_size=st.sampled_from([1, 2, 4, 8]), comp=compositions(),
       blend=st.builds(Blend, st.sampled_from([0.0, 0.1, 0.3, 0.6]), st.sampled_from(POLICIES)),
       seed=st.integers(0, 10**6))
def test_blended_kv_and_tokens_equal_the_reference_engines_blend(tiny_ckpt, family, page_size, comp, blend, seed):
    eng = engine(tiny_ckpt, family, page_size)
    ref = reference(tiny_ckpt, family, page_size)
    lengths, layout = comp
    fresh = seeded_ids(3, ("opening", seed))   # no prefix-cache hit: both engines blend from position 0
    prompt = [fresh] + build(eng, lengths, layout, seed)
    ref_prompt = [fresh] + build(ref, lengths, layout, seed)
    note(f"prompt {prompt}")
    out, out_ref = blends_equal(eng, ref, prompt, ref_prompt, blend, PARAMS)
    assert [counts(r) for r in out.chunk_reuse] == [counts(r) for r in out_ref.chunk_reuse]


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_a_token_not_recomputed_carries_its_chunks_own_kv_with_k_rotated_to_its_new_position(tiny_ckpt, family):
    eng = engine(tiny_ckpt, family, 4)
    docs = [seeded_ids(n, ("doc", family, n)) for n in (12, 9, 16)]
    chunks = [eng.register_chunk(d) for d in docs]
    prompt = [[5, 6, 7], chunks[2], [8], chunks[0], chunks[1], [9, 10]]
    k, v = eng.prefill_kv(prompt, reuse=Blend(0.0))
    cfg = eng.model_config
    start = 3
    for piece in prompt[1:]:
        if isinstance(piece, Chunk):
            k_own, v_own = eng.prefill_kv(list(piece.token_ids))
            stored = len(piece) // 4 * 4   # its full pages; the tail is computed like text
            rows = slice(start, start + stored)
            assert torch.equal(v[:, rows], v_own[:, :stored])
            for layer in range(cfg.num_layers):
                inv_freq = cfg.rope_for(layer).inv_freq(cfg.head_dim)
                # [kv_heads, T, D] as the reference rotates: by `start` more than its own positions 0..
                moved = rotate(k_own[layer, :stored].transpose(0, 1), torch.full((stored,), start), inv_freq)
                torch.testing.assert_close(k[layer, rows], moved.transpose(0, 1), atol=2e-5, rtol=1e-5)
            start += len(piece)
        else:
            start += len(piece)
    # Layer 0's K/V depend on the token and its position alone: the placed ones equal a full recompute's.
    k_e, v_e = eng.prefill_kv(concat(prompt))
    torch.testing.assert_close(k[0], k_e[0], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(k[1:], k_e[1:], atol=1e-3)   # later layers miss the context: that is blending


def test_a_blends_later_layers_split_their_context_and_still_equal_the_reference_blend(tiny_ckpt, monkeypatch):
    """Outside deterministic mode a blend's rows after its check layers (explicit positions, up to
    PLANNED_SPLIT_ROWS) split their context every PLANNED_SPLIT_SIZE positions (here 64, so the kept rows of an
    83-token prompt merge two splits) in PLANNED_TILE_ROWS-row tiles, and its check layers take one pass in those
    tiles: the K/V (the last layer's come from the split attention of the layer before) equal the reference
    engine's blend."""
    import chunkwise.engine.model as model
    from chunkwise.kernels.paged_attention import paged_attention
    monkeypatch.setattr(model, "PLANNED_SPLIT_SIZE", 64)
    planned = set()

    def recording(*args, max_rows=256, split_size=None, positions=None, **kwargs):
        if positions is not None:
            planned.add((max_rows, split_size))
        return paged_attention(*args, max_rows=max_rows, split_size=split_size, positions=positions, **kwargs)
    monkeypatch.setattr(model, "paged_attention", recording)
    ckpt = str(tiny_ckpt("qwen3", num_hidden_layers=LAYERS + 2))   # two layers after the check layers 1..3
    eng = Engine(ckpt, dtype="float32", device="cpu", page_size=4, num_pages=400, max_model_len=96,
                 split_kv_threshold=0)
    ref = RefEngine(ckpt, dtype="float32", device="cpu", page_size=4)
    layout = [("text", [5, 6, 7]), ("chunk", 0), ("text", [8, 9]), ("chunk", 1), ("text", [10, 11])]
    prompt, ref_prompt = build(eng, (40, 36), layout, "split"), build(ref, (40, 36), layout, "split")
    k, v = eng.prefill_kv(prompt, reuse=Blend(0.3))
    k_ref, v_ref = ref.prefill_kv(ref_prompt, reuse=Blend(0.3))
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)
    assert planned == {(model.PLANNED_TILE_ROWS, None), (model.PLANNED_TILE_ROWS, 64)}


def test_a_blended_requests_pages_never_serve_an_exact_request(tiny_ckpt):
    eng = engine(tiny_ckpt, "qwen3", 2)
    doc, sys_ = eng.register_chunk(seeded_ids(14, "pages-doc")), eng.register_chunk(seeded_ids(6, "pages-sys"))
    prompt = [sys_, [11, 12, 13], doc, [14, 15, 16, 17]]
    eng.generate([prompt], PARAMS, reuse=Blend(0.2))
    exact = eng.generate([prompt], PARAMS)[0]
    fresh = Engine(str(tiny_ckpt("qwen3", num_hidden_layers=LAYERS)), dtype="float32", device="cpu", page_size=2,
                   num_pages=400, max_model_len=192, deterministic=True)
    assert exact.token_ids == fresh.generate([concat(prompt)], PARAMS)[0].token_ids
    assert torch.equal(eng.prefill_kv(prompt)[0], fresh.prefill_kv(concat(prompt))[0])
    # only the system chunk's full pages (computed at position 0 on their own) were exact to reuse
    assert exact.chunk_reuse[0].exact == 6 and sum(r.exact for r in exact.chunk_reuse[1:]) == 0


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.3, 0.7])
def test_the_report_counts_what_each_policy_recomputed(tiny_ckpt, ratio):
    eng = engine(tiny_ckpt, "llama", 4)
    lengths = (10, 17, 8)
    chunks = [eng.register_chunk(seeded_ids(n, ("report", n))) for n in lengths]
    prompt = [[3, 4], chunks[1], chunks[0], [5], chunks[2], [6, 7, 8]]
    stored = [n // 4 * 4 for n in (17, 10, 8)]
    heads = eng.generate([prompt], PARAMS, reuse=Blend(ratio, "chunk-heads"))[0].chunk_reuse
    for r, n, s in zip([heads[1], heads[2], heads[4]], (17, 10, 8), stored):
        h = min(s, int(ratio * n + 0.5))
        assert (r.exact, r.blended, r.recomputed) == (0, s - h, n - s + h), r
    assert [r.recomputed for r in (heads[0], heads[3], heads[5])] == [2, 1, 3]
    n = sum(stored)
    kept = num_kept(check_ratios(ratio, LAYERS)[-1], n) if ratio else 0
    for policy in ("kv-deviation", "adaptive"):   # the same budget, shared out differently
        dev = eng.generate([prompt], PARAMS, reuse=Blend(ratio, policy))[0].chunk_reuse
        assert sum(r.recomputed for r in dev) == sum(lengths) + 6 - n + kept, policy
        assert all(r.exact + r.blended + r.recomputed == r.num_tokens for r in dev)


def test_gradual_filtering_narrows_from_above_the_ratio_to_it():
    assert check_ratios(0.15, 28) == pytest.approx([0.25, 0.2, 0.15])
    assert check_ratios(0.9, 28)[0] == 1.0 and check_ratios(0.3, 2) == [0.3]
    assert [num_kept(r, 10) for r in (0.0, 0.05, 0.15, 0.25, 1.0)] == [0, 1, 2, 3, 10]


def test_a_blended_request_leaves_its_batch_mates_bits_alone(tiny_ckpt):
    eng = engine(tiny_ckpt, "gemma3_text", 4)
    doc = eng.register_chunk(seeded_ids(20, "mate-doc"))
    others = [seeded_ids(n, ("mate", n)) for n in (5, 19, 33)]
    alone = eng.generate(others, PARAMS)
    mixed = eng.generate(others + [[[1, 2], doc, [3, 4]]], PARAMS, reuse=["exact"] * 3 + [Blend(0.3)])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert mixed[3].chunk_reuse[1].blended > 0


def test_blend_is_refused_by_name_where_it_cannot_be_served_and_nothing_leaks(tiny_ckpt):
    eng = engine(tiny_ckpt, "qwen3", 4, enable_prefix_caching=False)
    doc = eng.register_chunk(seeded_ids(8, "refused"))
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        eng.generate([[doc, [5]]], PARAMS, reuse="blend")
    ok = engine(tiny_ckpt, "qwen3", 4)
    doc = ok.register_chunk(seeded_ids(8, "refused"))
    with pytest.raises(ValueError, match=r"chunk_sizes=\[4, 5\]"):
        ok.generate([[doc, [5]]], PARAMS, chunk_sizes=[[4, 5]], reuse="blend")
    with pytest.raises(ValueError, match="1.5"):
        ok.generate([[doc, [5]]], PARAMS, reuse=Blend(1.5))
    with pytest.raises(ValueError, match=r"\[0, 1\], got -0.25"):   # the adaptive budget's lower side
        ok.generate([[doc, [5]]], PARAMS, reuse=Blend(-0.25, "adaptive"))
    with pytest.raises(ValueError, match="'nearest'"):
        ok.generate([[doc, [5]]], PARAMS, reuse=Blend(0.2, "nearest"))
    assert not eng.has_unfinished() and not ok.has_unfinished()
    assert ok.page_pool.num_free_pages == ok.page_pool.num_pages


def test_an_evicted_chunk_is_recomputed_and_the_output_is_exact(tiny_ckpt):
    eng = engine(tiny_ckpt, "qwen3", 4, num_pages=12)
    doc = eng.register_chunk(seeded_ids(16, "evicted"))
    eng.generate([seeded_ids(40, "pressure")], PARAMS)   # takes every page: the chunk's cached pages go
    prompt = [[7, 8], doc, [9]]
    out = eng.generate([prompt], PARAMS, reuse=Blend(0.0))[0]
    assert out.chunk_reuse[1].recomputed == 16 and out.chunk_reuse[1].blended == 0
    assert out.token_ids == eng.generate([concat(prompt)], PARAMS)[0].token_ids


def test_blended_prefills_join_overlapped_decodes_and_every_request_gets_its_own_tokens(tiny_ckpt):
    eng = engine(tiny_ckpt, "qwen3", 4, async_scheduling=True, split_kv_threshold=0)
    rng = random.Random("overlap")
    docs = [eng.register_chunk(seeded_ids(24, ("overlap", i)), pin=True) for i in range(5)]
    plain = [seeded_ids(n, ("plain", n)) for n in (20, 30)]
    blended = [rng.sample(docs, 3) + [[5, 6, 7]] for _ in range(3)]
    alone = [eng.generate([p], PARAMS)[0].token_ids for p in plain]
    alone += [eng.generate([b], PARAMS, reuse=Blend(0.3))[0].token_ids for b in blended]
    ids = [eng.add_request(p, PARAMS) for p in plain]
    eng.step()
    eng.step()   # the plain requests decode, their next tokens pending on the device, as blended prefills arrive
    ids += [eng.add_request(b, PARAMS, reuse=Blend(0.3)) for b in blended]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.output for o in eng.step() if o.finished})
    assert [done[i].token_ids for i in ids] == alone, [done[i].error for i in ids]


def test_a_remembered_chunk_chain_is_reused_while_cached_and_resolved_again_once_evicted():
    """Blender._chain_pages remembers a chunk's whole chain of cached pages (host work O(pieces) per request), and
    gives it back only while no page of it has left the cache (the pool's generations, stamped when it was
    resolved): evicted and re-cached, or taken by another prompt, the chunk's pages are looked up again from its
    tokens."""
    from chunkwise.engine.blend import Blender
    from chunkwise.engine.page_pool import PagePool
    from chunkwise.engine.sequence import Sequence

    pool, blender = PagePool(6, 4), Blender(LAYERS)
    ids = seeded_ids(9, "chain")   # two full pages and a tail
    piece = Piece(Chunk(tuple(ids), 7, "engine"), len(ids))   # its isolated variant (NO_CONTEXT)
    key = 7, NO_CONTEXT

    def compute(seq_id, prompt):
        seq = Sequence(seq_id, prompt)
        pool.match_prefix(seq)
        pool.allocate(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        pool.commit(seq)
        pool.free(seq)

    compute(0, ids)
    def chain(p):
        return blender._chain_pages(p, pool).tolist()

    first = chain(piece)
    assert first == pool.chain_pages(ids) and len(first) == 2 and key in blender.chains
    assert chain(piece) == first   # remembered, still cached
    compute(1, seeded_ids(24, "evicts"))   # six pages: every cached page of the chunk is evicted
    assert pool.chain_pages(ids) == [] and chain(piece) == []
    assert key not in blender.chains
    compute(2, ids)   # cached again (new generations): resolved again, then remembered
    assert chain(piece) == pool.chain_pages(ids) and len(pool.chain_pages(ids)) == 2
    context = seeded_ids(3, "context")   # a variant: its chain is context + chunk's, remembered under its context
    compute(3, context + ids)
    after = Piece(piece.chunk, len(ids), ChunkContext(tuple(context)))
    assert chain(after) == pool.chain_pages(context + ids)
    assert len(pool.chain_pages(context + ids)) == 3
    assert (7, after.context) in blender.chains


def plan_rows(plan, num_layers: int) -> list[int]:
    """The rows a RowPlan computes at each layer past that layer's selection (row_plan.py's rules)."""
    if not plan.check_layers:
        return [int(plan.computed.sum())] * num_layers
    rows = [int(plan.computed.sum())] * num_layers
    for layer in range(1, num_layers):
        at = [k for c, k in zip(plan.check_layers, plan.keep) if c <= layer]
        if at:
            rows[layer] = plan.num_fixed + at[-1]
    return rows


@settings(max_examples=max(4, settings().max_examples))
@example(page_size=3, comp=((13, 9, 17), [("chunk", 1), ("text", [5, 6]), ("chunk", 0), ("chunk", 2)]),
         blend=Blend(0.3), start=4, seed=1)   # tails past full pages, an exact prefix ending inside a chunk
@example(page_size=4, comp=PINNED_LAYOUT, blend=Blend(0.6, "chunk-heads"), start=0, seed=2)
@given(page_size=st.sampled_from([1, 3, 4, 8]), comp=compositions(),
       blend=st.builds(Blend, st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]), st.sampled_from(POLICIES)),
       start=st.integers(0, 200), seed=st.integers(0, 10**6))
def test_the_schedulers_count_of_a_blends_rows_is_its_plans_while_its_chunks_are_cached(tiny_ckpt, page_size, comp,
                                                                                       blend, start, seed):
    """`layer_rows`, the O(pieces) count the scheduler's budget takes before a blend is planned, gives the rows the
    plan (`plan_blend` against the prefix cache) computes at each layer, from any exact prefix."""
    from chunkwise.engine.blend import layer_rows, plan_blend

    eng = engine(tiny_ckpt, "qwen3", page_size)
    prompt = [seeded_ids(2, ("count", seed))] + build(eng, *comp, seed)
    pieces = eng.frontend.requests([prompt], PARAMS, None, blend)[0].pieces
    start = start % sum(p.num_tokens for p in pieces)
    plan = plan_blend(blend, pieces, start, eng.page_pool, LAYERS)
    note(f"pieces {pieces} start {start}")
    assert layer_rows(blend, pieces, start, LAYERS, page_size) == plan_rows(plan.rows, LAYERS)


def test_blended_prefills_share_a_step_by_their_computed_rows_up_to_the_steps_rows(tiny_ckpt, monkeypatch):
    """A blended prefill counts its computed rows per layer against the budget (`Blender.counted_rows`), not its
    placed ones: prefills whose whole prompts exceed the budget share steps (and join decodes) while their counted
    rows fit it and their rows fit `max_blended_rows` (`Scheduler._chunk`); every request still gets the tokens it
    gets alone."""
    budget = 48
    eng = engine(tiny_ckpt, "qwen3", 4, max_num_batched_tokens=budget)
    assert eng.engine_config.max_blended_rows == 192   # max(max_model_len 192, 4 * 48)
    docs = [eng.register_chunk(seeded_ids(24, ("share", i)), pin=True) for i in range(6)]
    rng = random.Random("share")
    # 77 rows each, no exact prefix (2 leading ids fill no page): 5 fixed rows, 72 placed
    prompts = [[seeded_ids(2, ("lead", i))] + rng.sample(docs, 3) + [seeded_ids(3, ("question", i))]
               for i in range(4)]
    modes = [Blend(0.0)] * 3 + [Blend(0.3)]   # 5 rows counted each; kv-deviation 77, 41, 34, 27 a layer: 45
    alone = [eng.generate([p], PARAMS, reuse=m)[0].token_ids for p, m in zip(prompts, modes)]
    batches = []
    schedule = eng.scheduler.schedule
    monkeypatch.setattr(eng.scheduler, "schedule", lambda: batches.append(schedule()) or batches[-1])
    outs = eng.generate(prompts, PARAMS, reuse=modes)
    assert [o.token_ids for o in outs] == alone
    steps = []
    for b in batches:
        counted = [sum(plan_rows(b.row_plans[s.seq_id], LAYERS)) / LAYERS if s.seq_id in b.row_plans else n
                   for s, n in zip(b.seqs, b.num_new_tokens)]
        assert sum(counted) <= budget and b.num_tokens <= eng.engine_config.max_blended_rows, (counted, b.num_tokens)
        steps.append((len(b.row_plans), b.num_tokens - 77 * len(b.row_plans)))
    # the third prompt's 5 counted rows fit the first step's budget, its 77 rows not the 192 left after 154; the
    # fourth's 45 do not fit the second's (48 - 2 decodes - 5), though its rows would
    assert steps[:3] == [(2, 0), (1, 2), (1, 3)], steps
