"""Tensor parallelism's scaling on two GPUs, one process: TP=1 against TP=2 on a Llama-3-8B-shaped model.

    PYTHONPATH=$PWD python -m pytest --benchmark-only benchmarks/bench_tp.py -s [--benchmark-json=out/tp.json]

Model: Llama 3 8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocab 128256,
untied embeddings), random bf16 weights (normal, std 0.02; norms 1), written once as sharded safetensors under
$CHUNKWISE_CACHE/bench/ (16 GB; each tensor drawn on the GPU from a fixed seed, so writing takes as long as the disk
does) and loaded through the engine's own loader: each TP=2 rank keeps only its slices.
Workloads, each engine running both (ignore_eos):
- "engine", the one issue 12 names: bench_engine.py's decode-heavy workload, 256 requests, random prompts of
  100..1024 tokens, 100..1024 output tokens, all running at once (max_num_seqs 256);
- "scaled", the smaller one earlier runs reported: 128 requests, prompts of 128..1024, 64..384 output tokens, at
  most 128 running (the engine's max_num_seqs stays 256; 128 requests never reach it).
Engines: TP=1, TP=2 with the default settings (the custom all-reduce for the all-reduces that fit it, NCCL for the
rest, where the GPUs can run it) and TP=2 with NCCL alone (custom_all_reduce=False), so the custom all-reduce's gain
is measured in the same run.
Per engine: construction (weights, warm-up, CUDA graphs; for TP=2 the worker too), a first run on 32 requests of
another seed, then one timed run of each workload, asserted to compile no Triton kernel (rank 0's count; every rank
runs the same shapes). Then per workload decode windows: sequences of 512 prompt tokens decoding together (256 for
the engine workload, 64 for the scaled one), WINDOW_RUNS windows of 16 steps timed, each after the GPUs idled
IDLE_S (the stall issue 51 saw came after idle), then 16 more under torch.profiler on rank 0, whose
communication kernels per step (2 all-reduces per layer, the embedding's, the greedy tokens' gather; NCCL's or the
custom all-reduce's, whose fused residual add and norm count with it; waits for the other rank included) give the
communication time per decode step.
For TP > 1, a whole run of a third workload (the scaled one's sizes, other prompts) under torch.profiler on rank 0: its
communication kernel time, the share of that run it takes, and from it the speed-up TP=2 would reach if
communication took no time (its seconds less that time; an upper bound for any faster all-reduce, as every
collective sits on rank 0's stream).
Reported: output tok/s, TP=2's speed-up and scaling efficiency (speed-up / 2; issue 12's goal: TP=2 >= 1.7x TP=1),
that communication-free bound, decode step time, communication per decode step and its share of the step, its
share of the whole run, and each engine against its roofline
(benchmarks/roofline.py, ceilings measured on GPU 0; N ranks' ideal is N times one GPU's: each reads 1/N of the
weights and KV and does 1/N of the FLOPs, communication free).
NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and its kin are set here when unset, and the workers inherit them.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

from benchmarks.bench_engine import COMPILED, SPECS, Spec, _install_compile_counter, make_workload, run_engine
from benchmarks.roofline import ModelCost, measure_ceilings, workload_roofline
from chunkwise.checkpoint_cache import cache_root, cached_dir
from chunkwise.model_config import ModelConfig
from chunkwise.weights import INDEX_FILE, expected_shapes
from chunkwise.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

LLAMA3_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SCALED = Spec(128, (128, 1024), (64, 384), 128, hf_requests=0, hf_batch=1, cb_requests=0)
WORKLOADS = {"engine": SPECS["decode"], "scaled": SCALED}   # name: spec, the issue's workload first
MAX_NUM_SEQS = max(spec.max_num_seqs for spec in WORKLOADS.values())
MAX_MODEL_LEN = max(spec.prompt[1] + spec.output[1] for spec in WORKLOADS.values()) + 16
FIRST_RUN_REQUESTS = 32
WINDOW_SEQS = {"engine": 256, "scaled": 64}   # decoding together: each workload's batch at its start
WINDOW_PROMPT, WINDOW_STEPS = 512, 16
COMM_CALLS_PER_STEP = 2 * LLAMA3_8B_SHAPE["num_hidden_layers"] + 2   # o and down per layer, embedding, tokens
SHARD_BYTES = 4 << 30
# (label, tensor_parallel_size, custom_all_reduce): TP=2 also with the custom all-reduce, same run
CASES = [("TP=1", 1, True), ("TP=2", 2, True), ("TP=2 NCCL", 2, False)]
WINDOW_RUNS, IDLE_S = 5, 1.0
# BENCH_TP_WORKLOADS=engine runs the issue's workload alone (and no whole-run communication profile)
WORKLOADS = {name: WORKLOADS[name] for name in os.environ.get("BENCH_TP_WORKLOADS", ",".join(WORKLOADS)).split(",")}
RESULTS: dict[str, dict[str, dict]] = {name: {} for name in WORKLOADS}   # workload: engine label: results
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module", autouse=True)
def nvlink_multicast_off():
    """Set (where unset) before any engine starts NCCL; the workers inherit this process's environment."""
    for var, value in NO_MULTICAST.items():
        os.environ.setdefault(var, value)


