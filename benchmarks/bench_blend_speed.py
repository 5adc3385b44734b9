"""Blend mode's speed against exact mode and the recompute roofline, same process, same prompts (GPU; issue #28 §5).

    pytest --benchmark-only benchmarks/bench_blend_speed.py -s

A random bf16 model of Qwen3-0.6B's shape (quality is benchmarks/bench_blend.py's, on real checkpoints); 20
registered documents of 512 random tokens, each pinned. Two cases, each after a warm-up run of the same shape:
  ttft    a composed request: 8 documents in a fresh random order + a 64-token question, max_tokens 1; the median
          over REPS requests of the time to its first token, exact mode (reuses only the first document, which
          opens the prompt) against blend at r = 0.15 (kv-deviation and chunk-heads), and the blends again with
          their tail graphs off (the layers after the check layers eager, as before those graphs).
  rag     256 requests, each 4 of the 20 documents in random order + a 64-token question, 128 output tokens
          (ignore_eos), all submitted at once: output tokens/s.
The roofline is exact recompute's ideal (benchmarks/roofline.py from ceilings measured first in this process):
every prompt token computed at the matmul rate, decode steps at the copy/matmul bound.
"""
from __future__ import annotations

import random
import statistics
import time
from collections import Counter

import pytest
import torch

from benchmarks.bench_engine import QWEN3_0_6B_SHAPE, ceilings, ckpt  # noqa: F401  (fixtures: the same model, ceilings measured once)
from benchmarks.roofline import ModelCost, workload_roofline
from chunkwise.chunks import Blend
from chunkwise.engine import Engine, SamplingParams
from chunkwise.model_config import ModelConfig

pytestmark = pytest.mark.gpu

NUM_DOCS, DOC_LEN, QUESTION_LEN = 20, 512, 64
TTFT_DOCS, REPS = 8, 7
RAG_REQUESTS, RAG_DOCS, RAG_OUTPUT = 256, 4, 128
# "recompute": the same ids as one plain prompt (no chunk boundaries: prefilled by the token budget alone); "exact":
# the composite prompt in exact mode (its pieces scheduled by the token budget too, issue 49).
MODES = {"recompute": None, "exact": "exact", "blend r=0.15": Blend(0.15),
         "chunk-heads r=0.15": Blend(0.15, "chunk-heads")}
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def setup(ckpt):
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=TTFT_DOCS * DOC_LEN + QUESTION_LEN + RAG_OUTPUT + 16,
                 max_num_batched_tokens=8192, max_num_seqs=256)
    rng = random.Random(0)
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    docs = [eng.register_chunk([rng.randrange(3, vocab) for _ in range(DOC_LEN)], pin=True) for _ in range(NUM_DOCS)]
    return eng, docs, rng


def composed(docs, rng: random.Random, k: int, vocab: int) -> list:
    """k documents in a random order, then a question of fresh random ids (never cached)."""
    return rng.sample(docs, k) + [[rng.randrange(3, vocab) for _ in range(QUESTION_LEN)]]


def as_mode(prompt: list, mode) -> tuple[list, str | Blend]:
    """The prompt and reuse mode to submit: "recompute" sends the concatenated ids."""
    if mode is None:
        return [t for p in prompt for t in (p.token_ids if hasattr(p, "token_ids") else p)], "exact"
    return prompt, mode


def sync():
    torch.cuda.synchronize()


