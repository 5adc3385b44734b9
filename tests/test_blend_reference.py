"""Blend mode in the reference engine (chunkwise/reference/blend.py, issue #28 §3), and `ReferenceModel.extend`.

The anchors: r = 1 is a full recompute (exact mode's output within float32 tolerance, every policy, any c0);
r = 0 composes the chunks' isolated K/V moved to their positions and recomputes only the fixed rows;
chunk-heads computes exactly each chunk's first floor(r * len + 0.5) tokens; kv-deviation filters its
candidates gradually down to k(r); adaptive keeps the same counts, shared among the chunks by Sainte-Laguë
apportionment of the deviations measured at each check layer (a chunk computed where it was registered, at the
prompt's start, gets none); bad input is refused by name. Tiny float32 models on CPU.
"""
from fractions import Fraction

import pytest
import torch

from chunkwise.chunks import Blend, ChunkReuse, Piece
from chunkwise.reference import Engine, SamplingParams
from chunkwise.reference.blend import apportioned, blend_prefill, check_ratio, num_kept, top_candidates
from chunkwise.reference.model import rotate

pytestmark = pytest.mark.correctness

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
ATOL = 2e-5
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)


def ids(eng, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, eng.model_config.vocab_size, (n,), generator=gen).tolist()


def composite(eng, seed=0):
    """[text, chunk A (11), text, chunk B (13), question]: 37 tokens; every chunk token has context before it."""
    a, b = eng.register_chunk(ids(eng, 11, seed + 1)), eng.register_chunk(ids(eng, 13, seed + 2))
    return [ids(eng, 4, seed + 3), a, ids(eng, 3, seed + 4), b, ids(eng, 6, seed + 5)]


def pieces_of(prompt):
    return tuple(Piece(p, len(p)) if not isinstance(p, list) else Piece(None, len(p)) for p in prompt)


def flat(prompt):
    return [t for p in prompt for t in (p if isinstance(p, list) else p.token_ids)]


def placed(eng, prompt):
    """The moved isolated K/V of the prompt's chunk rows, from a fresh forward of each chunk and `rotate`:
    {position: (k, v)} with k, v [layers, K, D]."""
    model, out, start = eng.model, {}, 0
    for p in prompt:
        if not isinstance(p, list):
            _, k, v = model.forward(torch.tensor(p.token_ids))
            for i in range(len(p)):
                ks = torch.stack([rotate(k[layer, i][:, None], torch.tensor([start]),
                                         model.inv_freq[model.cfg.layer_types[layer]])[:, 0]
                                  for layer in range(model.cfg.num_layers)])
                out[start + i] = ks, v[:, i]
        start += len(p)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_extend_after_the_prompts_own_cache_equals_the_full_forward(reference_engine, family):
    eng = reference_engine(family)
    tokens = torch.tensor(ids(eng, 30, 7))
    logits, k, v = eng.model.forward(tokens)
    for start in (0, 1, 17, 29):
        ext_logits, ext_k, ext_v = eng.model.extend(tokens[start:], start, k, v)
        torch.testing.assert_close(ext_logits, logits[start:], atol=ATOL, rtol=0)
        torch.testing.assert_close(ext_k, k, atol=ATOL, rtol=0)
        torch.testing.assert_close(ext_v, v, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["kv-deviation", "chunk-heads", "adaptive"])
def test_ratio_1_equals_exact_generation(reference_engine, family, policy):
    eng = reference_engine(family)
    prompt = composite(eng)
    exact = eng.generate(prompt, GREEDY)[0]
    blend = eng.generate(prompt, GREEDY, reuse=Blend(1.0, policy))[0]
    assert blend.token_ids == exact.token_ids
    for e, b in zip(exact.logprobs, blend.logprobs):
        assert b.keys() == e.keys() and all(abs(b[t] - e[t]) < 1e-4 for t in e)
    assert blend.chunk_reuse == tuple(ChunkReuse(r.chunk, r.num_tokens, 0, 0, r.num_tokens)
                                      for r in exact.chunk_reuse)
    for got, want in zip(eng.prefill_kv(prompt, reuse=Blend(1, policy)), eng.prefill_kv(prompt)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("c0", [1, 9, 20, 36])
def test_ratio_1_equals_the_full_forward_whatever_the_exact_prefix(reference_engine, family, c0):
    eng = reference_engine(family)
    prompt = composite(eng)
    logits, k, v = eng.model.forward(torch.tensor(flat(prompt)))
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(1.0), c0=c0)
    torch.testing.assert_close(out.k, k, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.v, v, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, logits[-1], atol=ATOL, rtol=0)
    starts = [0, 4, 15, 18, 31]
    assert [r.exact for r in out.chunk_reuse] == [max(0, min(s + r.num_tokens, c0) - s)
                                                  for s, r in zip(starts, out.chunk_reuse)]
    assert all(r.blended == 0 and r.exact + r.recomputed == r.num_tokens for r in out.chunk_reuse)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["kv-deviation", "chunk-heads", "adaptive"])
