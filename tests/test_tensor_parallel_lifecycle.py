"""A tensor-parallel engine's worker processes (CPU, gloo): stopped by close(), a `with` block, garbage collection
and interpreter exit, with no orphans; a worker that dies or fails, or rank 0 failing inside a step, raises a
clear TensorParallelError within seconds instead of hanging, and the engine then refuses work; a failure outside
the forward (sampling) is contained as on one device; bad tensor_parallel_size values are refused by name.

Each test starts its own engine (one tensor-parallel engine per process at a time). A liveness bound (HANG_S) on
the calls that could hang turns a hang into a failure; it bounds no performance.
"""
from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import chunkwise.reference
from chunkwise.model_config import ModelConfig
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine.distributed.tensor_parallel import CollectiveGuard, TensorParallel
from chunkwise.engine.executor.workers import StepMessage, TensorParallelError

PROMPTS = [[5, 9, 14, 3, 22, 8, 17], [60, 61, 62, 63, 64, 65]]
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
KW = dict(page_size=4, num_pages=32, max_model_len=64, tensor_parallel_size=2)
HANG_S = 60



def worker_pids(eng) -> list[int]:
    return [p.pid for p in eng.executor.workers.procs]


def assert_gone(pids: list[int]) -> None:
    """The processes have exited and been reaped, and this process has no other child left (multiprocessing's
    resource tracker, which lives as long as this process, aside)."""
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"worker processes {alive} are still running"
    others = [c for c in psutil.Process().children(recursive=True)
              if "resource_tracker" not in " ".join(c.cmdline())]
    assert not others, f"child processes left behind: {[(c.pid, c.cmdline()) for c in others]}"


def within(seconds: float, fn):
    """fn()'s result or exception, from a thread given `seconds` to finish: a hang fails the test."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:   # handed to the caller
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the call hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.slow
def test_a_with_block_and_garbage_collection_stop_the_workers(ckpt):
    with Engine(ckpt, **KW) as eng:
        pids = worker_pids(eng)
        eng.generate(PROMPTS[:1], GREEDY)
    assert_gone(pids)
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)
    del eng
    gc.collect()
    assert_gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "KeyboardInterrupt", "SIGKILL"])
def test_interpreter_exit_stops_the_workers(ckpt, ending):
    """A script that leaves its engine open, one interrupted by Ctrl-C and one killed (no finalizer runs: the
    workers see their parent go) leave no worker behind."""
    last = {"return": "", "KeyboardInterrupt": "raise KeyboardInterrupt\n",
            "SIGKILL": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"}[ending]
    script = (f"import json, sys\nfrom chunkwise import Engine\n"
              f"eng = Engine({str(ckpt)!r}, **{KW!r})\n"
              f"print(json.dumps([p.pid for p in eng.executor.workers.procs]), flush=True)\n" + last)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    pids = json.loads(done.stdout.splitlines()[0])
    assert (done.returncode != 0) == (ending != "return"), done.stderr
    deadline = time.monotonic() + 10   # the workers are the script's children: give their exit a moment
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)], f"workers {pids} outlived their script"


def test_a_worker_killed_between_steps_fails_the_next_step_clearly(ckpt):
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)
    eng.add_request(PROMPTS[0], GREEDY)
    eng.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pids[0]}\) died with exit code -9"):
        within(HANG_S, eng.step)
    assert_gone(pids)
    with pytest.raises(RuntimeError, match="this Engine is closed .*rank 1"):
        eng.generate(PROMPTS, GREEDY)


def test_a_worker_dying_inside_a_step_fails_it_without_a_hang(ckpt):
    """The worker dies while rank 0 is inside the step's forward (its collectives wait for the dead peer)."""
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)
    forward, calls = eng.executor.runner.forward, []

    def forward_after_the_kill(host):
        calls.append(1)
        if len(calls) == 2:
            os.kill(pids[0], signal.SIGKILL)
        return forward(host)
    eng.executor.runner.forward = forward_after_the_kill
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pids[0]}\) died with exit code -9"):
        within(HANG_S, lambda: eng.generate(PROMPTS, GREEDY))
    assert len(calls) == 2
    assert_gone(pids)
    assert not eng.has_unfinished()


def test_no_collective_is_issued_after_the_watchers_abort():
    """Rank 0's watcher aborts NCCL when a worker dies; a collective issued after that would wait for the dead
    rank. The abort waits for a collective being enqueued, and every later one raises instead of reaching the
    process group (none is initialised here: reaching it would raise another error)."""
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8))
    guard = CollectiveGuard()
    tp = TensorParallel(0, 2, cfg, torch.device("cpu"), guard=guard)
    events = []

    def enqueueing():
        with guard.issuing():
            events.append("enqueue starts")
            time.sleep(0.3)
            events.append("enqueue ends")
    t = threading.Thread(target=enqueueing)
    t.start()
    while not events:
        time.sleep(0.01)
    guard.stop("a worker died", lambda: events.append("abort"), wait_s=10)   # far past the 0.3 s enqueue
    t.join()
    assert events == ["enqueue starts", "enqueue ends", "abort"]
    for collective in (lambda: tp.all_reduce(torch.ones(2)), lambda: tp.all_gather(torch.ones(2)), lambda: tp.min(3),
                       lambda: tp.argmax_logits(torch.ones(2, 32))):
        with pytest.raises(RuntimeError, match="no collective is issued once a worker died"):
            collective()


def test_a_collective_stuck_enqueueing_does_not_keep_the_abort_waiting():
    guard = CollectiveGuard()
    inside, release = threading.Event(), threading.Event()

    def stuck():
        with guard.issuing():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=stuck)
    t.start()
    inside.wait(10)
    aborted = []
    start = time.perf_counter()
    guard.stop("a worker died", lambda: aborted.append(time.perf_counter() - start), wait_s=0.2)
    release.set()
    t.join()
    assert aborted and 0.15 < aborted[0] < 5, aborted   # after its wait, not after the stuck call


