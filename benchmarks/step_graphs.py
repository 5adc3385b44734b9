"""Would CUDA graphs pay for mixed and prefill steps? Eager forward against a graph replay of the same step (GPU).

    python -m benchmarks.step_graphs

For steps shaped like the benchmark's (Qwen3-0.6B shape, bf16): a full 8192-token prefill step, the same
with 64 decodes riding along, a small chunk with decodes, and a decode-only step. Each is timed eagerly
(every kernel launched from Python) and as one captured graph over the same inputs, median of repeats
after a warm-up. The gap is the launch overhead a graph would remove; padded token buckets or piecewise
graphs would add padding or splits on top, so this is the most they can gain.
"""
from __future__ import annotations

import torch
import triton.testing

from benchmarks.bench_engine import QWEN3_0_6B_SHAPE
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine
from chunkwise.engine.host_step import synthetic_step

STEPS = {   # name: (prefill chunk lengths, decodes)
    "prefill 8192": ([8192], 0),
    "prefill 2x4064 + 64 decodes": ([4064, 4064], 64),
    "chunk 512 + 64 decodes": ([512], 64),
    "decode 64": ([], 64),
    "decode 256": ([], 256),
}


def main():
    ckpt = tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE)
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=8192 + 144, max_num_batched_tokens=8192, max_num_seqs=256,
                 enforce_eager=True, gpu_memory_utilization=0.5)
    runner = eng.executor.runner
    print(f"{'step':30} {'eager ms':>9} {'graph ms':>9} {'graph/eager':>11}")
    for name, (chunks, decodes) in STEPS.items():
        inp = runner._upload(synthetic_step(chunks, decodes))
        with torch.inference_mode():
            def eager():
                return runner.model.forward(inp, runner.kv.layers)
            eager()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager()
            t_eager = triton.testing.do_bench(eager, warmup=50, rep=300, return_mode="median")
            t_graph = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
        print(f"{name:30} {t_eager:9.3f} {t_graph:9.3f} {t_graph / t_eager:11.2f}")
        del graph


if __name__ == "__main__":
    main()