def test_ratio_0_composes_the_isolated_chunks_and_recomputes_the_rest_over_them(tiny_ckpt, family, policy):
    # page size 1: every chunk token is stored (with the default 16, these chunks would be all tail, computed as text)
    eng = Engine(tiny_ckpt(family), dtype="float32", device="cpu", page_size=1)
    prompt = composite(eng, seed=3)
    k, v = eng.prefill_kv(prompt, reuse=Blend(0.0, policy))
    exact_k, exact_v = eng.prefill_kv(prompt)
    # layer 0's K/V depend on the token and its position only: moving them is exact
    torch.testing.assert_close(k[0], exact_k[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(v[0], exact_v[0], atol=ATOL, rtol=0)
    moved = placed(eng, prompt)
    for pos, (pk, pv) in moved.items():
        torch.testing.assert_close(k[:, pos], pk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v[:, pos], pv, atol=ATOL, rtol=0)
    assert not torch.allclose(k[1:], exact_k[1:], atol=1e-3), "r=0 recomputed the chunks in context"
    # the fixed rows are a normal prefill over the composed cache: each text piece extends what precedes it
    start = 0
    for p in prompt:
        if isinstance(p, list):
            logits, ek, ev = eng.model.extend(torch.tensor(p), start, k, v)
            torch.testing.assert_close(ek[:, start:], k[:, start:start + len(p)], atol=ATOL, rtol=0)
            torch.testing.assert_close(ev[:, start:], v[:, start:start + len(p)], atol=ATOL, rtol=0)
        start += len(p)
    out = eng.generate(prompt, GREEDY, reuse=Blend(0, policy))[0]
    assert out.token_ids[0] == int(logits[-1].argmax())
    assert out.chunk_reuse == tuple(ChunkReuse(r.chunk, r.num_tokens, 0, r.num_tokens, 0) if r.chunk else r
                                    for r in eng.generate(prompt, GREEDY)[0].chunk_reuse)


def fresh_rows(out, moved, layer):
    """The chunk positions whose K at `layer` are not their moved isolated K: computed there, in context.
    (A row computed without context in view, e.g. deep in a chunk behind a sliding window, would look moved:
    the families below see context from every chunk row.)"""
    return [p for p in moved if not torch.allclose(out.k[layer, p], moved[p][0][layer], atol=ATOL)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.5, 0.99])
def test_chunk_heads_computes_exactly_each_chunks_first_tokens(reference_engine, family, ratio):
    eng = reference_engine(family, num_hidden_layers=3)
    prompt = composite(eng, seed=5)
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(ratio, "chunk-heads"))
    heads = {4: int(ratio * 11 + 0.5), 18: int(ratio * 13 + 0.5)}
    assert [(r.blended, r.recomputed) for r in out.chunk_reuse] == [
        (0, 4), (11 - heads[4], heads[4]), (0, 3), (13 - heads[18], heads[18]), (0, 6)]
    moved = placed(eng, prompt)
    want = [s + i for s, h in heads.items() for i in range(h)]
    for layer in (1, 2):     # layer 0's K/V are context-free: computed or moved, they agree
        assert fresh_rows(out, moved, layer) == want, layer
    for pos in set(moved) - set(want):
        torch.testing.assert_close(out.v[:, pos], moved[pos][1], atol=0, rtol=0)


def test_a_given_selection_is_computed_at_every_layer_in_place_of_the_policys(reference_engine):
    eng = reference_engine("qwen3", num_hidden_layers=3)
    prompt = composite(eng, seed=5)
    selection = torch.zeros(37, dtype=torch.bool)
    selection[[0, 5, 9, 20, 30, 36]] = True   # text rows and the last token are computed anyway
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(0.15, "kv-deviation"), selection=selection)
    assert [(r.blended, r.recomputed) for r in out.chunk_reuse] == [(0, 4), (9, 2), (0, 3), (11, 2), (0, 6)]
    moved = placed(eng, prompt)
    for layer in (1, 2):
        assert fresh_rows(out, moved, layer) == [5, 9, 20, 30], layer


