"""The hardware ceilings, measured in the benchmark's own process, and the time a workload cannot beat.

Ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, each the median
of timed repeats on random data after a warm-up.

Workload roofline (an ideal engine with every request running at once): each decode step reads every
weight once and each running sequence's whole KV, and does 2 FLOPs per weight per sequence plus attention;
it takes the larger of its bytes over bandwidth and FLOPs over the matmul rate. Every prompt token costs
2 FLOPs per non-embedding weight plus causal attention, at the matmul rate. The first output token of a
request comes from its prefill; each later one from a decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


def measure_ceilings(device="cuda") -> Ceilings:
    import triton.testing   # here: importing Triton first would keep the kernels off its CPU interpreter

    n = 1 << 30   # 2 GiB of bf16: far past L2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    del src, dst
    m = 8192
    a, b = (torch.randn(m, m, dtype=torch.bfloat16, device=device) for _ in range(2))
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return Ceilings(2 * 2 * n / (copy_ms * 1e-3), 2 * m ** 3 / (mm_ms * 1e-3))


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of one token, from the model's shape."""
    weight_bytes: int          # every weight once (tied embeddings once)
    linear_params: int         # weights a token multiplies through the layers (no embedding, no lm_head)
    lm_head_params: int
    kv_bytes_per_token: int    # K and V of every layer
    attn_flops_per_key: int    # QK^T and PV for one query against one key, all layers

    @classmethod
    def of(cls, cfg, path, dtype_bytes: int = 2) -> "ModelCost":
        """From the config and the checkpoint directory's tensor shapes (nothing is loaded)."""
        numel = {}
        for f in Path(path).glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                numel.update({k: math.prod(st.get_slice(k).get_shape()) for k in st.keys()})
        if cfg.tie_word_embeddings:
            numel.pop("lm_head.weight", None)
        embed = numel["model.embed_tokens.weight"]
        linear = sum(v for k, v in numel.items() if k.startswith("model.layers."))
        return cls(sum(numel.values()) * dtype_bytes, linear, numel.get("lm_head.weight", embed),
                   2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes,
                   4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)

    def decode_step(self, context_lens: np.ndarray) -> tuple[int, int]:
        """(bytes, FLOPs) of one decode step over sequences holding context_lens tokens (the new one included)."""
        n, keys = len(context_lens), int(np.sum(context_lens))
        return (self.weight_bytes + keys * self.kv_bytes_per_token,
                2 * (self.linear_params + self.lm_head_params) * n + self.attn_flops_per_key * keys)

    def prefill_flops(self, prompt_len: int) -> int:
        return (2 * self.linear_params * prompt_len + 2 * self.lm_head_params
                + self.attn_flops_per_key * prompt_len * (prompt_len + 1) // 2)


def step_seconds(nbytes: float, flops: float, c: Ceilings) -> float:
    return max(nbytes / c.copy_bytes_per_s, flops / c.matmul_flops_per_s)


def workload_roofline(cost: ModelCost, prompt_lens, output_lens, c: Ceilings) -> dict:
    """Seconds an ideal engine needs for the workload, with its parts."""
    p, o = np.asarray(prompt_lens), np.asarray(output_lens)
    prefill = sum(cost.prefill_flops(int(x)) for x in p) / c.matmul_flops_per_s
    decode, kv_bytes, steps = 0.0, 0, int(o.max()) - 1
    for s in range(1, steps + 1):   # step s samples token s + 1 of every request that wants that many
        running = o > s
        nbytes, flops = cost.decode_step(p[running] + s)
        decode += step_seconds(nbytes, flops, c)
        kv_bytes += nbytes - cost.weight_bytes
    return dict(seconds=prefill + decode, prefill_s=prefill, decode_s=decode, decode_steps=steps,
                kv_read_tb=kv_bytes / 1e12, tokens_per_s=int(o.sum()) / (prefill + decode))


def layered_prefill(cost: ModelCost, num_layers: int, rows_per_layer, mean_keys: float, moved_tokens: int,
                    c: Ceilings) -> dict:
    """The floor of one prefill step that computes rows_per_layer[l] rows at layer l, each attending to about
    `mean_keys` keys, after moving `moved_tokens` tokens' K/V (every layer) from one slot to another: the layers' FLOPs
    at the matmul rate, but no faster than one read of the weights, then the moves at the copy rate (read + write).
    A row dropped at a layer costs nothing there, so a blend's roofline counts each layer at its kept share."""
    rows = float(np.sum(rows_per_layer))
    flops = (2 * cost.linear_params * rows + cost.attn_flops_per_key * mean_keys * rows) / num_layers \
        + 2 * cost.lm_head_params
    compute = max(flops / c.matmul_flops_per_s, cost.weight_bytes / c.copy_bytes_per_s)
    move = 2 * moved_tokens * cost.kv_bytes_per_token / c.copy_bytes_per_s
    return dict(seconds=compute + move, compute_s=compute, move_s=move, flops=flops)
