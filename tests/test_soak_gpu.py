"""GPU soak: thousands of requests with random lengths, chunkings and sampling parameters, random aborts,
a pool small enough to preempt often, and injected faults. Every request that is neither aborted nor hit
by a fault finishes; the pool ends whole; sampled greedy outputs equal the reference's.

`CHUNKWISE_SOAK_REQUESTS` sets the number of requests (default 2000); the figures are printed (-s).
"""
import os
import random
import time

import pytest
import torch

import chunkwise.reference
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 48)
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.3, 0.8, 1.5]), top_k=rng.choice([0, 5, 50]),
                          top_p=rng.choice([0.5, 0.9, 1.0]), seed=rng.randrange(1 << 30),
                          logprobs=rng.choice([None, 0, 3]), stop_token_ids=(rng.randrange(3, VOCAB),))


def random_chunks(rng: random.Random, n: int):
    kind = rng.random()
    if kind < 0.4 or n == 1:
        return None
    if kind < 0.7:
        return rng.randint(1, n)
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 6))))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def soak(device: str, num_requests: int, seed: int = 0, checked: int = 40) -> dict:
    rng = random.Random(seed)
    ckpt = tiny_checkpoint("qwen3")
    page_size = 16
    eng = Engine(ckpt, dtype="float32", device=device, page_size=page_size, num_pages=96, max_model_len=512,
                 max_num_batched_tokens=512, max_num_seqs=48)
    stats = dict(requests=num_requests, steps=0, preemptions=0, aborts=0, faults=0, errored=0, finished=0)
    schedule, run = eng.scheduler.schedule, eng.runner.run

    def counting_schedule():
        batch = schedule()
        stats["preemptions"] += len(batch.preempted)
        return batch

    def faulty_run(batch):
        if rng.random() < 0.003:
            stats["faults"] += 1
            raise RuntimeError("injected fault")
        return run(batch)
    eng.scheduler.schedule, eng.runner.run = counting_schedule, faulty_run

    prompts, params, outputs, live = {}, {}, {}, set()
    submitted = 0
    start = time.perf_counter()
    while submitted < num_requests or eng.has_unfinished():
        while submitted < num_requests and len(live) < 96 and rng.random() < 0.7:
            n = rng.randint(1, 200)
            prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
            if prompts and rng.random() < 0.3:   # share a prefix with an earlier prompt
                other = prompts[rng.choice(list(prompts))]
                prompt = other[:rng.randint(1, len(other))] + prompt[:rng.randint(1, 40)]
            p = random_params(rng)
            rid = eng.add_request(prompt, p, random_chunks(rng, len(prompt)))
            prompts[rid], params[rid] = prompt, p
            live.add(rid)
            submitted += 1
        if live and rng.random() < 0.01:
            out = eng.abort(rng.choice(sorted(live)))
            live.discard(out.request_id)
            outputs[out.request_id] = out
            stats["aborts"] += 1
        for r in eng.step():
            if r.finished:
                live.discard(r.request_id)
                outputs[r.request_id] = r.output
                stats["errored" if r.finish_reason == "error" else "finished"] += r.finish_reason != "abort"
        stats["steps"] += 1
    stats["seconds"] = round(time.perf_counter() - start, 1)
    assert not live, f"requests never finished: {sorted(live)[:10]}"
    assert len(outputs) == num_requests
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages, "pages leaked"
    assert not eng.runner.generators
    for rid, out in outputs.items():
        if out.finish_reason in ("length", "stop"):
            assert len(out.token_ids) <= params[rid].max_tokens
            assert out.finish_reason == "stop" or len(out.token_ids) == params[rid].max_tokens
        else:
            assert out.finish_reason in ("abort", "error"), out.finish_reason
    greedy = [r for r, o in outputs.items() if params[r].greedy and o.finish_reason == "length"]
    ref = chunkwise.reference.Engine(ckpt, dtype="float32", device=device, max_model_len=512)
    sample = rng.sample(greedy, min(checked, len(greedy)))
    want = ref.generate([prompts[r] for r in sample], [params[r] for r in sample])
    for r, w in zip(sample, want):
        assert outputs[r].token_ids == w.token_ids, f"request {r}: {outputs[r].token_ids} != {w.token_ids}"
    stats["checked_against_reference"] = len(sample)
    stats["leaked_pages"] = eng.page_pool.num_pages - eng.page_pool.num_free_pages
    return stats


def test_soak_thousands_of_requests_with_aborts_faults_and_preemption():
    torch.backends.cuda.matmul.allow_tf32 = False
    stats = soak("cuda", int(os.environ.get("CHUNKWISE_SOAK_REQUESTS", "2000")))
    print("\nsoak:", stats)
    assert stats["preemptions"] > 0 and stats["faults"] > 0 and stats["aborts"] > 0, stats
