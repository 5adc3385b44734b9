"""Composing chunks' speed: each reuse mode against the same ids as a plain prompt and against its own roofline,
same process, same prompts (GPU; issues #28 §5, #49 §3).

    pytest --benchmark-only benchmarks/bench_blend_speed.py -s
    BENCH_BLEND_SPEED_JSON=out/speed.json pytest --benchmark-only benchmarks/bench_blend_speed.py -k ttft -s
    pytest --benchmark-only benchmarks/bench_blend_speed.py -k prefill_bound -s   # the README's RAG figures

The prefill-bound RAG case's engine takes what GPU memory the module's first engine leaves (to 0.9 in all): run
alone it has about twice the KV pages it has beside the other cases, and its steps differ (blend r=0.5 ran 232
blended steps beside them against 132 alone, docs/BENCHMARKS.md, session 39); compare runs made the same way.

With CHUNKWISE_BENCH_BREAKDOWN=1 the ttft case then runs one more request per mode under StepTimer (the device
synchronised after each forward) and the torch profiler: where its time goes, per step and phase, how much of it
the GPU was busy (the union of its kernels' intervals) in how many kernels, and the kernels that took the most.
With BENCH_BLEND_SPEED_BACKEND=fa3 both engines take attention_backend="fa3" (vLLM's FlashAttention-3 for plain
prefill rows, where it is installed; a blend's rows at explicit positions keep chunkwise's kernel).
With BENCH_BLEND_SPEED_JSON set, every case's results so far ({case: {mode: metrics}}) are written there after each
case (benchmarks/bench_blend_quality.py --speed-json reads its TTFTs).

A random bf16 model of Qwen3-0.6B's shape (quality is benchmarks/bench_blend.py's, on real checkpoints); 20
registered documents of 512 random tokens, each pinned. Two cases, each after a warm-up run of the same shape:
  ttft    a composed request: 8 documents in a fresh random order + a 64-token question, max_tokens 1; the median
          over REPS requests of the time to its first token, exact mode (reuses only the first document, which
          opens the prompt) against blend at r = 0.15 (kv-deviation and chunk-heads), and the blends again with
          their blend graphs off (the whole blended step eager, as before those graphs); the modes take turns, a
          request each per round.
  rag     256 requests, each 4 of the 20 documents in random order + a 64-token question, 128 output tokens
          (ignore_eos), all submitted at once: output tokens/s. Decode-bound: no reuse mode can gain much here.
  prefill-bound RAG
          256 requests, each a pinned 512-token system chunk + 8 of 40 registered documents of 1,024 tokens in a
          random order + a 32-token question, 16 output tokens, token budget 8,192: output tokens/s and TTFT p50/p99
          per mode, the modes taking turns in rounds of 128 requests (each submitted at once) after a warm-up: a round
          of 16, then (blends) whole rounds until two in a row capture no new graph (at most RAG2_WARM_ROUNDS); the
          graphs each mode captured in the timed rounds are counted (a key's first step there is eager and captures).
Baselines, in the same process: "plain", the same ids sent as one plain prompt (it hits the prefix cache where the
ids allow, as any prompt does), and each mode's own roofline (benchmarks/roofline.py, from ceilings measured first):
the rows each layer actually computes (a blend's check layers at their kept share, its later layers at r) at the
matmul rate but no faster than one read of the weights, plus the relocation's bytes at the copy rate.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import Counter

import pytest
import torch

from benchmarks.bench_engine import QWEN3_0_6B_SHAPE, ceilings, ckpt  # noqa: F401  (fixtures: the same model, ceilings measured once)
from benchmarks.roofline import ModelCost, layered_prefill, workload_roofline
from chunkwise.chunks import Blend
from chunkwise.engine.blend import computed_candidates
from chunkwise.engine import Engine, SamplingParams
from chunkwise.model_config import ModelConfig

pytestmark = pytest.mark.gpu

NUM_DOCS, DOC_LEN, QUESTION_LEN = 20, 512, 64
TTFT_DOCS, REPS = 8, 7
RAG_REQUESTS, RAG_DOCS, RAG_OUTPUT = 256, 4, 128
# "plain": the same ids as one plain prompt; "exact": the composite prompt in exact mode (its pieces scheduled by
# the token budget as the plain prompt is, issue 49).
MODES = {"plain": None, "exact": "exact", "blend r=0.15": Blend(0.15), "blend r=0.5": Blend(0.5),
         "chunk-heads r=0.15": Blend(0.15, "chunk-heads")}
RAG2_REQUESTS, RAG2_DOCS, RAG2_DOC_LEN, RAG2_PER_REQUEST = 256, 40, 1024, 8
RAG2_SYSTEM_LEN, RAG2_QUESTION_LEN, RAG2_OUTPUT, RAG2_BUDGET, RAG2_ROUND = 512, 32, 16, 8192, 128
# A blend's graphs are keyed by its steps' row counts, and the rarer keys come once every round or two: its warm-up
# rounds go on until RAG2_QUIET_ROUNDS in a row capture nothing new, RAG2_WARM_ROUNDS at most.
RAG2_WARM_ROUNDS, RAG2_QUIET_ROUNDS = 6, 2
BREAKDOWN = os.environ.get("CHUNKWISE_BENCH_BREAKDOWN") == "1"
BACKEND = os.environ.get("BENCH_BLEND_SPEED_BACKEND", "triton")   # EngineConfig.attention_backend of both engines
MEMORY_SHARE = 0.45   # of the GPU for the first engine: the prefill-bound RAG's, alive beside it, fills up to 0.9
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def setup(ckpt):
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=TTFT_DOCS * DOC_LEN + QUESTION_LEN + RAG_OUTPUT + 16,
                 max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=MEMORY_SHARE,
                 attention_backend=BACKEND)
    rng = random.Random(0)
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    docs = [eng.register_chunk([rng.randrange(3, vocab) for _ in range(DOC_LEN)], pin=True) for _ in range(NUM_DOCS)]
    return eng, docs, rng


def composed(docs, rng: random.Random, k: int, vocab: int) -> list:
    """k documents in a random order, then a question of fresh random ids (never cached)."""
    return rng.sample(docs, k) + [[rng.randrange(3, vocab) for _ in range(QUESTION_LEN)]]


def as_mode(prompt: list, mode) -> tuple[list, str | Blend]:
    """The prompt and reuse mode to submit: "plain" sends the concatenated ids."""
    if mode is None:
        return [t for p in prompt for t in (p.token_ids if hasattr(p, "token_ids") else p)], "exact"
    return prompt, mode


def sync():
    torch.cuda.synchronize()


def keep(benchmark, case: str, out: dict) -> None:
    """A case's results, per mode, kept for the module and the benchmark's JSON (the case's timing is its own)."""
    RESULTS[case] = out
    if os.environ.get("BENCH_BLEND_SPEED_JSON"):
        with open(os.environ["BENCH_BLEND_SPEED_JSON"], "w") as f:
            json.dump(RESULTS, f, indent=1)
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1)


