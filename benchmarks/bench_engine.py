"""Engine throughput: optimized.Engine beside HF transformers `generate`, same prompts, same run (GPU).

Workload as nano-vllm's bench.py: 256 requests of random token ids, prompt and output lengths drawn
from 100..1024 with a fixed seed, ignore_eos, on a random bf16 model of Qwen3-0.6B's shape. Throughput
counts the output tokens the requests asked for. HF runs greedy, batched with left padding, on the
first CHUNKWISE_BENCH_HF_REQUESTS requests (default 32: all 256 would take longer than a device call);
its batches are grouped by output length and each generates its longest request's length.

    pytest --benchmark-only benchmarks/bench_engine.py -s
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

from chunkwise.checkpoints import tiny_checkpoint
from optimized import Engine, SamplingParams

pytestmark = pytest.mark.gpu

QWEN3_0_6B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.02)
NUM_REQUESTS = 256
MIN_LEN, MAX_LEN = 100, 1024
HF_REQUESTS = int(os.environ.get("CHUNKWISE_BENCH_HF_REQUESTS", "32"))
HF_BATCH = 16
RESULTS: dict[str, float] = {}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(n: int, vocab: int, lo: int = MIN_LEN, hi: int = MAX_LEN, seed: int = 0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    output_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (p,), generator=gen).tolist() for p in prompt_lens]
    return Workload(prompts, output_lens)


def run_engine(eng: Engine, w: Workload) -> tuple[int, float]:
    """(output tokens, seconds) for the whole workload through the engine."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in w.output_lens]
    sync()
    start = time.perf_counter()
    outs = eng.generate(w.prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(w.output_lens)
    return tokens, seconds


def run_hf(model, w: Workload, batch_size: int) -> tuple[int, float]:
    """(requested output tokens, seconds) through HF generate, greedy, batches grouped by output length."""
    order = sorted(range(len(w.prompts)), key=lambda i: w.output_lens[i])
    device = next(model.parameters()).device
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
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + new
    sync()
    return sum(w.output_lens[i] for i in order), time.perf_counter() - start


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3", seed=0, **QWEN3_0_6B_SHAPE)


@pytest.fixture(scope="module")
def workload():
    return make_workload(NUM_REQUESTS, QWEN3_0_6B_SHAPE["vocab_size"])


def test_optimized_engine_throughput(benchmark, ckpt, workload):
    eng = Engine(ckpt, dtype="bfloat16", max_model_len=2 * MAX_LEN + 16, max_num_batched_tokens=8192,
                 max_num_seqs=256)
    run_engine(eng, make_workload(8, QWEN3_0_6B_SHAPE["vocab_size"], 20, 40, seed=1))   # compile kernels
    tokens, seconds = benchmark.pedantic(run_engine, args=(eng, workload), rounds=1, iterations=1)
    RESULTS["optimized"] = tokens / seconds
    benchmark.extra_info.update(output_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                                num_pages=eng.runner.num_pages, cuda_graphs=len(eng.runner.graphs))
    print(f"\noptimized.Engine: {tokens} output tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s "
          f"({len(workload.prompts)} requests, {eng.runner.num_pages} pages of {eng.page_size})")
    del eng
    torch.cuda.empty_cache()


def test_hf_generate_throughput(benchmark, ckpt, workload):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    subset = Workload(workload.prompts[:HF_REQUESTS], workload.output_lens[:HF_REQUESTS])
    run_hf(model, make_workload(2, QWEN3_0_6B_SHAPE["vocab_size"], 20, 40, seed=1), HF_BATCH)   # warm-up
    tokens, seconds = benchmark.pedantic(run_hf, args=(model, subset, HF_BATCH), rounds=1, iterations=1)
    RESULTS["hf"] = tokens / seconds
    ratio = RESULTS.get("optimized", float("nan")) / RESULTS["hf"]
    benchmark.extra_info.update(output_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                                requests=len(subset.prompts), batch_size=HF_BATCH, optimized_over_hf=ratio)
    print(f"\nHF generate: {tokens} output tokens of {len(subset.prompts)} requests in {seconds:.1f} s = "
          f"{tokens / seconds:.0f} tok/s; optimized/HF = {ratio:.2f}x")