@pytest.mark.slow
def test_a_worker_error_is_raised_on_rank_0_with_its_traceback(ckpt):
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)
    eng.executor.workers.conns[0].send_bytes(pickle.dumps(StepMessage(None)))   # a step the worker cannot run
    with pytest.raises(TensorParallelError, match=r"(?s)rank 1 .* failed: AttributeError: .*Traceback.*run_host"):
        within(HANG_S, lambda: eng.generate(PROMPTS, GREEDY))
    assert_gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [RuntimeError("injected fault"), KeyboardInterrupt()])
def test_rank_0_failing_inside_a_step_stops_the_workers(ckpt, fault):
    """Once a step is sent, the workers wait in collectives rank 0 will not join: they are stopped, and the
    engine closes (an Exception arrives as TensorParallelError, KeyboardInterrupt as itself)."""
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)

    def failing_forward(host):
        raise fault
    eng.executor.runner.forward = failing_forward
    error = TensorParallelError if isinstance(fault, Exception) else KeyboardInterrupt
    with pytest.raises(error):
        within(HANG_S, lambda: eng.generate(PROMPTS, GREEDY))
    assert_gone(pids)
    with pytest.raises(RuntimeError, match=f"this Engine is closed .*rank 0 raised {type(fault).__name__}"):
        eng.generate(PROMPTS, GREEDY)


def test_a_sampling_failure_is_contained_and_close_stops_every_worker(ckpt):
    """Sampling runs on rank 0 after every rank's forward: its failure ends the step's requests with the error,
    and the engine, workers included, goes on. close() then stops the workers, and the engine refuses work."""
    want = [o.token_ids for o in chunkwise.reference.Engine(ckpt, max_model_len=64).generate(PROMPTS, GREEDY)]
    eng = Engine(ckpt, **KW)
    pids = worker_pids(eng)
    assert all(psutil.pid_exists(p) for p in pids)
    with pytest.raises(RuntimeError, match="torch.distributed is already initialised"):
        Engine(ckpt, **KW)   # a second one at a time: refused before it starts anything
    sample, calls = eng.executor.sampler.sample, []

    def failing_second_sample(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault in sample")
        return sample(*args)
    eng.executor.sampler.sample = failing_second_sample
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("injected fault in sample" in o.error for o in outs)
    eng.executor.sampler.sample = sample
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want
    eng.close()
    assert_gone(pids)
    with pytest.raises(RuntimeError, match=r"this Engine is closed \(close\(\) was called\)"):
        eng.generate(PROMPTS, GREEDY)
    eng.close()   # twice: harmless


def test_a_preparation_failure_is_contained_and_leaves_every_rank_the_same_page_table_rows(ckpt):
    """A step that fails in preparation, after rank 0's page tables took its page changes, is contained; the
    workers take those changes too, so the next requests' rows (rank 0 hands the workers its row numbers) name
    the same pages on every rank, and the tokens are the reference's."""
    want = [o.token_ids for o in chunkwise.reference.Engine(ckpt, max_model_len=64).generate(PROMPTS, GREEDY)]
    eng = Engine(ckpt, **KW)
    runner = eng.executor.runner
    cascade = runner._cascade

    def failing_once(*args):
        runner._cascade = cascade
        raise RuntimeError("injected fault in prepare")
    runner._cascade = failing_once
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want
    eng.close()


def test_a_single_device_engine_closes_too(ckpt):
    eng = Engine(ckpt, page_size=4, num_pages=8, max_model_len=64)
    with eng:
        assert eng.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "length"
    assert not eng.executor.runner.kv.layers, "close() kept the KV cache"
    with pytest.raises(RuntimeError, match=r"this Engine is closed \(close\(\) was called\)"):
        eng.add_request(PROMPTS[0], GREEDY)


def write_config(tmp_path, **overrides):
    """A checkpoint directory holding only config.json (opening the engine config reads no weights)."""
    from transformers import AutoConfig

    from chunkwise.checkpoints import tiny_config_dict
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(AutoConfig.for_model("llama", **tiny_config_dict("llama", **overrides))
                                   .to_json_string())
    return d


@pytest.mark.parametrize("size, overrides, match", [
    (0, {}, "tensor_parallel_size must be an integer >= 1, got 0"),
    (-2, {}, "tensor_parallel_size must be an integer >= 1, got -2"),
    (2.0, {}, "tensor_parallel_size must be an integer >= 1, got 2.0"),
    ("2", {}, "tensor_parallel_size must be an integer >= 1, got '2'"),
    (True, {}, "tensor_parallel_size must be an integer >= 1, got True"),
    (3, {}, "tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
    (2, dict(intermediate_size=129), "tensor_parallel_size=2 does not divide the model's intermediate_size=129"),
    (2, dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96),
     "tensor_parallel_size=2 and the model's num_key_value_heads=3: one must divide the other"),
])
def test_bad_tensor_parallel_size_is_refused_by_name(tmp_path, size, overrides, match):
    path = write_config(tmp_path, **overrides)
    for engine in (Engine, chunkwise.reference.Engine):
        with pytest.raises(ValueError, match=match):
            engine(path, tensor_parallel_size=size)


def test_deterministic_mode_is_refused_past_two_ranks(tmp_path):
    path = write_config(tmp_path, num_attention_heads=8, num_key_value_heads=4)
    with pytest.raises(ValueError, match="deterministic=True supports tensor_parallel_size up to 2, got 4"):
        Engine(path, tensor_parallel_size=4, deterministic=True)