@pytest.mark.parametrize("family", ["qwen3", "mistral", "llama"])
@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3, 0.6])
def test_kv_deviation_filters_gradually_down_to_k_of_r_candidates(reference_engine, family, ratio):
    eng = reference_engine(family, num_hidden_layers=5)     # check layers 1, 2, 3; layer 4 after them
    prompt = composite(eng, seed=9)
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(ratio))
    moved = placed(eng, prompt)
    n = len(moved)                                         # 24 candidates: the chunks' tokens
    # computed at layer 1: every candidate; at layer l > 1: those kept by check layer l - 1
    counts = [n, num_kept(check_ratio(ratio, 1, 3), n), num_kept(check_ratio(ratio, 2, 3), n), num_kept(ratio, n)]
    fresh = [fresh_rows(out, moved, layer) for layer in range(1, 5)]
    assert [len(f) for f in fresh] == counts
    assert all(set(later) <= set(earlier) for earlier, later in zip(fresh, fresh[1:])), "a dropped row came back"
    assert sum(r.recomputed for r in out.chunk_reuse if r.chunk) == num_kept(ratio, n)
    assert sum(r.recomputed for r in out.chunk_reuse if not r.chunk) == 13
    assert all(r.exact == 0 and r.blended + r.recomputed == r.num_tokens for r in out.chunk_reuse)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_adaptive_shares_each_check_layers_places_among_the_chunks_by_their_deviation(reference_engine, family, ratio):
    eng = reference_engine(family, num_hidden_layers=5)     # check layers 1, 2, 3; layer 4 after them
    prompt = composite(eng, seed=9)
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(ratio, "adaptive"))
    moved = placed(eng, prompt)
    n = len(moved)
    counts = [n, num_kept(check_ratio(ratio, 1, 3), n), num_kept(check_ratio(ratio, 2, 3), n), num_kept(ratio, n)]
    fresh = [fresh_rows(out, moved, layer) for layer in range(1, 5)]
    assert [len(f) for f in fresh] == counts               # kv-deviation's budget at every layer
    chunks = {"A": range(4, 15), "B": range(18, 31)}
    for layer in (1, 2, 3):   # the rows computed at a check layer, their deviation there, the rows going on
        alive, survivors = fresh[layer - 1], set(fresh[layer])
        dev = {p: float(((out.k[layer, p] - moved[p][0][layer]) ** 2).sum() + ((out.v[layer, p] - moved[p][1][layer])
                                                                              ** 2).sum()) for p in alive}
        held, sums, sizes = {}, {}, {}
        for name, rows in chunks.items():
            members = sorted((p for p in alive if p in rows), key=lambda p: (-dev[p], p))
            held[name] = sum(p in survivors for p in members)
            assert set(members[:held[name]]) <= survivors, (layer, name)   # its most deviating rows go on
            sums[name], sizes[name] = sum(Fraction(dev[p]) for p in members), len(members)
        # Sainte-Laguë: every place held is worth at least every place not taken
        last_held = min((sums[c] / (2 * held[c] - 1) for c in chunks if held[c]), default=None)
        next_free = max((sums[c] / (2 * held[c] + 1) for c in chunks if held[c] < sizes[c]), default=None)
        assert last_held is None or next_free is None or last_held >= next_free, (layer, held, sums)
    assert sum(r.recomputed for r in out.chunk_reuse if r.chunk) == num_kept(ratio, n)


@pytest.mark.parametrize("ratio", [0.15, 0.3])
def test_adaptive_spends_nothing_on_a_chunk_computed_where_it_was_registered(reference_engine, ratio):
    eng = reference_engine("qwen3", num_hidden_layers=5)
    prompt = composite(eng, seed=3)[1:]                     # [A, text, B, question]: A opens the prompt as alone
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(ratio, "adaptive"))
    assert out.chunk_reuse[0].recomputed == 0
    assert out.chunk_reuse[2].recomputed == num_kept(ratio, 11 + 13)


