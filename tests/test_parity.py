"""optimized.Engine against reference.Engine in float32 (the strict tier of DESIGN.md).

Hypothesis draws the family and a tiny configuration, a batch of prompts (some sharing prefixes, some
arriving while others decode), chunk boundaries, page size, token budget and pool size (tight pools
force preemption). Greedy tokens must be identical to the reference's for every request; cached K/V
within a small relative error; prefix-cache hits exactly the full pages shared with earlier requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reference
from chunkwise.checkpoints import tiny_checkpoint
from optimized import Engine, SamplingParams

pytestmark = pytest.mark.correctness
# The strict tier is float32 end to end: no TF32 in torch's matmuls on GPU (the kernels use IEEE dots).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
VOCAB = 384                  # the tiny factory's vocabulary
MAX_MODEL_LEN = 128
KV_RTOL = 1e-4               # float32, different summation orders: measured errors are ~1e-6
# Examples per property scale with the profile (ci 10, dev 25, thorough 300): the main parity property
# runs five times the profile's count, the two narrower ones three times (ci: 50 and 30, about a minute).
EXAMPLES = 5 * settings().max_examples
NARROW_EXAMPLES = 3 * settings().max_examples


@dataclass(frozen=True)
class Model:
    family: str
    layers: int = 2
    kv_heads: int = 2
    group: int = 2
    head_dim: int = 16
    window: int | None = None
    bias: bool = False               # attention_bias (Qwen2 has it by default; Llama/Qwen3 bias o_proj too)

    def checkpoint(self):
        # hidden 96: divisible by every head count drawn (HF's configs insist, though head_dim is explicit)
        kw = dict(hidden_size=96, num_hidden_layers=self.layers, num_attention_heads=self.kv_heads * self.group,
                  num_key_value_heads=self.kv_heads, head_dim=self.head_dim)
        if self.window is not None:
            kw["sliding_window"] = self.window
        if self.bias:
            kw["attention_bias"] = True
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

    def num_pages(self) -> int:
        most = max(len(p) + m - 1 for p, m in zip(self.prompts, self.max_tokens))
        need = -(-most // self.page_size)
        return 4 * len(self.prompts) * need + 8 if self.spare_pages is None else need + self.spare_pages


@st.composite
def models(draw) -> Model:
    family = draw(st.sampled_from(FAMILIES))
    window = draw(st.sampled_from([3, 8, 24])) if family in ("mistral", "gemma3_text") else None
    return Model(family, layers=draw(st.integers(1, 2)), kv_heads=draw(st.sampled_from([1, 2])),
                 group=draw(st.sampled_from([1, 2, 3])), head_dim=draw(st.sampled_from([16, 24, 80])),
                 window=window, bias=family in ("llama", "qwen3") and draw(st.booleans()))


def cuts(draw, n: int) -> tuple[int, ...] | None:
    """None (the scheduler chooses) or chunk lengths summing to n, from sorted cut points."""
    if not draw(st.booleans()):
        return None
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    bounds = [0, *points, n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def workloads(draw) -> Workload:
    tokens = st.integers(3, VOCAB - 1)
    base = draw(st.lists(tokens, min_size=1, max_size=40))
    prompts = []
    for _ in range(draw(st.integers(1, 3))):
        share = draw(st.integers(0, len(base)))
        tail = draw(st.lists(tokens, min_size=0 if share else 1, max_size=10))
        prompts.append(tuple(base[:share] + tail))
    n = len(prompts)
    return Workload(
        prompts=tuple(prompts), chunks=tuple(cuts(draw, len(p)) for p in prompts),
        max_tokens=tuple(draw(st.integers(1, 6)) for _ in range(n)),
        arrivals=(0, *(draw(st.integers(0, 4)) for _ in range(n - 1))),
        page_size=draw(st.one_of(st.sampled_from([1, 3, 4, 16, 64]), st.integers(1, 64))),
        budget=draw(st.integers(8, 64)), max_num_seqs=draw(st.integers(1, 4)),
        spare_pages=draw(st.one_of(st.none(), st.integers(0, 2))),
        split_kv_threshold=draw(st.sampled_from([None, 0, 6])))


def run_streaming(eng: Engine, w: Workload, params: list[SamplingParams]):
    """Adds each request before its arrival step (at once when the engine idles); outputs in prompt order."""
    pending = sorted(range(len(w.prompts)), key=lambda i: w.arrivals[i])
    rids: dict[int, int] = {}
    outputs = {}
    step = 0
    while pending or eng.has_unfinished():
        if not eng.has_unfinished():
            step = max(step, w.arrivals[pending[0]])
        while pending and w.arrivals[pending[0]] <= step:
            i = pending.pop(0)
            rids[i] = eng.add_request(list(w.prompts[i]), params[i], w.chunks[i])
        for r in eng.step():
            if r.finished:
                outputs[r.request_id] = r.output
        step += 1
    return [outputs[rids[i]] for i in range(len(w.prompts))]


def top2_margin(ref: reference.Engine, tokens: list[int]) -> float:
    """The reference's gap between its two most likely next tokens after `tokens` (logit units)."""
    top = torch.topk(ref.logits(tokens)[-1], 2).values
    return float(top[0] - top[1])