def random_checkpoint(shape: dict, seed: int = 0, std: float = 0.02, device: str = "cuda",
                      shard_bytes: int = SHARD_BYTES, root: Path | None = None) -> Path:
    """A cached checkpoint directory (under `root`, default the cache's bench/) of `shape` (Llama) with random
    bf16 weights drawn on `device`, in safetensors shards of about `shard_bytes` with their index."""
    key = json.dumps({"v": 1, "shape": shape, "seed": seed, "std": std, "dtype": "bfloat16", "device": device,
                      "shard_bytes": shard_bytes}, sort_keys=True)
    root = root if root is not None else cache_root() / "bench"
    path = root / f"llama-random-bf16-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return cached_dir(path, key, lambda out: _write_random(shape, seed, std, device, shard_bytes, out))


def _write_random(shape: dict, seed: int, std: float, device: str, shard_bytes: int, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(**shape).save_pretrained(out)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, shard, size, total = {}, {}, 0, 0

    def flush():
        nonlocal size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()
        size = 0
    for name, dims in expected_shapes(ModelConfig.from_dir(out)).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16).mul_(std).cpu()
        shard[name] = t
        size += 2 * t.numel()
        total += 2 * t.numel()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def ckpt():
    start = time.perf_counter()
    path = random_checkpoint(LLAMA3_8B_SHAPE)
    print(f"\ncheckpoint {path} ready in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="module")
def setup(ckpt):
    """{workload name: (workload, its one-GPU roofline)} with the ceilings measured on GPU 0."""
    _install_compile_counter()
    ceilings = measure_ceilings()
    cost = ModelCost.of(ModelConfig.from_dir(ckpt), ckpt)
    print(f"ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s ({torch.cuda.get_device_name()})")
    out = {}
    for name, spec in WORKLOADS.items():
        w = make_workload(spec, LLAMA3_8B_SHAPE["vocab_size"], seed=0)
        out[name] = w, workload_roofline(cost, list(map(len, w.prompts)), w.output_lens, ceilings)
        print(f"{name} workload: one-GPU roofline {out[name][1]['seconds']:.2f} s = "
              f"{out[name][1]['tokens_per_s']:.0f} tok/s")
    return out


def is_communication(kernel: str) -> bool:
    """NCCL's kernels and the custom all-reduce's (its fused norm counted with it)."""
    return "nccl" in kernel.lower() or "_all_reduce_kernel" in kernel


def cuda_kernels(prof) -> list:
    """The CUDA activity of a torch.profiler trace."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def comm_kernels(kernels: list) -> list:
    return [e for e in kernels if is_communication(e.name)]


def total_ms(kernels: list) -> float:
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3


def speedup_without_communication(speedup: float, comm_share: float) -> float:
    """The speed-up a run would show if its communication (comm_share of its seconds, on rank 0's stream) took
    no time."""
    return speedup / (1 - comm_share)


def communication_share(eng: Engine) -> dict:
    """A whole run of another workload of the same sizes under torch.profiler on rank 0: its seconds and
    communication kernel milliseconds (waits for the other ranks included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, seconds = run_engine(eng, make_workload(SCALED, LLAMA3_8B_SHAPE["vocab_size"], seed=2))
    ms = total_ms(comm_kernels(cuda_kernels(prof)))
    return dict(profiled_run_s=seconds, run_comm_ms=ms, run_comm_share=ms / 1e3 / seconds)


def decode_window(eng: Engine, num_seqs: int) -> dict:
    """Decode step time of num_seqs sequences decoding together in WINDOW_RUNS windows, each after the GPUs idled
    IDLE_S (their median is decode_step_ms), and rank 0's communication kernel time per step in one more, profiled."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=(WINDOW_RUNS + 6) * WINDOW_STEPS, ignore_eos=True)
    for _ in range(num_seqs):
        eng.add_request(torch.randint(3, LLAMA3_8B_SHAPE["vocab_size"], (WINDOW_PROMPT,), generator=gen).tolist(),
                        params)
    sched = eng.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        eng.step()
    for _ in range(4):   # decode-only from here
        eng.step()
    windows_ms, compiles = [], len(COMPILED)
    for _ in range(WINDOW_RUNS):
        torch.cuda.synchronize()
        time.sleep(IDLE_S)
        start = time.perf_counter()
        for _ in range(WINDOW_STEPS):
            eng.step()
        torch.cuda.synchronize()
        windows_ms.append(1e3 * (time.perf_counter() - start) / WINDOW_STEPS)
    compiles = len(COMPILED) - compiles   # a compile (and its module load) in a window would be in its time
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(WINDOW_STEPS):
            eng.step()
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    comm = comm_kernels(kernels)
    while eng.has_unfinished():
        eng.step()
    return dict(decode_step_ms=sorted(windows_ms)[WINDOW_RUNS // 2], windows_ms=windows_ms, window_compiles=compiles,
                kernels_per_step=len(kernels) / WINDOW_STEPS,
                comm_calls_per_step=len(comm) / WINDOW_STEPS, comm_ms_per_step=total_ms(comm) / WINDOW_STEPS)


@pytest.mark.parametrize("label, tp, custom", CASES, ids=["tp1", "tp2", "tp2-nccl"])
def test_engine_throughput(benchmark, ckpt, setup, label, tp, custom):
    gc.collect()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8192,
                 max_num_seqs=MAX_NUM_SEQS, tensor_parallel_size=tp, custom_all_reduce=custom)
    runs = {}
    try:
        construct = time.perf_counter() - start
        if tp > 1 and custom and eng.executor.runner.tp.custom is None:   # the default fell back to NCCL
            print(f"\n{label}: the custom all-reduce cannot run on these GPUs (the engine's warning says why): NCCL")
        run_engine(eng, make_workload(WORKLOADS["engine"], LLAMA3_8B_SHAPE["vocab_size"], seed=1)
                   .head(FIRST_RUN_REQUESTS))
        compiles = len(COMPILED)
        for name, (w, _) in setup.items():
            # The issue's workload is pytest-benchmark's figure; the other is timed the same way by hand.
            runs[name] = (benchmark.pedantic(run_engine, args=(eng, w), rounds=1, iterations=1) if name == "engine"
                          else run_engine(eng, w))
        timed_compiles = COMPILED[compiles:]
        comm = communication_share(eng) if tp > 1 and "scaled" in WORKLOADS else {}   # one GPU: no collective
        windows = {name: decode_window(eng, WINDOW_SEQS[name]) for name in WORKLOADS}
        num_pages, graphs = eng.executor.num_pages, len(eng.executor.runner.graphs)
    finally:   # the KV cache fills the GPUs: free them (and stop the worker) even when a check failed
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    assert not timed_compiles, f"the timed runs compiled Triton kernels: {timed_compiles}"
    for name, (tokens, seconds) in runs.items():
        roof = setup[name][1]
        r = dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, construct_s=construct,
                 pct_roofline=100 * tokens / seconds / (tp * roof["tokens_per_s"]), num_pages=num_pages,
                 cuda_graphs=graphs, **(comm if name == "scaled" else {}), **windows[name])
        one = RESULTS[name].get("TP=1")
        if tp > 1 and one:
            r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"]
            r["efficiency"] = r["speedup"] / tp
            r["decode_step_speedup"] = one["decode_step_ms"] / r["decode_step_ms"]
            if "run_comm_share" in r:
                r["speedup_without_communication"] = speedup_without_communication(r["speedup"],
                                                                                   r["run_comm_share"])
            if r["comm_calls_per_step"]:
                r["comm_share"] = r["comm_ms_per_step"] / r["decode_step_ms"]
        RESULTS[name][label] = r
        benchmark.extra_info[name] = r
        print(f"{label}, {name} workload: {tokens} tokens in {seconds:.2f} s = {r['tokens_per_s']:.0f} tok/s "
              f"({r['pct_roofline']:.1f}% of its roofline), Engine(...) {construct:.1f} s; decode step "
              f"({WINDOW_SEQS[name]} sequences) {r['decode_step_ms']:.2f} ms (windows after idle: "
              f"{', '.join(f'{m:.2f}' for m in r['windows_ms'])}), communication "
              f"{r['comm_ms_per_step']:.3f} ms in {r['comm_calls_per_step']:.0f} kernels per step "
              f"({'expected ' + str(COMM_CALLS_PER_STEP) if tp > 1 else 'none expected'})"
              + (f"; whole run (profiled, {r['profiled_run_s']:.2f} s): communication {r['run_comm_ms']:.0f} ms = "
                 f"{100 * r['run_comm_share']:.1f}%" if "run_comm_share" in r else ""))
        if tp > 1 and r["comm_calls_per_step"] == 0:
            print(f"  the profiler saw no communication kernel: its figure for {label} is missing, not zero")
        if r["window_compiles"]:
            print(f"  rank 0 compiled {r['window_compiles']} Triton kernels in the timed decode window: its step "
                  "time includes them")


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for name, results in RESULTS.items():
        if not results:
            continue
        lines = [f"{'engine':12} {'tok/s':>8} {'% roof':>7} {'speed-up':>9} {'effic.':>7} {'no-comm':>8} "
                 f"{'decode ms':>10} {'comm ms':>8} {'comm %':>7} {'run comm %':>11}"]
        for label, r in results.items():
            extra = (f"{r['speedup']:8.2f}x {100 * r['efficiency']:6.1f}% " if "speedup" in r
                     else f"{'-':>9} {'-':>7} ")
            extra += (f"{r['speedup_without_communication']:7.2f}x" if "speedup_without_communication" in r
                      else f"{'-':>8}")
            comm = (f"{r['comm_ms_per_step']:8.3f} {100 * r['comm_share']:6.1f}%" if "comm_share" in r
                    else f"{'-':>8} {'-':>7}")
            lines.append(f"{label:12} {r['tokens_per_s']:8.0f} {r['pct_roofline']:7.1f} {extra} "
                         f"{r['decode_step_ms']:10.2f} {comm} "
                         + (f"{100 * r['run_comm_share']:10.1f}%" if "run_comm_share" in r else f"{'-':>11}"))
        spec = WORKLOADS[name]
        print(f"\nLlama-3-8B shape, random bf16, {name} workload ({spec.requests} requests, prompts {spec.prompt}, "
              f"outputs {spec.output}; decode step: {WINDOW_SEQS[name]} sequences):\n" + "\n".join(lines))
