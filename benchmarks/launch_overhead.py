"""Where an eager step's host time goes (GPU): per kernel, the wrapper's Python against Triton's own launch.

    PYTHONPATH=$PWD python -m benchmarks.launch_overhead

An eager forward of a random bf16 model of Qwen3-0.6B's shape (steps the mixed graphs do not hold: blended
prefills, steps past max_graph_tokens, tensor parallelism) issues some 250 launches from Python. This times, after a
warm-up, the host's issue time of a few such steps against their wall time, and per launch: each kernel wrapper the
model calls (checks, tile choice, allocation and the launch) and, inside it, Triton's `JITFunction.run`; next to a
bare Triton launch of 1 and of 30 arguments and `torch.add`, this host's floor. Timers add about 1 us a call.
"""
from __future__ import annotations

import collections
import time

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import chunkwise.engine.model as model_module
from benchmarks.bench_engine import QWEN3_0_6B_SHAPE
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine
from chunkwise.engine.host_step import synthetic_step

WRAPPERS = ("paged_attention", "split_kv_decode", "rope_store", "add_rms_norm", "rms_norm", "act_and_mul",
            "rope_cos_sin")
STEPS = {"prefill 2048": ([2048], 0), "chunk 512 + 12 decodes": ([512], 12), "12 decodes": ([], 12)}


class Timers:
    """Seconds and calls per name, from wrappers installed around the model's kernel calls and Triton's launch."""

    def __init__(self):
        self.seconds, self.calls = collections.Counter(), collections.Counter()

    def timed(self, name: str, fn):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - began
                self.calls[name] += 1
        return call

    def install(self) -> None:
        for name in WRAPPERS:
            setattr(model_module, name, self.timed(name, getattr(model_module, name)))
        run = JITFunction.run

        def jit_run(kernel, *args, **kwargs):
            return self.timed("triton " + kernel.fn.__name__, lambda: run(kernel, *args, **kwargs))()
        JITFunction.run = jit_run

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@triton.jit
def _one(x):
    tl.store(x, 1.0)


@triton.jit
def _thirty(x, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
            c0, c1, c2, c3, c4, c5, c6, c7, c8, BLOCK: tl.constexpr):
    tl.store(x, 1.0)


def floor_us(launch, n: int = 2000) -> float:
    """Host microseconds per call of `launch` (asynchronous: the GPU is not waited for)."""
    launch()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(n):
        launch()
    seconds = time.perf_counter() - began
    torch.cuda.synchronize()
    return seconds / n * 1e6


def main(reps: int = 5) -> None:
    x = torch.zeros(16, device="cuda")
    ints = list(range(3, 32))
    one, thirty = floor_us(lambda: _one[(1,)](x)), floor_us(lambda: _thirty[(1,)](x, *ints, BLOCK=16))
    print(f"triton {triton.__version__}, torch {torch.__version__}; floor per launch: Triton 1 argument {one:.1f} us, "
          f"30 arguments {thirty:.1f} us, torch.add {floor_us(lambda: torch.add(x, 1)):.1f} us")
    ckpt = tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE)
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=64,
                 enforce_eager=True, gpu_memory_utilization=0.5)
    runner = eng.executor.runner
    timers = Timers()
    timers.install()
    with torch.inference_mode():
        for name, (chunks, decodes) in STEPS.items():
            inp = runner._upload(synthetic_step(chunks, decodes))   # host time does not depend on the context
            for _ in range(3):
                runner.model.forward(inp, runner.kv.layers)
            torch.cuda.synchronize()
            timers.clear()
            issued = wall = 0.0
            for _ in range(reps):
                began = time.perf_counter()
                runner.model.forward(inp, runner.kv.layers)
                issued += time.perf_counter() - began
                torch.cuda.synchronize()
                wall += time.perf_counter() - began
            print(f"\n{name}: issued in {issued / reps * 1e3:.2f} ms, done in {wall / reps * 1e3:.2f} ms")
            for label in sorted(timers.calls, key=lambda k: (k.startswith("triton"), k)):
                print(f"  {label:32s} {timers.calls[label] // reps:4d} a step, "
                      f"{timers.seconds[label] / timers.calls[label] * 1e6:6.1f} us each")
    eng.close()


if __name__ == "__main__":
    main()