def computed_rows(mode, reuse, num_cached: int, prompt_len: int, num_layers: int) -> tuple[list[int], int]:
    """(rows computed at each layer, tokens whose K/V were moved into place) of one request, from its reuse report
    and the blend's rules (chunkwise/engine/blend/policy.py): plain and exact compute every uncached row at every
    layer; "chunk-heads" its fixed rows and chunk heads; "kv-deviation" its fixed rows and `computed_candidates`."""
    if not isinstance(mode, Blend):
        return [prompt_len - num_cached] * num_layers, 0
    n = sum(r.blended + r.recomputed for r in reuse if r.chunk is not None)   # candidates: chunk rows not exact
    fixed = sum(r.recomputed for r in reuse if r.chunk is None)
    if mode.policy == "chunk-heads":
        return [sum(r.recomputed for r in reuse)] * num_layers, n
    r = mode.recompute_ratio
    if r == 0:
        return [fixed] * num_layers, n
    return [fixed + k for k in computed_candidates(r, n, num_layers)], n


def mode_roofline(mode, reuse, num_cached, prompt_len, cfg, cost, ceilings) -> dict:
    rows, moved = computed_rows(mode, reuse, num_cached, prompt_len, cfg.num_layers)
    return layered_prefill(cost, cfg.num_layers, rows, prompt_len / 2, moved, ceilings)


def gpu_busy(prof, top: int = 20) -> tuple[float, int, list]:
    """(ms the GPU ran any kernel or copy, the union of their intervals; how many ran; the `top` names by total ms,
    as (name, ms, count)) in a profile."""
    from torch.autograd import DeviceType
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name[:110], [0.0, 0])
        entry[0] += e.time_range.elapsed_us() / 1e3
        entry[1] += 1
    ranked = sorted(((n, round(ms, 3), c) for n, (ms, c) in by_name.items()), key=lambda x: -x[1])
    return busy / 1e3, len(events), ranked[:top]


