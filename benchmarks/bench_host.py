"""Host-side step overhead of chunkwise.Engine: the CPU tier of the benchmarks (runs on any machine).

The model's forward is a stand-in (chunkwise/engine/stand_in_model.py: logits hashed from each row's token and
position, installed as the engine's `model_class`), so a step is only the host's work: scheduling, page
bookkeeping, building the step's tensors, sampling and appending tokens. That is the time overlap scheduling would
hide behind the GPU's, and it should not grow as the engine does. It is NOT a performance figure of the engine: no
kernel runs, and on a CPU-only machine the figures are this host's. Every step is checked: one that fails (a
finish_reason "error") fails the benchmark, and the loops that reach the timed state are bounded.

    pytest --benchmark-only benchmarks/bench_host.py
    pytest --benchmark-only benchmarks/bench_host.py --benchmark-disable   # each body once, untimed (CI)
    pytest --benchmark-only benchmarks/bench_host.py -k composed -s     # a composed request's host time per mode

A composed request (issue #49 §2) is bench_blend_speed's TTFT shape: 8 of 20 registered, pinned documents of 512
tokens (and of 1,024, to see what grows with the tokens) in a random order + a 64-token question, max_tokens 1,
from `generate` to its first token, in each reuse mode and as the plain prompt of the same ids. Its host time is
this thread's CPU time (`time.thread_time`: a busy machine's other processes do not count) less the stand-in
forward's; the stand-in's own selection (a blend's check layers, on the device in the real engine) is reported
apart. Its model is tiny Qwen3 with four layers: three check layers, as a Qwen3 of 28 layers has. A blend runs
twice: eagerly (the CPU's path), and "staged" as a GPU runs it, its step staged into a blend graph's static inputs
(`BlendGraphs.stage`) and the stand-in run over them where the graph would be replayed (`static_forward`).
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.chunks import Blend
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


# ---- a composed request's host time (issue #49 §2) -------------------------------------------------------------------
COMPOSED_MODES = {"plain": None, "exact": "exact", "blend r=0.15": Blend(0.15),
                  "chunk-heads r=0.15": Blend(0.15, "chunk-heads")}
NUM_DOCS, PER_REQUEST, QUESTION_LEN = 20, 8, 64   # bench_blend_speed's TTFT shape
COMPOSED_ROUNDS = 40


class TimedHashLogitsModel(HashLogitsModel):
    """The stand-in forward, its thread time summed in `seconds` (so a request's host time can leave it out)."""

    seconds = 0.0

    def forward(self, inp, kv_caches, place=True):
        t = time.thread_time()
        try:
            return super().forward(inp, kv_caches, place)
        finally:
            self.seconds += time.thread_time() - t


class ComposedHostEngine(Engine):
    model_class = TimedHashLogitsModel


def composed_engine(doc_len: int, num_docs: int = NUM_DOCS, per_request: int = PER_REQUEST,
                    question_len: int = QUESTION_LEN, staged: bool = False, **kw) -> tuple[ComposedHostEngine, list]:
    """An engine whose composed requests fit one step, and its `num_docs` registered, pinned documents. `staged`: its
    blended steps go through the blend graphs' staging, as on a GPU, the stand-in run eagerly over the static
    inputs where the graph would be replayed."""
    ckpt = tiny_checkpoint("qwen3", max_position_embeddings=16384, num_hidden_layers=4)
    prompt_len = per_request * doc_len + question_len
    eng = ComposedHostEngine(ckpt, dtype="float32", max_model_len=prompt_len + 16, max_num_seqs=8,
                             max_num_batched_tokens=max(512, prompt_len), **kw)
    if staged:
        stage_blend_graphs(eng)
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    docs = [eng.register_chunk([rng.randrange(3, vocab) for _ in range(doc_len)], pin=True) for _ in range(num_docs)]
    return eng, docs


def stage_blend_graphs(eng: Engine) -> None:
    """Sends `eng`'s row-planned steps through its blend graphs' staging, as on a GPU, their forward run eagerly
    over the static inputs where the graph would be replayed (no capture without CUDA)."""
    graphs = eng.executor.runner.blend_graphs
    graphs.max_rows = eng.engine_config.max_num_batched_tokens   # as the runner sets it where graphs are captured
    graphs.replay = lambda host, key, table, last_tokens, place: graphs.static_forward(host, table, last_tokens, place)


def composed_prompt(docs: list, rng: random.Random, mode, vocab: int, per_request: int = PER_REQUEST,
                    question_len: int = QUESTION_LEN) -> tuple[list, object]:
    """`per_request` documents in a random order and a fresh question, and the reuse mode to send it with: "plain"
    (mode None) sends the same ids as one plain prompt."""
    prompt = rng.sample(docs, per_request) + [[rng.randrange(3, vocab) for _ in range(question_len)]]
    if mode is None:
        return [t for p in prompt for t in (p.token_ids if hasattr(p, "token_ids") else p)], "exact"
    return prompt, mode


def composed_host_seconds(eng: ComposedHostEngine, prompt: list, reuse) -> tuple[float, float, object]:
    """(host seconds, stand-in forward seconds, output) of one request, `generate` to its first token, in this
    thread's CPU time."""
    model = eng.executor.runner.model
    before = model.seconds
    t = time.thread_time()
    out = eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), reuse=reuse, use_tqdm=False)[0]
    total = time.thread_time() - t
    assert out.finish_reason == "length", (out.finish_reason, out.error)
    forward = model.seconds - before
    return total - forward, forward, out


