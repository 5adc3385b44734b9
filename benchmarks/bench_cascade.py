"""Cascade attention on a shared system prompt: the engine with it on and off, same process (GPU).

    pytest --benchmark-only benchmarks/bench_cascade.py -s

256 requests share a 4096-token system prompt, each followed by 100..500 unique tokens, and ask for 256
output tokens (ignore_eos), on a random bf16 model of Qwen3-0.6B's shape. The system prompt is cached first
by one request, as a server's would be; every request then takes its pages. Reported per mode: end-to-end
output tokens/s and decode-phase throughput (from the first decode-only step on, timed without synchronising
inside it), both against the roofline of an engine that reads the shared prompt's KV once per step (copy
bandwidth and matmul rate measured first); the seconds before and in the decode phase; the timed run's steps
by kind (cascade / decode / mixed) and path (CUDA graph / eager) and its Triton compiles; and whether both
modes generated the same tokens (else the first request and position where they part).
"""
from __future__ import annotations

import gc
import time
from collections import Counter

import numpy as np
import pytest
import torch

from benchmarks.bench_engine import COMPILED, QWEN3_0_6B_SHAPE, _install_compile_counter
from benchmarks.roofline import ModelCost, measure_ceilings, step_seconds
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.model_config import ModelConfig
from chunkwise.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu
SHARED, UNIQUE, OUTPUT, REQUESTS = 4096, (100, 500), 256, 256
RESULTS: dict[str, dict] = {}


def workload(seed: int):
    gen = torch.Generator().manual_seed(seed)
    vocab = QWEN3_0_6B_SHAPE["vocab_size"]
    system = torch.randint(3, vocab, (SHARED,), generator=gen).tolist()
    lens = torch.randint(UNIQUE[0], UNIQUE[1] + 1, (REQUESTS,), generator=gen).tolist()
    return system, [system + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def roofline(cost: ModelCost, unique_lens, ceilings) -> dict:
    """Seconds of an ideal engine that reads the shared prompt once per decode step (and computes it once)."""
    u = np.asarray(unique_lens)
    prefill = (cost.prefill_flops(SHARED) + sum(cost.prefill_flops(SHARED + int(n)) - cost.prefill_flops(SHARED)
                                                for n in u)) / ceilings.matmul_flops_per_s
    decode = 0.0
    for s in range(1, OUTPUT):
        nbytes, flops = cost.decode_step(u + s)            # each sequence's own tokens
        nbytes += SHARED * cost.kv_bytes_per_token          # the shared prompt, once
        flops += cost.attn_flops_per_key * SHARED * len(u)
        decode += step_seconds(nbytes, flops, ceilings)
    return dict(seconds=prefill + decode, decode_s=decode, tokens_per_s=REQUESTS * OUTPUT / (prefill + decode),
                decode_tokens_per_s=REQUESTS * (OUTPUT - 1) / decode)


def run(eng: Engine, system, prompts) -> dict:
    """One timed generate. Its decode phase runs from the call that launches the first decode-only step to the
    end, timed without synchronising inside it (overlap scheduling keeps working); its tokens are the rows of
    the decode-only steps launched."""
    eng.generate([system + [5]], SamplingParams(max_tokens=1))   # caches the system prompt's pages
    window = dict(call=0.0, start=None, tokens=0)
    step, forward = eng.core.step, eng.executor.runner.forward

    def marked_step():
        window["call"] = time.perf_counter()
        return step()

    def counted_forward(host, *args, **kwargs):
        if host.num_prefill == 0:
            if window["start"] is None:
                window["start"] = window["call"]
            window["tokens"] += len(host.ids)
        return forward(host, *args, **kwargs)
    eng.core.step, eng.executor.runner.forward = marked_step, counted_forward
    launches = Counter(eng.executor.runner.launches)
    compiled = len(COMPILED)
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        outs = eng.generate(prompts, SamplingParams(max_tokens=OUTPUT, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
    finally:
        del eng.core.step, eng.executor.runner.forward
    end = time.perf_counter()
    assert all(len(o.token_ids) == OUTPUT for o in outs)
    assert min(o.num_cached_tokens for o in outs) >= SHARED - eng.page_size, "a request missed the cached prompt"
    steps = {f"{kind} {path}": n for (kind, path), n in sorted((eng.executor.runner.launches - launches).items())}
    return dict(tokens_per_s=REQUESTS * OUTPUT / (end - start), seconds=end - start,
                prefill_phase_s=window["start"] - start, decode_phase_s=end - window["start"],
                decode_tokens_per_s=window["tokens"] / (end - window["start"]), steps=steps,
                compiles=COMPILED[compiled:], outputs=[o.token_ids for o in outs])


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    """'identical', or the first request whose tokens differ, where, and how many requests differ."""
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not differ:
        return "identical"
    i = differ[0]
    k = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
    return (f"DIFFER in {len(differ)} of {len(a)} requests; first request {i} at output position {k}: "
            f"{a[i][k:k + 4]} vs {b[i][k:k + 4]}")


@pytest.mark.parametrize("cascade", [False, True], ids=["cascade_off", "cascade_on"])
def test_shared_system_prompt(benchmark, cascade):
    ckpt = tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE)
    _install_compile_counter()
    if "ceilings" not in RESULTS:
        RESULTS["ceilings"] = measure_ceilings()
        system, prompts = workload(seed=0)
        RESULTS["roofline"] = roofline(ModelCost.of(ModelConfig.from_dir(ckpt), ckpt),
                                       [len(p) - SHARED for p in prompts], RESULTS["ceilings"])
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=SHARED + UNIQUE[1] + OUTPUT + 16,
                 max_num_batched_tokens=8192, max_num_seqs=REQUESTS, cascade_attention=cascade)
    try:
        run(eng, *workload(seed=1))   # warm-up on other prompts: compiles what the timed run uses
        r = benchmark.pedantic(run, args=(eng, *workload(seed=0)), rounds=1, iterations=1)
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    roof = RESULTS["roofline"]
    r["pct_roofline"] = 100 * r["tokens_per_s"] / roof["tokens_per_s"]
    r["decode_pct_roofline"] = 100 * r["decode_tokens_per_s"] / roof["decode_tokens_per_s"]
    RESULTS["on" if cascade else "off"] = r
    benchmark.extra_info.update({k: v for k, v in r.items() if k != "outputs"})
    print(f"\ncascade {'on' if cascade else 'off'}: {r['tokens_per_s']:.0f} tok/s end to end "
          f"({r['pct_roofline']:.1f}% of {roof['tokens_per_s']:.0f}; {r['prefill_phase_s']:.2f} s until the first "
          f"decode-only step, {r['decode_phase_s']:.2f} s after), decode {r['decode_tokens_per_s']:.0f} tok/s "
          f"({r['decode_pct_roofline']:.1f}% of {roof['decode_tokens_per_s']:.0f}); steps by kind and path: "
          f"{r['steps']}; Triton compiles in the timed run: {len(r['compiles'])} {r['compiles'][:3]}")
    if "on" in RESULTS and "off" in RESULTS:
        on, off = RESULTS["on"], RESULTS["off"]
        print(f"cascade on/off: end to end {on['tokens_per_s'] / off['tokens_per_s']:.2f}x, decode "
              f"{on['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}x; outputs (on vs off): "
              f"{first_difference(on['outputs'], off['outputs'])}")
