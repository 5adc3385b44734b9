"""chunkwise.Engine against chunkwise.reference.Engine in float32 (the strict tier of docs/ARCHITECTURE.md).

Hypothesis draws the family and a tiny configuration, a batch of prompts (some sharing prefixes, some
repeating one page of tokens, some long enough for several KV tiles), chunk boundaries (some on tile, split
and page boundaries), page size, token budget, pool size (tight pools force preemption), and the split-KV
threshold and split size (small splits, so decodes span several). Greedy tokens must be identical to the
reference's for every request; cached K/V within a small relative error; prefix-cache hits exactly the full
pages computed by earlier requests. Seeded sampling must give the reference's tokens and logprobs.

The first test's pinned examples are the fast bug-catchers (scripts/mutants.py relies on them): each
crosses one boundary that a plausible bug gets wrong.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st
from parity_report import (assert_kv_close, assert_logprobs_match_reference, assert_same_tokens,
                           first_divergence)

import chunkwise.reference
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from tests.draws import costly

pytestmark = pytest.mark.correctness
# The strict tier is float32 end to end: no TF32 in torch's matmuls on GPU (the kernels use IEEE dots).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
MAX_MODEL_LEN = 320
# The kernels' float32 tiles for head_dim <= 128 (chunkwise/kernels/paged_attention.py tile_config, split_kv.py
# split_tile_config): 64 keys per KV tile in both, 64 query rows (64 // group tokens) per attention block.
KV_TILE = 64
QUERY_BLOCKS = [KV_TILE // group for group in (1, 2, 3)]
SPLIT_SIZES = [None, 64, 128]          # None: the engine's default (512: one split at these lengths)
# Examples per property scale with the profile (ci 4, dev 25, thorough 300): the main parity property
# runs twice the profile's count besides its eight pinned edges, the narrower ones half of it to twice it.
EXAMPLES = 2 * settings().max_examples
NARROW_EXAMPLES = 2 * settings().max_examples


@dataclass(frozen=True)
class Model:
    family: str
    layers: int = 2
    kv_heads: int = 2
    group: int = 2
    head_dim: int = 16
    window: int | None = None
    bias: bool = False               # attention_bias (Qwen2 has it by default; Llama/Qwen3 bias o_proj too)
    # initializer_range; 1.0 without q/k norm gives attention scores in the hundreds, so a split's log-sum-exp
    # lies beyond exp's float32 range (a merge that does not subtract the max overflows)
    init: float | None = None

    def checkpoint(self):
        # hidden 96: divisible by every head count drawn (HF's configs insist, though head_dim is explicit)
        kw = dict(hidden_size=96, num_hidden_layers=self.layers, num_attention_heads=self.kv_heads * self.group,
                  num_key_value_heads=self.kv_heads, head_dim=self.head_dim)
        if self.window is not None:
            kw["sliding_window"] = self.window
        if self.bias:
            kw["attention_bias"] = True
        if self.init is not None:
            kw["initializer_range"] = self.init
        return tiny_checkpoint(self.family, seed=0, **kw)


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    chunks: tuple[tuple[int, ...] | None, ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[int, ...]      # the step before which each request is added
    page_size: int
    budget: int                    # max_num_batched_tokens
    max_num_seqs: int
    spare_pages: int | None        # None: an ample pool; else the largest request's pages + this many
    split_kv_threshold: int | None = None   # decodes of longer sequences take split-KV (None: engine default)
    split_size: int | None = None           # split-KV split length (None: engine default)
    prefill_cap: int | None = None          # max_prefill_tokens_with_decodes

    def num_pages(self) -> int:
        most = max(len(p) + m - 1 for p, m in zip(self.prompts, self.max_tokens))
        need = -(-most // self.page_size)
        return 4 * len(self.prompts) * need + 8 if self.spare_pages is None else need + self.spare_pages

    def engine(self, ckpt) -> Engine:
        return Engine(ckpt, page_size=self.page_size, num_pages=self.num_pages(),
                      max_num_batched_tokens=self.budget, max_num_seqs=self.max_num_seqs,
                      max_model_len=MAX_MODEL_LEN, split_kv_threshold=self.split_kv_threshold,
                      split_size=self.split_size, max_prefill_tokens_with_decodes=self.prefill_cap)


def seeded_prompt(length: int, seed: int) -> tuple[int, ...]:
    """Token ids 3.. from a fixed seed: long prompts without Hypothesis drawing each token."""
    rng = random.Random(seed)
    return tuple(rng.randrange(3, VOCAB) for _ in range(length))


@st.composite
def models(draw) -> Model:
    family = draw(st.sampled_from(FAMILIES))
    # 70: a window reaching across a KV tile and a 64-token split
    window = draw(st.sampled_from([3, 8, 24, 70])) if family in ("mistral", "gemma3_text") else None
    return Model(family, layers=draw(st.integers(1, 2)), kv_heads=draw(st.sampled_from([1, 2])),
                 group=draw(st.sampled_from([1, 2, 3])), head_dim=draw(st.sampled_from([16, 24, 80])),
                 window=window, bias=family in ("llama", "qwen3") and draw(st.booleans()),
                 init=draw(st.sampled_from([None, None, 1.0])) if family in ("llama", "mistral", "qwen2") else None)


def cuts(draw, n: int, boundaries: list[int]) -> tuple[int, ...] | None:
    """None (the scheduler chooses) or chunk lengths summing to n; cut points drawn anywhere or on the
    given boundaries (tile, split and page multiples)."""
    if not draw(st.booleans()):
        return None
    inner = [b for b in boundaries if 0 < b < n]
    point = st.integers(1, n - 1) | st.sampled_from(inner) if inner else st.integers(1, n - 1)
    points = sorted(draw(st.sets(point, max_size=4))) if n > 1 else []
    bounds = [0, *points, n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def base_prompts(draw, page_size: int) -> list[int]:
    """The prefix the batch's prompts share: short and drawn, long (several KV tiles), or one page repeated."""
    tokens = st.integers(3, VOCAB - 1)
    kind = draw(st.sampled_from(["short", "short", "long", "repeated"]))
    event(f"base prompt: {kind}")
    if kind == "long":
        return list(seeded_prompt(draw(st.integers(130, 260)), draw(st.integers(0, 2 ** 16))))
    if kind == "repeated" and page_size <= 16:    # identical pages at different depths
        return draw(st.lists(tokens, min_size=page_size, max_size=page_size)) * draw(st.integers(2, 4))
    return draw(st.lists(tokens, min_size=1, max_size=40))


