"""Host-side step overhead of chunkwise.Engine: the CPU tier of the benchmarks (runs on any machine).

The model's forward is replaced by random logits, so a step is only the host's work: scheduling, page
bookkeeping, building the step's tensors, sampling and appending tokens. That is the time overlap
scheduling would hide behind the GPU's, and it should not grow as the engine does. It is NOT a performance
figure of the engine: no kernel runs, and on a CPU-only machine the figures are this host's.

    pytest --benchmark-only benchmarks/bench_host.py
"""
from __future__ import annotations

import pytest
import torch

from chunkwise.engine import Engine, SamplingParams

GROUP = "host-side step overhead, forward stubbed out (not a performance figure)"
NUM_SEQS, PROMPT_LEN, MAX_MODEL_LEN = 64, 48, 1024
ROUNDS = 100


def host_only_engine(**kw) -> Engine:
    """A tiny Qwen3 engine whose forward returns seeded random logits [rows to sample, vocab] at once."""
    eng = Engine("tiny-qwen3", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS, **kw)
    vocab, device = eng.model_config.vocab_size, eng.executor.runner.device
    gen = torch.Generator(device=device).manual_seed(0)
    eng.executor.runner.model.forward = lambda inp, kv_caches: torch.randn(
        inp.logits_indices.shape[0], vocab, generator=gen, device=device)
    return eng


def submit(eng: Engine, params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(NUM_SEQS):
        eng.add_request(torch.randint(3, eng.model_config.vocab_size, (PROMPT_LEN,), generator=gen).tolist(), params)


@pytest.mark.parametrize("sampling", ["greedy", "top-p"])
def test_decode_step_host_overhead(benchmark, sampling):
    eng = host_only_engine()
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_LEN, ignore_eos=True,
                            **({} if sampling == "greedy" else dict(temperature=0.8, top_p=0.9, seed=0)))
    submit(eng, params)
    while len(eng.step()) < NUM_SEQS:   # until every prompt is prefilled: then each step decodes all
        pass
    benchmark.group = GROUP
    steps = benchmark.pedantic(eng.step, rounds=ROUNDS, iterations=1, warmup_rounds=5)
    assert len(steps) == NUM_SEQS and all(len(s.new_token_ids) == 1 for s in steps)
    benchmark.extra_info.update(sequences=NUM_SEQS, sampling=sampling, device=str(eng.executor.runner.device),
                                note="forward stubbed out; host work only; not a performance figure")


def test_prefill_step_host_overhead(benchmark):
    """Steps of the prompts' prefill chunks (the token budget splits them), pages allocated as they go."""
    def fresh():
        eng = host_only_engine(max_num_batched_tokens=512, enable_prefix_caching=False)
        submit(eng, SamplingParams(max_tokens=1, ignore_eos=True))
        return (eng,), {}

    benchmark.group = GROUP
    benchmark.pedantic(lambda eng: eng.step(), setup=fresh, rounds=20, iterations=1)
    benchmark.extra_info.update(sequences=NUM_SEQS, prompt_len=PROMPT_LEN, max_num_batched_tokens=512,
                                note="forward stubbed out; host work only; not a performance figure")