def breakdown(eng: Engine, prompt_and_mode: tuple, params: SamplingParams) -> dict:
    """One request's wall time split by step and phase (StepTimer, synchronised after each forward), and the
    GPU's busy time in it (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_timer import PHASES, StepTimer
    prompt, reuse = prompt_and_mode
    timer = StepTimer(eng, device_sync=True)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            t = time.perf_counter()
            eng.generate([prompt], params, reuse=reuse, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t
    finally:
        timer.detach()
    busy, kernels, top = gpu_busy(prof)
    steps = [{p: round(1e3 * s.get(p, 0.0), 3) for p in (*PHASES, "step")} | {"tokens": s["tokens"]}
             for s in timer.steps]
    return dict(wall_ms=round(1e3 * wall, 3), gpu_busy_ms=round(busy, 3), gpu_kernels=kernels, steps=steps,
                top_kernels=top)


def test_ttft_of_a_composed_request(benchmark, setup, ceilings, ckpt):
    eng, docs, rng = setup
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    cfg = ModelConfig.from_dir(ckpt)
    cost = ModelCost.of(cfg, ckpt)
    prompt_len = TTFT_DOCS * DOC_LEN + QUESTION_LEN
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    out = {}
    graphs = eng.executor.runner.blend_graphs
    max_rows = graphs.max_rows
    # The blends again eagerly (no blend graph): the same-run baseline of the blend graphs
    # (chunkwise/engine/blend_graphs.py).
    runs = [(name, mode, max_rows) for name, mode in MODES.items()]
    runs += [(f"{name}, eager", mode, 0) for name, mode in MODES.items() if isinstance(mode, Blend)]
    for name, mode, rows in runs:   # warm-up: every specialisation
        graphs.max_rows = rows
        prompt, reuse_mode = as_mode(composed(docs, rng, TTFT_DOCS, vocab), mode)
        eng.generate([prompt], one, reuse=reuse_mode, use_tqdm=False)
    times, roofs = {name: [] for name, _, _ in runs}, {name: [] for name, _, _ in runs}
    steps, last = {name: Counter() for name, _, _ in runs}, {}
    # The modes take turns, one request each per round, each round starting one mode later: whatever the machine
    # does over the run (clocks, the host's other load) reaches every mode alike, not the ones measured first.
    for rep in range(REPS):
        for name, mode, rows in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            graphs.max_rows = rows
            prompt, reuse_mode = as_mode(composed(docs, rng, TTFT_DOCS, vocab), mode)
            launches = Counter(eng.executor.runner.launches)
            sync()
            t = time.perf_counter()
            last[name] = o = eng.generate([prompt], one, reuse=reuse_mode, use_tqdm=False)[0]
            sync()
            times[name].append(time.perf_counter() - t)
            steps[name] += eng.executor.runner.launches - launches
            roofs[name].append(mode_roofline(mode, o.chunk_reuse, o.num_cached_tokens, prompt_len, cfg, cost,
                                             ceilings)["seconds"])
    for name, _, _ in runs:
        ttft, roof, o = statistics.median(times[name]), statistics.median(roofs[name]), last[name]
        reuse = o.chunk_reuse
        counts = ([sum(getattr(r, f) for r in reuse) for f in ("exact", "blended", "recomputed")] if reuse
                  else [o.num_cached_tokens, 0, prompt_len - o.num_cached_tokens])
        out[name] = dict(ttft_ms=1e3 * ttft, roofline_ms=1e3 * roof, pct_roofline=100 * roof / ttft,
                         reuse_exact_blended_recomputed=counts,
                         steps={f"{kind} {path}": n for (kind, path), n in sorted(steps[name].items())})
    if BREAKDOWN:
        for name, mode, rows in runs:
            graphs.max_rows = rows
            out[name]["breakdown"] = breakdown(eng, as_mode(composed(docs, rng, TTFT_DOCS, vocab), mode), one)
            print(f"[ttft breakdown] {name}: {out[name]['breakdown']}")
    graphs.max_rows = max_rows
    for name, r in out.items():
        r["vs_plain"] = r["ttft_ms"] / out["plain"]["ttft_ms"]
        print(f"[ttft] {name}: {r['ttft_ms']:.1f} ms, {r['vs_plain']:.2f}x the plain prompt's TTFT "
              f"({1 / r['vs_plain']:.2f}x as fast), {r['pct_roofline']:.0f}% of its roofline "
              f"({r['roofline_ms']:.1f} ms); tokens exact/blended/recomputed {r['reuse_exact_blended_recomputed']}; "
              f"steps {r['steps']}")
    keep(benchmark, "ttft", out)


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
        r["vs_plain"] = r["tokens_per_s"] / out["plain"]["tokens_per_s"]
        print(f"[rag] {name}: {r['tokens_per_s']:.0f} tok/s in {r['seconds']:.2f} s, {r['vs_plain']:.2f}x plain, "
              f"{r['pct_roofline']:.0f}% of the recompute roofline ({roof['tokens_per_s']:.0f} tok/s)")
    keep(benchmark, "rag", out)


@pytest.fixture(scope="module")
def rag2(ckpt):
    """An engine for the prefill-bound RAG workload, with its pinned system chunk and 40 pinned documents."""
    eng = Engine(ckpt, dtype="bfloat16", max_num_batched_tokens=RAG2_BUDGET, max_num_seqs=RAG2_ROUND,
                 max_model_len=RAG2_SYSTEM_LEN + RAG2_PER_REQUEST * RAG2_DOC_LEN + RAG2_QUESTION_LEN + RAG2_OUTPUT + 16,
                 attention_backend=BACKEND)
    rng = random.Random(1)
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    system = eng.register_chunk([rng.randrange(3, vocab) for _ in range(RAG2_SYSTEM_LEN)], pin=True)
    docs = [eng.register_chunk([rng.randrange(3, vocab) for _ in range(RAG2_DOC_LEN)], pin=True)
            for _ in range(RAG2_DOCS)]
    yield eng, system, docs, rng
    eng.close()


def captured(runner) -> int:
    """Blend graphs the runner has captured so far (each on its key's first step)."""
    return sum(static.graph is not None for static in runner.blend_graphs.statics.values())


def run_round(eng: Engine, prompts: list, reuse, params: SamplingParams) -> tuple[list[float], int, float]:
    """Submits the prompts at once and steps until all finish: (each one's TTFT in s, output tokens, seconds)."""
    sync()
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params, reuse=reuse) for p in prompts]
    first: dict[int, float] = {}
    done, tokens = 0, 0
    while done < len(rids):
        for o in eng.step():
            assert o.finish_reason != "error", o.output.error
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            tokens += len(o.new_token_ids)
            done += o.finished
    sync()
    return [first[r] for r in rids], tokens, time.perf_counter() - t0