@st.composite
def workloads(draw) -> Workload:
    page_size = draw(st.one_of(st.sampled_from([1, 3, 4, 16, 64]), st.integers(1, 64)))
    split_size = draw(st.sampled_from(SPLIT_SIZES))
    base = draw(base_prompts(page_size))
    tokens = st.integers(3, VOCAB - 1)
    prompts = []
    for _ in range(draw(st.integers(1, 3))):
        share = draw(st.integers(0, len(base)))
        tail = draw(st.lists(tokens, min_size=0 if share else 1, max_size=10))
        prompts.append(tuple(base[:share] + tail))
    n = len(prompts)
    longest = max(len(p) for p in prompts)
    step = {KV_TILE, *QUERY_BLOCKS, page_size, split_size or KV_TILE}
    boundaries = sorted({m for s in step for m in range(s, longest, s)})
    # Long prompts get a budget that fits them in a few steps: the interpreter's cost is per step.
    budget = draw(st.integers(8, 64) if longest <= 64 else st.sampled_from([64, 100, 256]))
    return Workload(
        prompts=tuple(prompts), chunks=tuple(cuts(draw, len(p), boundaries) for p in prompts),
        max_tokens=tuple(draw(st.integers(1, 6)) for _ in range(n)),
        arrivals=(0, *(draw(st.integers(0, 4)) for _ in range(n - 1))),
        page_size=page_size, budget=budget, max_num_seqs=draw(st.integers(1, 4)),
        spare_pages=draw(st.one_of(st.none(), st.integers(0, 2))),
        split_kv_threshold=draw(st.sampled_from([None, 0, 6, 64, 100])), split_size=split_size,
        prefill_cap=draw(st.none() | st.integers(1, budget)))