@pytest.fixture
def one_thread():
    """torch on one thread while a test runs: the stand-in's selection then does not spin other threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


COMPOSED_CASES = [(mode, False) for mode in COMPOSED_MODES] + [
    (mode, True) for mode, reuse in COMPOSED_MODES.items() if isinstance(reuse, Blend)]


@pytest.mark.parametrize("doc_len", [512, 1024])
@pytest.mark.parametrize("mode, staged", COMPOSED_CASES, ids=[m + (", staged" if st else "") for m, st in COMPOSED_CASES])
def test_composed_request_host_time(benchmark, one_thread, mode, staged, doc_len):
    eng, docs = composed_engine(doc_len, staged=staged)
    rng = random.Random(1)
    vocab = eng.model_config.vocab_size
    reuse_mode = COMPOSED_MODES[mode]
    for _ in range(3):   # warm-up
        composed_host_seconds(eng, *composed_prompt(docs, rng, reuse_mode, vocab))
    host, forward = [], []

    def one(prompt, reuse):
        h, f, _ = composed_host_seconds(eng, prompt, reuse)
        host.append(h)
        forward.append(f)

    benchmark.group = f"a composed request, {PER_REQUEST} x {doc_len} + {QUESTION_LEN} tokens: host only"
    benchmark.pedantic(one, setup=lambda: (composed_prompt(docs, rng, reuse_mode, vocab), {}),
                       rounds=COMPOSED_ROUNDS, iterations=1)
    assert (eng.executor.runner.launches["blend", "graph"] > 0) == staged   # the path the case names
    ms = 1e3 * statistics.median(host)
    mode = mode + (", staged" if staged else "")
    benchmark.extra_info.update(mode=mode, doc_len=doc_len, host_ms=ms, least_host_ms=1e3 * min(host),
                                stand_in_forward_ms=1e3 * statistics.median(forward),
                                note="thread CPU time, generate to first token, less the stand-in forward; not a "
                                     "performance figure")
    print(f"[composed host] {mode}, {PER_REQUEST} x {doc_len} + {QUESTION_LEN}: host {ms:.2f} ms (median of "
          f"{len(host)}; least {1e3 * min(host):.2f} ms), stand-in forward {1e3 * statistics.median(forward):.2f} ms")