def test_prefill_bound_rag_workload(benchmark, rag2, ceilings, ckpt):
    eng, system, docs, rng = rag2
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    params = SamplingParams(max_tokens=RAG2_OUTPUT, ignore_eos=True)

    def prompts(n):
        return [[system] + rng.sample(docs, RAG2_PER_REQUEST) + [[rng.randrange(3, vocab)
                                                                   for _ in range(RAG2_QUESTION_LEN)]]
                for _ in range(n)]

    runner = eng.executor.runner
    for mode in MODES.values():   # warm-up: every specialisation of every mode, then its blend graphs
        batch = [as_mode(p, mode) for p in prompts(16)]
        run_round(eng, [p for p, _ in batch], batch[0][1], params)
        if not isinstance(mode, Blend):   # only blended steps have graphs keyed by their rows
            continue
        quiet = 0   # consecutive rounds that captured no new graph
        for _ in range(RAG2_WARM_ROUNDS):
            before = captured(runner)
            batch = [as_mode(p, mode) for p in prompts(RAG2_ROUND)]
            run_round(eng, [p for p, _ in batch], batch[0][1], params)
            quiet = quiet + 1 if captured(runner) == before else 0
            if quiet == RAG2_QUIET_ROUNDS:
                break
    ttfts = {name: [] for name in MODES}
    totals = {name: [0, 0.0] for name in MODES}
    paths = {name: Counter() for name in MODES}   # each mode's steps by (kind, eager or graph), timed rounds only
    captures = Counter()   # each mode's blend graphs captured in the timed rounds (a key's first step)
    warm_captures = captured(runner)
    for _ in range(RAG2_REQUESTS // RAG2_ROUND):
        for name, mode in MODES.items():
            batch = [as_mode(p, mode) for p in prompts(RAG2_ROUND)]
            launches, before = Counter(runner.launches), captured(runner)
            t, tokens, seconds = run_round(eng, [p for p, _ in batch], batch[0][1], params)
            paths[name] += Counter(runner.launches) - launches
            captures[name] += captured(runner) - before
            ttfts[name] += t
            totals[name][0] += tokens
            totals[name][1] += seconds
    out = {}
    for name in MODES:
        tokens, seconds = totals[name]
        q = statistics.quantiles(ttfts[name], n=100)
        out[name] = dict(tokens_per_s=tokens / seconds, seconds=seconds, ttft_p50_ms=1e3 * q[49],
                         ttft_p99_ms=1e3 * q[98], steps={f"{k} {p}": n for (k, p), n in sorted(paths[name].items())},
                         timed_captures=captures[name])
    for name, r in out.items():
        r["vs_plain"] = r["tokens_per_s"] / out["plain"]["tokens_per_s"]
        print(f"[prefill-bound rag] {name}: {r['tokens_per_s']:.0f} tok/s ({r['vs_plain']:.2f}x plain), TTFT p50 "
              f"{r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms over {RAG2_REQUESTS} requests; steps "
              f"{r['steps']}, {r['timed_captures']} blend graphs captured")
    out["blend_graph_captures"] = dict(warm_up=warm_captures, timed=captured(runner) - warm_captures)
    print(f"[prefill-bound rag] blend graphs captured: {warm_captures} in the warm-up, "
          f"{out['blend_graph_captures']['timed']} more in the timed rounds")
    keep(benchmark, "prefill_bound_rag", out)