def test_ttft_of_a_composed_request(benchmark, setup, ceilings, ckpt):
    eng, docs, rng = setup
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    cost = ModelCost.of(ModelConfig.from_dir(ckpt), ckpt)
    prompt_len = TTFT_DOCS * DOC_LEN + QUESTION_LEN
    roof = cost.prefill_flops(prompt_len) / ceilings.matmul_flops_per_s
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    out = {}
    graphs = eng.executor.runner.graphs
    tail_rows = graphs.tail_rows
    # The blends again with their layers after the check layers run eagerly (no tail graph): the same-run baseline
    # of the tail graphs (chunkwise/engine/cuda_graphs.py).
    runs = [(name, mode, tail_rows) for name, mode in MODES.items()]
    runs += [(f"{name}, eager tail", mode, 0) for name, mode in MODES.items() if isinstance(mode, Blend)]
    for name, mode, rows in runs:
        graphs.tail_rows = rows
        prompt, reuse_mode = as_mode(composed(docs, rng, TTFT_DOCS, vocab), mode)
        eng.generate([prompt], one, reuse=reuse_mode, use_tqdm=False)   # warm-up: every specialisation
        times, reuse = [], None
        launches = Counter(eng.executor.runner.launches)
        for _ in range(REPS):
            prompt, reuse_mode = as_mode(composed(docs, rng, TTFT_DOCS, vocab), mode)
            sync()
            t = time.perf_counter()
            o = eng.generate([prompt], one, reuse=reuse_mode, use_tqdm=False)[0]
            sync()
            times.append(time.perf_counter() - t)
            reuse = o.chunk_reuse
        ttft = statistics.median(times)
        counts = ([sum(getattr(r, f) for r in reuse) for f in ("exact", "blended", "recomputed")] if reuse
                  else [o.num_cached_tokens, 0, prompt_len - o.num_cached_tokens])
        steps = {f"{kind} {path}": n for (kind, path), n in sorted((eng.executor.runner.launches - launches).items())}
        out[name] = dict(ttft_ms=1e3 * ttft, roofline_ratio=roof / ttft, reuse_exact_blended_recomputed=counts,
                         steps=steps)
    graphs.tail_rows = tail_rows
    for name, r in out.items():
        r["speedup_vs_exact"] = out["exact"]["ttft_ms"] / r["ttft_ms"]
        r["speedup_vs_recompute"] = out["recompute"]["ttft_ms"] / r["ttft_ms"]
        print(f"[ttft] {name}: {r['ttft_ms']:.1f} ms, {r['speedup_vs_exact']:.2f}x exact, "
              f"{r['speedup_vs_recompute']:.2f}x recompute, {100 * r['roofline_ratio']:.0f}% of the recompute roofline ({1e3 * roof:.1f} ms); tokens exact/blended/"
              f"recomputed {r['reuse_exact_blended_recomputed']}; steps {r['steps']}")
    RESULTS["ttft"] = out
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1)


def test_rag_workload_throughput(benchmark, setup, ceilings, ckpt):
    eng, docs, rng = setup
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    cost = ModelCost.of(ModelConfig.from_dir(ckpt), ckpt)
    params = SamplingParams(max_tokens=RAG_OUTPUT, ignore_eos=True)
    prompt_len = RAG_DOCS * DOC_LEN + QUESTION_LEN
    roof = workload_roofline(cost, [prompt_len] * RAG_REQUESTS, [RAG_OUTPUT] * RAG_REQUESTS, ceilings)
    out = {}
    for name, mode in MODES.items():
        warm = [as_mode(composed(docs, rng, RAG_DOCS, vocab), mode) for _ in range(16)]
        eng.generate([p for p, _ in warm], params, reuse=warm[0][1], use_tqdm=False)
        prompts = [as_mode(composed(docs, rng, RAG_DOCS, vocab), mode) for _ in range(RAG_REQUESTS)]
        sync()
        t = time.perf_counter()
        outs = eng.generate([p for p, _ in prompts], params, reuse=prompts[0][1], use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        out[name] = dict(tokens_per_s=tokens / seconds, seconds=seconds,
                         pct_roofline=100 * tokens / seconds / roof["tokens_per_s"])
    for name, r in out.items():
        r["speedup_vs_exact"] = r["tokens_per_s"] / out["exact"]["tokens_per_s"]
        r["speedup_vs_recompute"] = r["tokens_per_s"] / out["recompute"]["tokens_per_s"]
        print(f"[rag] {name}: {r['tokens_per_s']:.0f} tok/s in {r['seconds']:.2f} s, {r['speedup_vs_exact']:.2f}x "
              f"exact, {r['speedup_vs_recompute']:.2f}x recompute, {r['pct_roofline']:.0f}% of the recompute roofline ({roof['tokens_per_s']:.0f} tok/s)")
    RESULTS["rag"] = out
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1)