@pytest.mark.parametrize("policy", ["kv-deviation", "chunk-heads", "adaptive"])
def test_a_prompt_ending_in_a_chunk_computes_its_last_token_as_a_fixed_row(reference_engine, policy):
    eng = reference_engine("llama", num_hidden_layers=5)
    prompt = composite(eng, seed=4)[:4]                     # [text, A, text, B]: B's last token ends the prompt
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(0.0, policy))
    assert [(r.blended, r.recomputed) for r in out.chunk_reuse] == [(0, 4), (11, 0), (0, 3), (12, 1)]
    logits, k, v = eng.model.extend(torch.tensor(flat(prompt)[-1:]), 30, out.k, out.v)
    torch.testing.assert_close(out.logits, logits[0], atol=ATOL, rtol=0)
    moved = placed(eng, prompt)
    assert fresh_rows(out, moved, 4) == [30]
    out = blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(0.05, policy))
    selected = num_kept(0.05, 23) if policy != "chunk-heads" else num_kept(0.05, 11) + num_kept(0.05, 13)
    assert sum(r.recomputed for r in out.chunk_reuse if r.chunk) == selected + 1


def test_a_plain_prompt_has_nothing_to_blend(reference_engine):
    eng = reference_engine("qwen3")
    plain = flat(composite(eng, seed=2))
    out = eng.generate(plain, GREEDY, reuse="blend")[0]
    assert out.token_ids == eng.generate(plain, GREEDY)[0].token_ids and out.chunk_reuse is None


def test_apportioned_scores_each_chunks_rows_by_its_deviation_sum_over_odd_divisors():
    dev = torch.tensor([4.0, 4.0, 4.0, 4.0, 1.0, 3.0, 0.0, 0.0])
    groups = torch.tensor([1, 1, 1, 1, 4, 4, 7, 7])
    # group 1: S = 16 over 1, 3, 5, 7; group 4: S = 4, its 3.0 first; group 7: nothing moved
    want = [16, 16 / 3, 16 / 5, 16 / 7, 4 / 3, 4, 0, 0]
    assert apportioned(dev, groups).tolist() == pytest.approx(want)
    # the 5 highest go 4 to group 1 and 1 to group 4 (5 * 16 / 20 and 5 * 4 / 20)
    assert top_candidates(apportioned(dev, groups), torch.arange(8), 5).tolist() == [0, 1, 2, 3, 5]


def test_top_candidates_breaks_ties_toward_the_lower_position():
    dev = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 5.0])
    pos = torch.tensor([2, 4, 6, 8, 10, 12])
    assert top_candidates(dev, pos, 3).tolist() == [4, 6, 12]
    assert top_candidates(dev, pos, 0).tolist() == []
    assert top_candidates(torch.zeros(5), torch.arange(5) * 3, 2).tolist() == [0, 3]


@pytest.mark.parametrize("ratio, n, k", [(0.15, 24, 4), (0.05, 24, 1), (0.02, 24, 0), (1.0, 7, 7), (0.5, 5, 3)])
def test_k_of_r_rounds_half_up_and_caps_at_n(ratio, n, k):
    assert num_kept(ratio, n) == k


@pytest.mark.parametrize("make, match", [
    (lambda: Blend(1.5), "got 1.5"), (lambda: Blend(-0.1), "got -0.1"), (lambda: Blend(True), "got True"),
    (lambda: Blend(0.2, "cacheblend"), "got 'cacheblend'"), (lambda: "fuzzy", "got 'fuzzy'"),
    (lambda: Blend(1.01, "adaptive"), "got 1.01"), (lambda: Blend(-0.5, "adaptive"), "got -0.5"),
])
def test_bad_blend_input_is_refused_by_name(reference_engine, make, match):
    eng = reference_engine("qwen3")
    prompt = composite(eng)
    with pytest.raises(ValueError, match=match):
        eng.generate(prompt, GREEDY, reuse=make())
    with pytest.raises(ValueError, match=match):
        eng.prefill_kv(prompt, reuse=make())


@pytest.mark.parametrize("c0", [-1, 37, 40])
def test_blend_prefill_refuses_an_exact_prefix_outside_the_prompt(reference_engine, c0):
    eng = reference_engine("qwen3")
    prompt = composite(eng)
    with pytest.raises(ValueError, match=f"c0={c0} must be in \\[0, 36\\]"):
        blend_prefill(eng.model, flat(prompt), pieces_of(prompt), Blend(), c0=c0)
