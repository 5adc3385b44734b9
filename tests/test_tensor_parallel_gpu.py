"""Tensor parallelism on two GPUs (NCCL, CUDA graphs on): the strict float32 tier against one GPU and the reference,
the real checkpoints against one GPU, the bf16 tier against the reference (also with vLLM's FA3 for prefill where
it runs), deterministic mode bitwise on two ranks,
the custom all-reduce bitwise against NCCL, and a worker killed inside a graph-replayed decode step, which must
fail the step instead of hanging NCCL or the custom all-reduce.
Skipped without two CUDA devices.

    PYTHONPATH=$PWD python -m pytest tests/test_tensor_parallel_gpu.py -v -s
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from logprobs_close import MIN_AGREED_SHARE, TOP_K, check_logprobs_close
from parity_report import assert_same_tokens, kv_mismatch
from test_tensor_parallel import MODELS, with_random_biases
from test_tensor_parallel_lifecycle import assert_gone, within

import chunkwise.reference
from chunkwise.checkpoints import resolve_model, tiny_checkpoint
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.executor.workers import StepMessage, TensorParallelError

pytestmark = [pytest.mark.gpu, pytest.mark.correctness,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
# The strict tier is float32 end to end (the workers take rank 0's setting).
torch.backends.cuda.matmul.allow_tf32 = False

QWEN3_0_6B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.02)
GPU_MODELS = {**MODELS, "qwen3-0.6b-shape": ("qwen3", QWEN3_0_6B_SHAPE)}
KW = dict(page_size=16, max_model_len=512, num_pages=256, max_num_seqs=16)
NEW_TOKENS = 16


def checkpoint(name: str, tmp_path_factory):
    family, overrides = GPU_MODELS[name]
    ckpt = tiny_checkpoint(family, seed=0, **overrides)
    if name in ("mha", "gqa"):   # transformers' zero biases would hide a bias bug
        ckpt = with_random_biases(ckpt, tmp_path_factory.mktemp("biased") / ckpt.name)
    return ckpt


def workload(name: str):
    vocab = GPU_MODELS[name][1].get("vocab_size", 384)
    big = name == "qwen3-0.6b-shape"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in ([1, 17, 64, 200] if big else
                                                                                 [1, 5, 17, 40])]
    chunks = [None, [3, 14], 16, [100, 1, 99]] if big else [None, [2, 3], 4, [16, 1, 23]]
    return prompts, chunks


@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_float32_tokens_and_kv_equal_one_gpu_and_the_reference(name, tmp_path_factory):
    ckpt = checkpoint(name, tmp_path_factory)
    prompts, chunks = workload(name)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with Engine(ckpt, dtype="float32", tensor_parallel_size=2, **KW) as tp:
        graphs = tp.executor.runner.graphs
        replays, replay = [], graphs.replay
        graphs.replay = lambda host, *args: replays.append(len(host.rows)) or replay(host, *args)
        got = [o.token_ids for o in tp.generate(prompts, params, chunk_sizes=chunks)]
        kv = tp.prefill_kv(prompts[3], chunk_sizes=chunks[3])
    assert replays, "no decode step replayed a CUDA graph: the NCCL-in-graph path went untested"
    one = Engine(ckpt, dtype="float32", **KW)
    want_one = [o.token_ids for o in one.generate(prompts, params, chunk_sizes=chunks)]
    kv_one = one.prefill_kv(prompts[3], chunk_sizes=chunks[3])
    del one
    ref = chunkwise.reference.Engine(ckpt, dtype="float32", max_model_len=KW["max_model_len"])
    label = f"{name}, float32, tensor_parallel_size=2"
    assert_same_tokens(ref, prompts, got, [o.token_ids for o in ref.generate(prompts, params)], label)
    assert_same_tokens(ref, prompts, got, want_one, label + " against one GPU")
    for kv_name, a, b in zip("KV", kv, kv_one):
        msg = kv_mismatch(a.cpu(), b.cpu(), kv_name)
        assert msg is None, f"{label}: {msg}"


@pytest.mark.realmodel
@pytest.mark.parametrize("name, prompt", [("qwen2.5-coder-0.5b", "def quicksort(arr):"),
                                          ("gemma3-270m", "The three primary colors are")])
def test_real_checkpoint_tokens_equal_one_gpu(name, prompt):
    try:
        ckpt = resolve_model(name)
    except (ImportError, ValueError) as exc:
        pytest.skip(f"{name} is not available here: {exc}")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with Engine(ckpt, dtype="float32", tensor_parallel_size=2, **KW) as tp:
        got = tp.generate([prompt], params, chunk_sizes=[[3, 2]])[0]
    want = Engine(ckpt, dtype="float32", **KW).generate([prompt], params)[0]
    print(f"{name}, two GPUs: {prompt!r} -> {got.text!r}")
    ref = chunkwise.reference.Engine(ckpt, dtype="float32", max_model_len=KW["max_model_len"])
    assert_same_tokens(ref, [got.prompt_token_ids], [got.token_ids], [want.token_ids],
                       f"{name}, float32, tensor_parallel_size=2 against one GPU")


@pytest.mark.parametrize("name", ["gqa", "gemma3", "qwen3-0.6b-shape"])
def test_bf16_tokens_agree_with_the_reference_until_a_near_tie(name, tmp_path_factory):
    """The low-precision tier (tests/test_parity_gpu.py's rule) on two GPUs."""
    ckpt = checkpoint(name, tmp_path_factory)
    prompts, chunks = workload(name)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP_K)
    with Engine(ckpt, dtype="bfloat16", tensor_parallel_size=2, **KW) as tp:
        got = tp.generate(prompts, params, chunk_sizes=chunks)
    ref = chunkwise.reference.Engine(ckpt, dtype="bfloat16", max_model_len=KW["max_model_len"]).generate(prompts, params)
    agreed = [check_logprobs_close(o, r, f"{name} request {i}") for i, (o, r) in enumerate(zip(got, ref))]
    print(f"{name}, bf16, two GPUs: tokens agreed before a divergence, per request: {agreed} of {params.max_tokens}")
    assert sum(agreed) >= MIN_AGREED_SHARE * params.max_tokens * len(prompts), \
        f"{name}: only {agreed} of {params.max_tokens} tokens per request agreed before a divergence"