def assert_same_tokens(ref, prompts, got, want, label: str):
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        if g == w:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        margin = top2_margin(ref, list(p) + w[:pos])
        raise AssertionError(
            f"{label}: request {i} (prompt of {len(p)} tokens) diverges at generated token {pos}: "
            f"optimized {g[pos:pos + 3]} vs reference {w[pos:pos + 3]}; reference top-2 margin there {margin:.4g}")


def assert_kv_close(ref, prompt, got, want, label: str):
    for name, a, b in (("K", got[0], want[0]), ("V", got[1], want[1])):
        assert a.shape == b.shape, f"{label}: {name} shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
        for layer in range(b.shape[0]):
            err = (a[layer] - b[layer]).abs()
            tol = KV_RTOL * (b[layer].abs() + b[layer].abs().max())
            if (err > tol).any():
                pos, head, dim = (int(x) for x in torch.nonzero(err > tol)[0])
                margin = top2_margin(ref, list(prompt[:pos + 1]))
                raise AssertionError(
                    f"{label}: {name} of layer {layer}, position {pos}, head {head}, dim {dim}: "
                    f"{float(a[layer, pos, head, dim]):.6g} vs reference {float(b[layer, pos, head, dim]):.6g} "
                    f"(max abs err {float(err.max()):.3g}); reference top-2 margin there {margin:.4g}")


def longest_common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


EDGE = Workload(  # a 1-token chunk, a chunk ending on a page boundary, a shared prefix of one page
    prompts=((11, 12, 13, 14, 15, 16, 17, 18, 19), (11, 12, 13, 14, 50, 51)), chunks=((1, 3, 4, 1), None),
    max_tokens=(4, 3), arrivals=(0, 3), page_size=4, budget=16, max_num_seqs=2, spare_pages=None,
    split_kv_threshold=0)
TIGHT = Workload(  # page size 1 in a pool that forces preemption
    prompts=((7, 8, 9, 10, 11), (7, 8, 9, 30), (40, 41, 42)), chunks=((2, 3), (1, 1, 2), None),
    max_tokens=(5, 4, 3), arrivals=(0, 0, 1), page_size=1, budget=8, max_num_seqs=3, spare_pages=1)


@settings(max_examples=EXAMPLES)
@example(model=Model("gemma3_text", kv_heads=1, group=3, head_dim=24, window=3), w=EDGE, greedy_stop=False)
@example(model=Model("qwen2", kv_heads=2, group=1, head_dim=80), w=TIGHT, greedy_stop=True)
@example(model=Model("llama", layers=1, kv_heads=1, group=2, bias=True), w=TIGHT, greedy_stop=False)
@given(model=models(), w=workloads(), greedy_stop=st.booleans())
def test_greedy_tokens_and_cached_kv_match_reference(model: Model, w: Workload, greedy_stop: bool):
    ckpt = model.checkpoint()
    params = [SamplingParams(max_tokens=m, ignore_eos=not greedy_stop) for m in w.max_tokens]
    eng = Engine(ckpt, page_size=w.page_size, num_pages=w.num_pages(), max_num_batched_tokens=w.budget,
                 max_num_seqs=w.max_num_seqs, max_model_len=MAX_MODEL_LEN,
                 split_kv_threshold=w.split_kv_threshold)
    ref = reference.Engine(ckpt, max_model_len=MAX_MODEL_LEN)
    label = f"{model} {w}"
    outs = run_streaming(eng, w, params)
    want = [o.token_ids for o in ref.generate([list(p) for p in w.prompts], params)]
    assert_same_tokens(ref, w.prompts, [o.token_ids for o in outs], want, label)
    for i, o in enumerate(outs):
        others = [list(w.prompts[j]) + want[j] for j in range(len(outs)) if j != i]
        shared = max((longest_common_prefix(w.prompts[i], t) for t in others), default=0)
        bound = min(shared, len(o.prompt_token_ids) - 1)
        assert o.num_cached_tokens % w.page_size == 0 and o.num_cached_tokens <= bound, \
            f"{label}: request {i} reports {o.num_cached_tokens} cached tokens, sharing {shared} with others"
    assert eng.page_pool.num_free_pages == w.num_pages(), f"{label}: pages leaked"
    assert_kv_close(ref, w.prompts[0], eng.prefill_kv(list(w.prompts[0]), w.chunks[0]),
                    ref.prefill_kv(list(w.prompts[0])), label)


@settings(max_examples=NARROW_EXAMPLES)
@given(data=st.data())
def test_tokens_do_not_depend_on_chunking_or_page_size(data):
    model = data.draw(models(), label="model")
    prompt = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=2, max_size=48), label="prompt")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        page_size = data.draw(st.integers(1, 64), label="page_size")
        chunks = data.draw(st.none() | st.just(1) | st.integers(2, len(prompt)), label="chunking")
        eng = Engine(model.checkpoint(), page_size=page_size, num_pages=64, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=False)
        runs.append((page_size, chunks, eng.generate([prompt], params, chunk_sizes=chunks)[0].token_ids))
    assert runs[0][2] == runs[1][2], f"{model}: (page_size, chunking, tokens) {runs}"


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
    common = min(longest_common_prefix(computed, second), len(second) - 1)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == common // page_size * page_size, \
        f"{model}: page {page_size}, shared {common} tokens, cached {b.num_cached_tokens}"
    ref = reference.Engine(model.checkpoint(), max_model_len=MAX_MODEL_LEN)
    assert_same_tokens(ref, [second], [b.token_ids], [ref.generate([second], params)[0].token_ids],
                       f"{model} cached {b.num_cached_tokens}")
