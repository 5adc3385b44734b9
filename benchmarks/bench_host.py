"""Host-side step overhead of chunkwise.Engine: the CPU tier of the benchmarks (runs on any machine).

The model's forward is a stand-in (chunkwise/engine/stand_in_model.py: logits hashed from each row's token and
position, installed as the engine's `model_class`), so a step is only the host's work: scheduling, page
bookkeeping, building the step's tensors, sampling and appending tokens. That is the time overlap scheduling would
hide behind the GPU's, and it should not grow as the engine does. It is NOT a performance figure of the engine: no
kernel runs, and on a CPU-only machine the figures are this host's. Every step is checked: one that fails (a
finish_reason "error") fails the benchmark, and the loops that reach the timed state are bounded.

    pytest --benchmark-only benchmarks/bench_host.py
    pytest --benchmark-only benchmarks/bench_host.py --benchmark-disable   # each body once, untimed (CI)
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.llm_engine import StepOutput
from chunkwise.engine.stand_in_model import HashLogitsModel

GROUP = "host-side step overhead, forward stubbed out (not a performance figure)"
NUM_SEQS, PROMPT_LEN, MAX_MODEL_LEN, BUDGET = 64, 48, 1024, 512
ROUNDS = 100


class HostOnlyEngine(Engine):
    """chunkwise.Engine with the stand-in forward: host work only."""
    model_class = HashLogitsModel


def host_only_engine(num_seqs: int = NUM_SEQS, **kw) -> HostOnlyEngine:
    """A tiny Qwen3 engine running `num_seqs` sequences at once, its forward the stand-in's."""
    return HostOnlyEngine("tiny-qwen3", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=num_seqs, **kw)


def submit(eng: Engine, params: SamplingParams, num_seqs: int = NUM_SEQS, prompt_len: int = PROMPT_LEN) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(num_seqs):
        eng.add_request(torch.randint(3, eng.model_config.vocab_size, (prompt_len,), generator=gen).tolist(), params)


def checked(outputs: list[StepOutput]) -> list[StepOutput]:
    """A step's outputs, or AssertionError naming the requests the step failed (the engine contains a failing
    forward or sampler: its requests finish with finish_reason "error", the exception on their outputs)."""
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert not failed, (f"a step failed requests {[o.request_id for o in failed]}: "
                        f"{failed[0].output.error if failed[0].output is not None else None}")
    return outputs


def step_until(eng: Engine, done: Callable[[list[StepOutput]], bool], max_steps: int) -> list[StepOutput]:
    """Steps `eng` until done(a step's outputs); AssertionError if a step fails or `max_steps` do not get there."""
    for _ in range(max_steps):
        outputs = checked(eng.step())
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {max_steps} steps (waiting: {len(eng.scheduler.waiting)}, running: "
                         f"{len(eng.scheduler.running)})")


def prefill_all(eng: Engine, num_seqs: int = NUM_SEQS, prompt_len: int = PROMPT_LEN) -> list[StepOutput]:
    """Steps until one step samples all `num_seqs` (every prompt prefilled: each step from then on decodes them all);
    that step's outputs. The budget computes the prompts in ceil(tokens / budget) steps; twice that, plus one, is
    the cap."""
    budget = eng.engine_config.max_num_batched_tokens
    return step_until(eng, lambda outs: len(outs) == num_seqs, max_steps=2 * -(-num_seqs * prompt_len // budget) + 1)


def decode_params(sampling: str, prompt_len: int = PROMPT_LEN) -> SamplingParams:
    """Parameters under which no sequence finishes before the engine's max_model_len."""
    return SamplingParams(max_tokens=MAX_MODEL_LEN - prompt_len, ignore_eos=True,
                          **({} if sampling == "greedy" else dict(temperature=0.8, top_p=0.9, seed=0)))


@pytest.mark.parametrize("sampling", ["greedy", "top-p"])
def test_decode_step_host_overhead(benchmark, sampling):
    eng = host_only_engine(max_num_batched_tokens=BUDGET)
    submit(eng, decode_params(sampling))
    prefill_all(eng)
    benchmark.group = GROUP
    steps = checked(benchmark.pedantic(eng.step, rounds=ROUNDS, iterations=1, warmup_rounds=5))
    assert len(steps) == NUM_SEQS and all(len(s.new_token_ids) == 1 for s in steps)
    benchmark.extra_info.update(sequences=NUM_SEQS, sampling=sampling, device=str(eng.executor.runner.device),
                                note="forward stubbed out; host work only; not a performance figure")


def test_prefill_step_host_overhead(benchmark):
    """Steps of the prompts' prefill chunks (the token budget splits them), pages allocated as they go."""
    def fresh():
        eng = host_only_engine(max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
        submit(eng, SamplingParams(max_tokens=1, ignore_eos=True))
        return (eng,), {}

    benchmark.group = GROUP
    checked(benchmark.pedantic(lambda eng: eng.step(), setup=fresh, rounds=20, iterations=1))
    benchmark.extra_info.update(sequences=NUM_SEQS, prompt_len=PROMPT_LEN, max_num_batched_tokens=BUDGET,
                                note="forward stubbed out; host work only; not a performance figure")