def test_fa3_prefill_on_two_gpus_agrees_with_the_reference_until_a_near_tie():
    """attention_backend="fa3" on two ranks (each its own query and KV heads): prompts of 600-1500 tokens in steps
    of up to 2048 rows, chunked at odd places, under the low-precision tier's rule. Skipped where FA3 cannot run."""
    from chunkwise.kernels.fa3 import fa3_unavailable
    why = fa3_unavailable(torch.device("cuda", 0), torch.bfloat16, QWEN3_0_6B_SHAPE["head_dim"])
    if why is not None:
        pytest.skip(f"attention_backend='fa3': {why}")
    ckpt = tiny_checkpoint("qwen3", seed=0, **{**QWEN3_0_6B_SHAPE, "num_hidden_layers": 4})
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, QWEN3_0_6B_SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (600, 1500, 900)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    with Engine(ckpt, dtype="bfloat16", tensor_parallel_size=2, max_model_len=2048, num_pages=1024,
                max_num_batched_tokens=2048, attention_backend="fa3") as tp:
        got = tp.generate(prompts, params, chunk_sizes=[None, [700, 1, 799], [513, 387]])
    ref = chunkwise.reference.Engine(ckpt, dtype="bfloat16", max_model_len=2048).generate(prompts, params)
    agreed = [check_logprobs_close(o, r, f"request {i}") for i, (o, r) in enumerate(zip(got, ref))]
    print(f"fa3, bf16, two GPUs: tokens agreed before a divergence, per request: {agreed} of {params.max_tokens}")
    assert sum(agreed) >= MIN_AGREED_SHARE * params.max_tokens * len(prompts), agreed


def test_deterministic_bf16_holds_on_two_gpus():
    """Two ranks sum each element once (the same bits on both ranks and for any message size), so the mode's
    promise holds with NCCL: tokens and K/V bitwise as the prompt alone gives, under preemption and chunking."""
    import test_deterministic_gpu as det
    from deterministic_cases import assert_bitwise, run_case, solo_run

    path = tiny_checkpoint("qwen3")
    prompts = det.prompts_of(det.TINY_LENS, 384)
    kw = dict(dtype="bfloat16", max_model_len=det.TINY_LEN, tensor_parallel_size=2)
    tokens, kv = solo_run(path, prompts, det.TINY_TOKENS, **kw)
    assert_bitwise(run_case(path, prompts, det.TINY_TIGHT, det.TINY_TOKENS, **kw), det.TINY_TIGHT, tokens, kv)


