"""Engine throughput against the hardware's roofline and HF transformers, same process, same prompts (GPU).

    pytest --benchmark-only benchmarks/bench_engine.py -s [--benchmark-json=out/bench.json]

Two workloads on a random bf16 model of Qwen3-0.6B's shape, random token ids, ignore_eos (throughput
counts the output tokens the requests asked for):
  decode   256 requests, prompts and outputs of 100..1024 tokens (nano-vllm's bench.py)
  prefill  64 requests, prompts of 4096..8192 tokens, outputs of 64..128
Per workload:
  roofline     the ideal engine's time (benchmarks/roofline.py) from copy bandwidth and bf16 matmul rate
               measured first in this process; every engine is reported as a percentage of it.
  optimized    chunkwise.Engine: construction (its own warm-up included), then a first run on prompts of
               the same shape but another seed (the first workload a user runs), then the timed run.
               Both runs are asserted to hit no prefix-cache page, and the timed run to compile no
               Triton kernel (every specialisation it uses was compiled before it).
  deterministic  chunkwise.Engine(deterministic=True), after a first run; its ratio to the default mode.
  fa3_prefill  chunkwise.Engine(attention_backend="fa3"), after a first run, where vLLM's FlashAttention-3 runs
               (skipped elsewhere); its ratio to the default mode.
  eager_mixed_steps  chunkwise.Engine(max_graph_tokens=0), after a first run: mixed and prefill steps eager
               (decode-only steps still replay graphs); the default's ratio to it.
  sync_scheduling  chunkwise.Engine(async_scheduling=False), after a first run: the default mode without
               overlap scheduling (each step postprocessed before the next is scheduled); the default's
               ratio to it.
  hf_generate  HF `generate`, greedy, batched with left padding, on the first requests (see HF_REQUESTS);
               batches grouped by output length, each generating its longest request's length.
  hf_cb        HF continuous batching (`paged|sdpa` attention, one manager, per-request max_new_tokens) on
               the first requests (see CB_REQUESTS).
A table is printed at the end and a PNG plot of tokens/s against the roofline is written next to the JSON
(--benchmark-json), else to .benchmarks/bench_engine.png. CHUNKWISE_BENCH_BREAKDOWN=1 adds a run per
workload under `StepTimer` (schedule / prepare / forward / sample / postprocess per step, decode steps
against their own memory roofline; device-synchronised forwards for sync_scheduling, host times and wall
time for the default's overlap) and a kernel count per layer of an eager decode forward.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from benchmarks.roofline import ModelCost, measure_ceilings, workload_roofline
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.kernels.fa3 import fa3_unavailable
from chunkwise.model_config import ModelConfig
from chunkwise.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

QWEN3_0_6B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.02)


@dataclass(frozen=True)
class Spec:
    requests: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    max_num_seqs: int
    hf_requests: int      # HF generate runs on the first ones
    hf_batch: int
    cb_requests: int      # HF continuous batching runs on the first ones


SPECS = {
    # The HF subsets keep each baseline under about a minute on an H200 (HF generate ran 254 tok/s there).
    "decode": Spec(256, (100, 1024), (100, 1024), 256, hf_requests=16, hf_batch=16, cb_requests=16),
    "prefill": Spec(64, (4096, 8192), (64, 128), 64, hf_requests=8, hf_batch=4, cb_requests=8),
}
BREAKDOWN = os.environ.get("CHUNKWISE_BENCH_BREAKDOWN") == "1"
RESULTS: dict[str, dict[str, dict]] = {name: {} for name in SPECS}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def head(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.output_lens[:n])


def make_workload(spec: Spec, vocab: int, seed: int) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(spec.prompt[0], spec.prompt[1] + 1, (spec.requests,), generator=gen).tolist()
    output_lens = torch.randint(spec.output[0], spec.output[1] + 1, (spec.requests,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (p,), generator=gen).tolist() for p in prompt_lens]
    return Workload(prompts, output_lens)


def sync():
    torch.cuda.synchronize()


COMPILED: list[str] = []   # Triton kernels compiled (or loaded from the disk cache) in this process, in order
COMPILE_TIMES: list[float] = []   # and when (time.perf_counter())


def triton_compiles() -> int:
    return len(COMPILED)


def _count_compile(*args, **kwargs):
    COMPILED.append(str(kwargs.get("repr", "?"))[:160])
    COMPILE_TIMES.append(time.perf_counter())
    return False


def _install_compile_counter():
    import triton
    try:
        triton.knobs.runtime.jit_post_compile_hook = _count_compile
    except AttributeError:   # older Triton: the hook lives on JITFunction
        from triton.runtime.jit import JITFunction
        JITFunction.compiled_hook = _count_compile


def run_engine(eng: Engine, w: Workload) -> tuple[int, float]:
    """(output tokens, seconds) for the whole workload through the engine."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in w.output_lens]
    sync()
    start = time.perf_counter()
    outs = eng.generate(w.prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == w.output_lens
    assert sum(o.num_cached_tokens for o in outs) == 0, "a prompt hit the prefix cache"
    return sum(w.output_lens), seconds


def run_hf(model, w: Workload, batch_size: int) -> tuple[int, float]:
    """(requested output tokens, seconds) through HF generate, greedy, batches grouped by output length."""
    order = sorted(range(len(w.prompts)), key=lambda i: w.output_lens[i])
    sync()
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(w.prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):   # left padding
            ids[row, width - len(w.prompts[i]):] = torch.tensor(w.prompts[i])
            mask[row, width - len(w.prompts[i]):] = 1
        new = max(w.output_lens[i] for i in idx)
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + new
    sync()
    return sum(w.output_lens[i] for i in order), time.perf_counter() - start


def run_hf_cb(model, w: Workload) -> tuple[int, float]:
    """(output tokens, seconds) through HF continuous batching: one manager (its own warm-up, CUDA-graph
    capture included, is not timed), every request added at once with its own max_new_tokens, EOS disabled."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_lens), pad_token_id=0)
    gc.eos_token_id = None   # the manager turns a missing EOS into -1: never stop early
    hints = WorkloadHints(max_prompt_length=max(map(len, w.prompts)), max_generated_length=max(w.output_lens),
                          num_requests=len(w.prompts))
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=60,
                                                   workload_hints=hints) as manager:
        sync()
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=m, eos_token_id=-1) for p, m in zip(w.prompts, w.output_lens)]
        done = {}
        while len(done) < len(ids):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before every request finished")
            elif r.is_finished():
                done[r.request_id] = r
        sync()
        seconds = time.perf_counter() - start
    assert sorted(len(done[i].generated_tokens) for i in ids) == sorted(w.output_lens)
    return sum(w.output_lens), seconds


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE)


@pytest.fixture(scope="module")
def ceilings():
    _install_compile_counter()
    c = measure_ceilings()
    print(f"\nceilings: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {c.matmul_flops_per_s / 1e12:.0f} "
          f"TFLOP/s ({torch.cuda.get_device_name()})")
    return c


@pytest.fixture(scope="module")
def cost(ckpt):
    return ModelCost.of(ModelConfig.from_dir(ckpt), ckpt)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, ceilings, cost):
    name = request.param
    spec = SPECS[name]
    w = make_workload(spec, QWEN3_0_6B_SHAPE["vocab_size"], seed=0)
    roof = workload_roofline(cost, list(map(len, w.prompts)), w.output_lens, ceilings)
    RESULTS[name]["roofline"] = dict(tokens_per_s=roof["tokens_per_s"], seconds=roof["seconds"])
    print(f"\n[{name}] roofline {roof['seconds']:.2f} s = {roof['tokens_per_s']:.0f} tok/s (prefill "
          f"{roof['prefill_s']:.2f} s, {roof['decode_steps']} decode steps {roof['decode_s']:.2f} s, "
          f"KV read {roof['kv_read_tb']:.1f} TB)")
    return name, spec, w, roof


def engine_for(ckpt, spec: Spec, **kw) -> Engine:
    max_len = spec.prompt[1] + spec.output[1] + 16
    return Engine(ckpt, dtype="bfloat16", max_model_len=max_len, max_num_batched_tokens=8192,
                  max_num_seqs=spec.max_num_seqs, **kw)


def breakdown(name: str, engine: str, eng: Engine, spec: Spec, cost, ceilings):
    """A run under StepTimer on other prompts; prints and keeps the step breakdown."""
    from benchmarks.step_timer import StepTimer, format_summary
    timer = StepTimer(eng, device_sync=not eng.engine_config.async_scheduling)
    run_engine(eng, make_workload(spec, QWEN3_0_6B_SHAPE["vocab_size"], seed=2))
    RESULTS[name][f"breakdown_{engine}"] = timer.summary(cost, ceilings)
    print(format_summary(f"[{name}] {engine}", RESULTS[name][f"breakdown_{engine}"]))


def record(name: str, engine: str, tokens: int, seconds: float, roof: dict, benchmark=None, **extra):
    r = dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
             pct_roofline=100 * tokens / seconds / roof["tokens_per_s"], **extra)
    RESULTS[name][engine] = r
    if benchmark is not None:
        benchmark.extra_info.update(r, roofline_tokens_per_s=roof["tokens_per_s"])
    print(f"[{name}] {engine}: {tokens} tokens in {seconds:.2f} s = {r['tokens_per_s']:.0f} tok/s "
          f"({r['pct_roofline']:.1f}% of roofline) {extra or ''}")


def test_optimized_engine(benchmark, ckpt, case, ceilings, cost):
    name, spec, w, roof = case
    gc.collect()
    torch.cuda.empty_cache()
    compiles = triton_compiles()
    start = time.perf_counter()
    eng = engine_for(ckpt, spec)
    try:
        construct = time.perf_counter() - start
        print(f"[{name}] Engine(...) took {construct:.1f} s, compiling {triton_compiles() - compiles} Triton kernels")
        if name == list(SPECS)[0]:
            assert triton_compiles() > compiles, "the Triton compile counter saw nothing: it cannot vouch for the runs"
        compiles = triton_compiles()
        first = make_workload(spec, QWEN3_0_6B_SHAPE["vocab_size"], seed=1)
        tokens, seconds = run_engine(eng, first)
        record(name, "optimized_first", tokens, seconds, roof, construct_s=round(construct, 2),
               compiles=triton_compiles() - compiles)
        compiles = triton_compiles()
        tokens, seconds = benchmark.pedantic(run_engine, args=(eng, w), rounds=1, iterations=1)
        timed_compiles = COMPILED[compiles:]
        record(name, "optimized", tokens, seconds, roof, benchmark, compiles=len(timed_compiles),
               num_pages=eng.executor.num_pages, cuda_graphs=len(eng.executor.runner.graphs))
        if BREAKDOWN:
            breakdown(name, "optimized", eng, spec, cost, ceilings)
            print(f"[{name}] kernels per layer, eager decode forward of 64 sequences: {kernels_per_layer(eng):.1f}")
    finally:   # the KV cache fills the GPU: free it even when a check failed
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    assert not timed_compiles, f"the timed run compiled Triton kernels: {timed_compiles}"


def _variant(benchmark, ckpt, case, cost, ceilings, breakdown_as: str | None = None,
             **overrides) -> tuple[int, float, float | None]:
    """Engine(**overrides) on the case's workload, timed after a first run that compiles what it uses: its tokens
    and seconds, and the default engine's tok/s from the same session (None if that did not run)."""
    name, spec, w, roof = case
    gc.collect()
    torch.cuda.empty_cache()
    eng = engine_for(ckpt, spec, **overrides)
    try:
        run_engine(eng, make_workload(spec, QWEN3_0_6B_SHAPE["vocab_size"], seed=1))
        tokens, seconds = benchmark.pedantic(run_engine, args=(eng, w), rounds=1, iterations=1)
        if BREAKDOWN and breakdown_as is not None:
            breakdown(name, breakdown_as, eng, spec, cost, ceilings)
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return tokens, seconds, RESULTS[name].get("optimized", {}).get("tokens_per_s")


def test_deterministic_engine(benchmark, ckpt, case, ceilings, cost):
    """Engine(deterministic=True) on the same workload."""
    tokens, seconds, default = _variant(benchmark, ckpt, case, cost, ceilings, deterministic=True)
    record(case[0], "deterministic", tokens, seconds, case[3], benchmark,
           vs_default=round(tokens / seconds / default, 3) if default else None)


def test_fa3_prefill_engine(benchmark, ckpt, case, ceilings, cost):
    """Engine(attention_backend="fa3") on the same workload: vLLM's FA3 for the long prefill chunks."""
    why = fa3_unavailable(torch.device("cuda"), torch.bfloat16, QWEN3_0_6B_SHAPE["head_dim"])
    if why is not None:
        pytest.skip(f"attention_backend='fa3': {why}")
    tokens, seconds, default = _variant(benchmark, ckpt, case, cost, ceilings, attention_backend="fa3")
    record(case[0], "fa3_prefill", tokens, seconds, case[3], benchmark,
           vs_default=round(tokens / seconds / default, 3) if default else None)


def test_sync_scheduling_engine(benchmark, ckpt, case, ceilings, cost):
    """Engine(async_scheduling=False) on the same workload: what overlap scheduling gains."""
    tokens, seconds, default = _variant(benchmark, ckpt, case, cost, ceilings, breakdown_as="sync_scheduling",
                                        async_scheduling=False)
    record(case[0], "sync_scheduling", tokens, seconds, case[3], benchmark,
           default_vs_sync=round(default / (tokens / seconds), 3) if default else None)


def test_eager_mixed_steps_engine(benchmark, ckpt, case, ceilings, cost):
    """Engine(max_graph_tokens=0) on the same workload: what the mixed steps' CUDA graphs gain."""
    tokens, seconds, default = _variant(benchmark, ckpt, case, cost, ceilings, max_graph_tokens=0)
    record(case[0], "eager_mixed_steps", tokens, seconds, case[3], benchmark,
           default_vs_eager_mixed=round(default / (tokens / seconds), 3) if default else None)


def kernels_per_layer(eng: Engine) -> float:
    """GPU kernels an eager decode forward of 64 sequences launches, per layer (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from chunkwise.engine.host_step import synthetic_step
    runner = eng.executor.runner
    inp = runner._upload(synthetic_step([], 64))
    with torch.inference_mode():
        runner.model.forward(inp, runner.kv.layers)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.model.forward(inp, runner.kv.layers)
            sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / eng.model_config.num_layers


def test_hf_generate(benchmark, ckpt, case, ceilings, cost):
    from transformers import AutoModelForCausalLM

    name, spec, w, roof = case
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    warm = make_workload(spec, QWEN3_0_6B_SHAPE["vocab_size"], seed=1).head(2)
    run_hf(model, Workload(warm.prompts, [8, 8]), spec.hf_batch)   # CUDA and cuBLAS set-up (nothing compiles)
    sub = w.head(spec.hf_requests)
    tokens, seconds = benchmark.pedantic(run_hf, args=(model, sub, spec.hf_batch), rounds=1, iterations=1)
    sub_roof = workload_roofline(cost, list(map(len, sub.prompts)), sub.output_lens, ceilings)
    record(name, "hf_generate", tokens, seconds, sub_roof, benchmark, requests=len(sub.prompts))
    del model
    gc.collect()
    torch.cuda.empty_cache()


def test_hf_continuous_batching(benchmark, ckpt, case, ceilings, cost):
    from transformers import AutoModelForCausalLM

    name, spec, w, roof = case
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                 attn_implementation="paged|sdpa").cuda()
    sub = w.head(spec.cb_requests)
    tokens, seconds = benchmark.pedantic(run_hf_cb, args=(model, sub), rounds=1, iterations=1)
    sub_roof = workload_roofline(cost, list(map(len, sub.prompts)), sub.output_lens, ceilings)
    record(name, "hf_cb", tokens, seconds, sub_roof, benchmark, requests=len(sub.prompts))
    del model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", autouse=True)
def report(request):
    """The table of every engine per workload, and the plot, once the module's benchmarks are done."""
    yield
    if any(RESULTS.values()):
        print_table_and_plot(request.config)


def print_table_and_plot(config):
    lines = [f"{'workload':8} {'engine':16} {'tok/s':>9} {'% roofline':>10} {'vs hf_cb':>9} {'seconds':>8}  notes"]
    for name, res in RESULTS.items():
        cb = res.get("hf_cb", {}).get("tokens_per_s")
        for engine, r in res.items():
            if engine.startswith("breakdown"):
                continue
            pct = f"{r['pct_roofline']:.1f}" if "pct_roofline" in r else "100"
            vs = f"{r['tokens_per_s'] / cb:.1f}x" if cb else "-"
            notes = {k: v for k, v in r.items() if k not in ("tokens", "seconds", "tokens_per_s", "pct_roofline")}
            lines.append(f"{name:8} {engine:16} {r['tokens_per_s']:9.0f} {pct:>10} {vs:>9} "
                         f"{r['seconds']:8.2f}  {notes or ''}")
    print("\n" + "\n".join(lines))
    json_path = config.getoption("benchmark_json", None)
    out = Path(getattr(json_path, "name", json_path)).parent if json_path else Path(".benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "bench_engine.png")
    print(f"plot: {out / 'bench_engine.png'}")


def plot(path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in RESULTS if RESULTS[n]]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        res = {k: v for k, v in RESULTS[name].items() if k != "roofline" and not k.startswith("breakdown")}
        ax.bar(list(res), [r["tokens_per_s"] for r in res.values()], color="tab:blue")
        for i, r in enumerate(res.values()):
            ax.annotate(f"{r['tokens_per_s']:.0f}\n{r['pct_roofline']:.0f}%", (i, r["tokens_per_s"]),
                        ha="center", va="bottom", fontsize=8)
        ax.axhline(RESULTS[name]["roofline"]["tokens_per_s"], color="tab:red", ls="--", label="roofline")
        ax.set_yscale("log")
        ax.set_title(f"{name}-heavy workload")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