class CachedPrefixes:
    """An independent model of the prefix cache: every full page of tokens the engine has computed, keyed
    by the whole token prefix ending with that page (what the page's K/V depends on)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.prefixes: set[tuple[int, ...]] = set()

    def add(self, tokens, num_computed: int) -> None:
        ps = self.page_size
        self.prefixes.update(tuple(tokens[:k * ps]) for k in range(1, num_computed // ps + 1))

    def hit(self, prompt) -> int:
        """Tokens a new request finds cached: its longest cached run of full pages, short of its last token
        (which is always computed, for its logits)."""
        k = (len(prompt) - 1) // self.page_size
        while k and tuple(prompt[:k * self.page_size]) not in self.prefixes:
            k -= 1
        return k * self.page_size


def run_streaming(eng: Engine, w: Workload, params: list[SamplingParams]):
    """Adds each request before its arrival step (at once when the engine idles).

    Returns the outputs in prompt order and, per request, the cached tokens that the independent model
    expects at its admission: the full pages that requests computed in earlier steps.
    Checks on the way that each request's streamed tokens add up to its output.
    """
    pending = sorted(range(len(w.prompts)), key=lambda i: w.arrivals[i])
    rids: dict[int, int] = {}
    prompts: dict[int, tuple[int, ...]] = {}
    outputs, streamed, expected = {}, {}, {}
    cache = CachedPrefixes(w.page_size)
    step = 0
    while pending or eng.has_unfinished():
        if not eng.has_unfinished():
            step = max(step, w.arrivals[pending[0]])
        while pending and w.arrivals[pending[0]] <= step:
            i = pending.pop(0)
            rids[i] = rid = eng.add_request(list(w.prompts[i]), params[i], w.chunks[i])
            prompts[rid] = w.prompts[i]
        finished_now = []
        for r in eng.step():
            streamed.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finished:
                outputs[r.request_id] = r.output
                finished_now.append(r.output)
        running = {rid: s for rid, s in eng.scheduler.seqs.items() if s.num_computed_tokens}
        for rid in [*running, *(o.request_id for o in finished_now)]:
            if rid not in expected:            # admitted in this step: it saw the cache as it was before it
                expected[rid] = cache.hit(prompts[rid])
        for s in running.values():
            cache.add(s.token_ids, s.num_computed_tokens)
        for o in finished_now:                  # every token but the last sampled one was computed
            cache.add(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids) + len(o.token_ids) - 1)
        step += 1
    for rid, o in outputs.items():
        assert streamed.get(rid, []) == o.token_ids, \
            f"request {rid}: streamed tokens {streamed.get(rid)} differ from its output {o.token_ids}"
    return [outputs[rids[i]] for i in range(len(w.prompts))], [expected[rids[i]] for i in range(len(w.prompts))]


EDGE = Workload(  # a 1-token chunk, a chunk ending on a page boundary, a shared prefix of one page
    prompts=((11, 12, 13, 14, 15, 16, 17, 18, 19), (11, 12, 13, 14, 50, 51)), chunks=((1, 3, 4, 1), None),
    max_tokens=(4, 3), arrivals=(0, 3), page_size=4, budget=16, max_num_seqs=2, spare_pages=None,
    split_kv_threshold=0)
TIGHT = Workload(  # page size 1 in a pool that forces preemption; 3 prefill tokens beside a decode
    prompts=((7, 8, 9, 10, 11), (7, 8, 9, 30), (40, 41, 42)), chunks=((2, 3), (1, 1, 2), None),
    max_tokens=(5, 4, 3), arrivals=(0, 0, 1), page_size=1, budget=8, max_num_seqs=3, spare_pages=1, prefill_cap=3)
# 200 tokens, chunks ending on KV-tile, split and page boundaries (64, 128), then decodes over four 64-token
# splits, the last one partly filled.
LONG = Workload(
    prompts=(seeded_prompt(200, 1),), chunks=((64, 64, 72),), max_tokens=(6,), arrivals=(0,), page_size=16,
    budget=256, max_num_seqs=2, spare_pages=None, split_kv_threshold=0, split_size=64)
# One step holds a split-KV decode (70 tokens: two splits) and a prompt's last chunk: both sample, and the
# decode comes first in the batch but last in the logits rows.
MIXED = Workload(
    prompts=(seeded_prompt(70, 2), seeded_prompt(12, 3)), chunks=(None, None), max_tokens=(5, 3),
    arrivals=(0, 2), page_size=8, budget=64, max_num_seqs=2, spare_pages=None, split_kv_threshold=0,
    split_size=64)
# The same prompt twice, the second after the first computed it: every page of it is cached, and the
# second must still compute its last token.
FULL_HIT = Workload(
    prompts=(seeded_prompt(16, 4),) * 2, chunks=(None, None), max_tokens=(3, 3), arrivals=(0, 3), page_size=8,
    budget=32, max_num_seqs=2, spare_pages=None, split_kv_threshold=0)
# Identical pages at different depths: one page repeated (U U U U), and pages A B at depth 1 of X A B and at
# depth 0 of A B C: X A B C may reuse X A B, but not the C computed after A B alone.
_U, _X, _A, _B, _C = ((10, 11, 12, 13), (20, 21, 22, 23), (30, 31, 32, 33), (40, 41, 42, 43), (50, 51, 52, 53))
REPEATED = Workload(
    prompts=(_U * 4 + (7,), _U * 4 + (9, 10), _X + _A + _B + (5,), _A + _B + _C + (6,), _X + _A + _B + _C + (8,)),
    chunks=(None,) * 5, max_tokens=(2,) * 5, arrivals=(0, 3, 6, 9, 12), page_size=4, budget=64, max_num_seqs=2,
    spare_pages=None, split_kv_threshold=0, split_size=64)
# A sliding window (70) across a KV tile and a split boundary, a chunk ending mid-tile, decodes split-KV.
WINDOW_LONG = Workload(
    prompts=(seeded_prompt(150, 5), seeded_prompt(140, 5)[:100] + (9, 9)), chunks=((64, 21, 65), None),
    max_tokens=(4, 3), arrivals=(0, 1), page_size=7, budget=100, max_num_seqs=2, spare_pages=None,
    split_kv_threshold=6, split_size=64)


@costly(max_examples=EXAMPLES)
@example(model=Model("gemma3_text", kv_heads=1, group=3, head_dim=24, window=3), w=EDGE, greedy_stop=False)
@example(model=Model("qwen2", kv_heads=2, group=1, head_dim=80), w=TIGHT, greedy_stop=True)
@example(model=Model("llama", layers=1, kv_heads=1, group=2, bias=True), w=TIGHT, greedy_stop=False)
@example(model=Model("qwen3", layers=1, kv_heads=2, group=2), w=LONG, greedy_stop=False)
@example(model=Model("llama", layers=1, kv_heads=2, group=3, init=1.0), w=MIXED, greedy_stop=False)
@example(model=Model("qwen2", layers=1, kv_heads=1, group=2), w=FULL_HIT, greedy_stop=False)
@example(model=Model("qwen3", layers=1, kv_heads=2, group=2), w=REPEATED, greedy_stop=False)
@example(model=Model("mistral", layers=1, kv_heads=2, group=2, window=70), w=WINDOW_LONG, greedy_stop=False)
@given(model=models(), w=workloads(), greedy_stop=st.booleans())
def test_greedy_tokens_and_cached_kv_match_reference(model: Model, w: Workload, greedy_stop: bool):
    ckpt = model.checkpoint()
    params = [SamplingParams(max_tokens=m, ignore_eos=not greedy_stop) for m in w.max_tokens]
    eng = w.engine(ckpt)
    ref = chunkwise.reference.Engine(ckpt, max_model_len=MAX_MODEL_LEN)
    label = f"{model} {w}"
    outs, expected_cached = run_streaming(eng, w, params)
    want = [o.token_ids for o in ref.generate([list(p) for p in w.prompts], params)]
    assert_same_tokens(ref, w.prompts, [o.token_ids for o in outs], want, label)
    got_cached = [o.num_cached_tokens for o in outs]
    if w.spare_pages is None:    # an ample pool never evicts: the model of the cache is exact
        assert got_cached == expected_cached, \
            f"cached tokens per request {got_cached}, the full pages computed before each: {expected_cached}" \
            f"\n  in {label}"
    else:                        # a tight pool may have evicted some of them
        assert all(g % w.page_size == 0 and g <= e for g, e in zip(got_cached, expected_cached)), \
            f"cached tokens per request {got_cached}, at most {expected_cached} expected\n  in {label}"
    event(f"prefix cache hit: {any(got_cached)}")
    assert eng.page_pool.num_free_pages == w.num_pages(), \
        f"{w.num_pages() - eng.page_pool.num_free_pages} pages leaked\n  in {label}"
    assert_kv_close(ref, w.prompts[0], eng.prefill_kv(list(w.prompts[0]), w.chunks[0]),
                    ref.prefill_kv(list(w.prompts[0])), label)


# Temperature 1, no top-k/top-p, logprobs of the sampled token only: a sampled token that is not the argmax
# (seed 7 draws some) must still be the one whose logprob is reported.
SAMPLED = (Model("qwen3", layers=1, kv_heads=2, group=2), (seeded_prompt(9, 6), seeded_prompt(70, 7)),
           SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=0, ignore_eos=True))


@costly(max_examples=settings().max_examples)   # the sampler itself is checked against HF in test_sampling.py
@example(model=SAMPLED[0], prompts=SAMPLED[1], params=SAMPLED[2])
@given(model=models(), prompts=st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40).map(tuple),
                                        min_size=1, max_size=3),
       params=st.builds(SamplingParams, max_tokens=st.integers(1, 8), temperature=st.sampled_from([0.5, 1.0, 1.5]),
                        top_k=st.sampled_from([0, 3, 20]), top_p=st.sampled_from([1.0, 0.9, 0.5]),
                        seed=st.integers(0, 2 ** 31), logprobs=st.sampled_from([0, 1, 5]), ignore_eos=st.just(True)))
def test_seeded_sampling_tokens_and_logprobs_match_reference(model: Model, prompts, params: SamplingParams):
    """The same seed gives the reference's tokens, and both engines report the sampled token's log-softmax
    (checked against the reference's logits, not the shared sampler) and the same top logprobs."""
    ckpt = model.checkpoint()
    eng = Engine(ckpt, page_size=8, num_pages=128, max_model_len=MAX_MODEL_LEN, split_kv_threshold=0,
                 split_size=64)
    ref = chunkwise.reference.Engine(ckpt, max_model_len=MAX_MODEL_LEN)
    label = f"{model} {params}"
    outs = eng.generate([list(p) for p in prompts], params)
    want = ref.generate([list(p) for p in prompts], params)
    assert_same_tokens(ref, prompts, [o.token_ids for o in outs], [o.token_ids for o in want], label)
    assert_logprobs_match_reference(ref, prompts, outs, f"{label} (optimized)")
    assert_logprobs_match_reference(ref, prompts, want, f"{label} (reference)")
    for i, (o, r) in enumerate(zip(outs, want)):
        keys = [set(lp) for lp in o.logprobs], [set(lp) for lp in r.logprobs]
        assert keys[0] == keys[1], f"request {i} logprob keys {keys[0]} vs reference {keys[1]}\n  in {label}"
    off_top = sum(t != int(torch.argmax(ref.logits(list(p) + o.token_ids[:j])[-1]))
                  for p, o in zip(prompts, outs) for j, t in enumerate(o.token_ids))
    event(f"a sampled token was not the argmax: {off_top > 0}")
    note(f"{off_top} sampled tokens were not the argmax")
    if (model, prompts, params) == SAMPLED:   # the pinned case exists to sample off the argmax
        assert off_top > 0, "the pinned seeded case sampled only argmax tokens: it no longer tests sampled logprobs"


def test_soft_capped_logits_give_hfs_logprobs_and_the_references_samples(hf_model, reference_engine):
    """Gemma's final_logit_softcapping leaves greedy tokens alone (tanh is monotonic) but not logprobs or samples: the
    engine's logprobs are the log-softmax of HF's capped logits, and its seeded samples are the reference's."""
    cap = {"final_logit_softcapping": 2.0}
    eng = Engine(tiny_checkpoint("gemma3_text", **cap), page_size=4, num_pages=32, max_model_len=64)
    prompt = list(seeded_prompt(12, 3))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=3, ignore_eos=True)
    out = eng.generate([prompt], params)[0]
    assert out.token_ids == reference_engine("gemma3_text", **cap).generate([prompt], params)[0].token_ids
    with torch.no_grad():
        logits = hf_model("gemma3_text", **cap)(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    assert logits.abs().max() < 2.0
    want = torch.log_softmax(logits.float(), dim=-1)
    for j, lps in enumerate(out.logprobs):
        assert len(lps) >= 3 and out.token_ids[j] in lps
        assert all(abs(v - float(want[j, t])) < 1e-4 for t, v in lps.items()), (j, lps, want[j].topk(3))


@st.composite
def layouts(draw) -> tuple[tuple[int, ...], tuple[tuple[int, int | None], ...]]:
    """A prompt and two (page size, chunking) layouts of it: chunking None (the scheduler's), 1 (a token a
    step) or a chunk length."""
    prompt = tuple(draw(st.lists(st.integers(3, VOCAB - 1), min_size=2, max_size=48)))
    return prompt, tuple((draw(st.integers(1, 64)), draw(st.none() | st.just(1) | st.integers(2, len(prompt))))
                         for _ in range(2))


# A token a step costs a step each in the interpreter: the pinned cases carry that edge on short prompts, and
# the random draws are fewer than the profile's count.
@costly(max_examples=max(2, settings().max_examples // 2))
@example(model=Model("qwen3", layers=2, kv_heads=2, group=2), layout=(seeded_prompt(12, 8), ((1, 1), (64, None))))
@example(model=Model("gemma3_text", kv_heads=1, group=3, head_dim=24, window=3),
         layout=(seeded_prompt(17, 9), ((3, 5), (16, 1))))
@example(model=Model("llama", layers=1, kv_heads=1, group=2), layout=(seeded_prompt(40, 10), ((7, None), (5, 16))))
@given(model=models(), layout=layouts())
def test_tokens_do_not_depend_on_chunking_or_page_size(model: Model, layout):
    prompt, runs = layout
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tokens = []
    for page_size, chunks in runs:
        eng = Engine(model.checkpoint(), page_size=page_size, num_pages=64, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=False)
        tokens.append(eng.generate([list(prompt)], params, chunk_sizes=chunks)[0].token_ids)
    assert tokens[0] == tokens[1], f"{model}: (page_size, chunking) {runs}: tokens {tokens}"


@settings(max_examples=NARROW_EXAMPLES)
@given(data=st.data())
def test_prefix_cache_reuses_exactly_the_full_pages_shared_with_an_earlier_request(data):
    model = data.draw(models(), label="model")
    tokens = st.integers(3, VOCAB - 1)
    first = data.draw(st.lists(tokens, min_size=1, max_size=40), label="first")
    page_size = data.draw(st.integers(1, 16), label="page_size")
    share = data.draw(st.integers(0, len(first)), label="share")
    second = first[:share] + data.draw(st.lists(tokens, min_size=1, max_size=8), label="tail")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng = Engine(model.checkpoint(), page_size=page_size, num_pages=64, max_model_len=MAX_MODEL_LEN)
    a = eng.generate([first], params)[0]
    b = eng.generate([second], params)[0]
    computed = first + a.token_ids[:-1]      # the last sampled token never reaches the cache
    common = min(first_divergence(computed, second), len(second) - 1)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == common // page_size * page_size, \
        f"{model}: page {page_size}, shared {common} tokens, cached {b.num_cached_tokens}"
    ref = chunkwise.reference.Engine(model.checkpoint(), max_model_len=MAX_MODEL_LEN)
    assert_same_tokens(ref, [second], [b.token_ids], [ref.generate([second], params)[0].token_ids],
                       f"{model} cached {b.num_cached_tokens}")