def test_the_custom_all_reduce_gives_nccls_bits_on_two_ranks(tmp_path_factory):
    """Two ranks: the custom all-reduce and NCCL both give round(a + b) for every element, and its fused norm
    keeps add_rms_norm's rounding points, so bf16 tokens and K/V are bitwise those of the NCCL-only path
    (prefill chunks and graph-replayed decodes both fit its buffers here)."""
    ckpt = checkpoint("qwen3-0.6b-shape", tmp_path_factory)
    prompts, chunks = workload("qwen3-0.6b-shape")
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {}
    for custom in (True, False):
        with Engine(ckpt, dtype="bfloat16", tensor_parallel_size=2, custom_all_reduce=custom, **KW) as eng:
            assert (eng.executor.runner.tp.custom is not None) == custom
            assert eng.executor.runner.model.reduce_in_norm == custom
            tokens = [o.token_ids for o in eng.generate(prompts, params, chunk_sizes=chunks)]
            runs[custom] = tokens, eng.prefill_kv(prompts[3], chunk_sizes=chunks[3])
    assert runs[True][0] == runs[False][0], "tokens differ between the custom all-reduce and NCCL"
    for kv_name, a, b in zip("KV", runs[True][1], runs[False][1]):
        assert torch.equal(a, b), f"{kv_name} differs between the custom all-reduce and NCCL"


@pytest.mark.parametrize("custom", [False, True], ids=["nccl", "custom"])
def test_a_worker_killed_inside_a_graph_replayed_decode_fails_the_step_without_a_hang(custom):
    """Rank 0 replays a decode graph whose all-reduce kernels wait for the dead peer; the watcher aborts them
    (NCCL's, and the custom all-reduce's when on), and the step is voided with TensorParallelError, not sampled
    from what the abort left.

    The worker is stopped (SIGSTOP) before rank 0 sends it the step and killed once rank 0 has launched its
    replay, so it never runs that step and is dead before the next: killed after the send instead, it could
    finish its part first (a tiny model's step takes well under a millisecond), and the custom all-reduce, which
    stops only calls still waiting, then completes that step correctly and fails the next (seen on two H200s)."""
    eng = Engine(tiny_checkpoint("qwen3"), dtype="float32", tensor_parallel_size=2, custom_all_reduce=custom, **KW)
    assert (eng.executor.runner.tp.custom is not None) == custom, "the custom all-reduce was asked for and not built"
    worker = eng.executor.workers.procs[0]
    pid = worker.pid
    graphs = eng.executor.runner.graphs
    together, replay, sent, replayed = eng.executor.workers.together, graphs.replay, [], []

    def together_stopping_the_worker(command, fn, wrap=True):
        if isinstance(command, StepMessage):
            sent.append(command)
            if len(sent) == 3:   # a decode step (the first is the prefill)
                os.kill(pid, signal.SIGSTOP)
        return together(command, fn, wrap)

    def replay_then_kill(host, *args):
        replayed.append(len(sent))
        out = replay(host, *args)
        if len(sent) == 3:   # rank 0's replay is launched, its all-reduces waiting for the stopped worker
            os.kill(pid, signal.SIGKILL)
            worker.join(30)
        return out
    eng.executor.workers.together, graphs.replay = together_stopping_the_worker, replay_then_kill
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) died with exit code -9"):
        within(120, lambda: eng.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(sent) == 3 and replayed[-1] == 3, f"steps sent: {len(sent)}; replays in steps {replayed}"
    assert_gone([pid])


@pytest.mark.parametrize("custom", [False, True], ids=["nccl", "custom"])
def test_a_worker_killed_while_rank_0_issues_an_eager_steps_collectives_fails_the_step_without_a_hang(custom):
    """The worker is stopped before it gets the first (eager, prefill) step and killed before rank 0 issues that
    step's last collective (the greedy tokens' gather, which both all-reduce paths reach: with the custom one on,
    the layers' sums go through its norm kernel, not tp.all_reduce); once the watcher has aborted the group, that
    collective must raise (CollectiveGuard) instead of waiting for the dead rank, and the step fails with
    TensorParallelError."""
    eng = Engine(tiny_checkpoint("qwen3"), dtype="float32", tensor_parallel_size=2, custom_all_reduce=custom, **KW)
    worker, guard, tp = eng.executor.workers.procs[0], eng.executor.workers.guard, eng.executor.runner.model.tp
    pid = worker.pid
    together, all_gather = eng.executor.workers.together, tp.all_gather

    def together_stopping_the_worker(command, fn, wrap=True):
        if isinstance(command, StepMessage):
            os.kill(pid, signal.SIGSTOP)
        return together(command, fn, wrap)

    def all_gather_after_the_kill(x):
        os.kill(pid, signal.SIGKILL)
        worker.join(30)
        deadline = time.monotonic() + 30
        while guard.lost is None and time.monotonic() < deadline:   # the watcher's abort
            time.sleep(0.01)
        return all_gather(x)
    eng.executor.workers.together = together_stopping_the_worker
    object.__setattr__(tp, "all_gather", all_gather_after_the_kill)
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) died with exit code -9"):
        within(120, lambda: eng.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True)))
    assert eng.executor.runner.launches == {("mixed", "eager"): 1}, eng.executor.runner.launches
    assert_gone([pid])
