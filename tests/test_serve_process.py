"""The server with its engine in a process of its own (engine_core.py, `chunkwise serve`'s default), over real HTTP
on 127.0.0.1: concurrent clients, streamed or not, sampled or greedy, with logprobs, get the outputs of an engine
of this process built alike; chunks register, compose and unpin across the process boundary; the engine's own
validation errors come back as 400s; a client that disconnects mid-stream leaves no page behind in the engine
process; an engine process that dies fails its requests (500), after which the server answers 503; an engine that
cannot be built is reported with its own error; and a stopped server's engine process exits with status 0.

test_serve.py covers the app itself (every field, error and metric) over an engine on a thread; the app reads the
same interface from both.
"""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_http_overhead import MODEL as FAKE_MODEL, FakeEngine
from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.serve.cli import serving
from chunkwise.engine.core import CoreOutput
from chunkwise.serve.engine_core import EngineCore, EngineStartError, settled_heap
from chunkwise.serve.messages import Outputs
from chunkwise.serve.streams import Submission

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-bytes"
KW = {"dtype": "float32", "device": "cpu", "page_size": 4, "num_pages": 64, "max_model_len": 128}
LONG = 120   # max_tokens of a request meant to be cut short (max_model_len 128)


@pytest.fixture(scope="module")
def core(tiny_ckpt_with_byte_tokenizer):
    core = EngineCore(tiny_ckpt_with_byte_tokenizer, KW)
    core.start()
    return core


@pytest.fixture(scope="module")
def server(core):
    with serving(core, MODEL) as srv:
        yield srv
    assert core._process.exitcode == 0   # stopped, not killed


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(tiny_ckpt_with_byte_tokenizer):
    """An engine of this process built as the server's: the expected outputs."""
    with Engine(tiny_ckpt_with_byte_tokenizer, **KW) as engine:
        yield engine


def gauges(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels
            and "finished_reason" not in s.labels}


def wait_idle(server, seconds: float = 20.0) -> None:
    """Until the engine process reports no request running or waiting and no page held."""
    deadline = time.monotonic() + seconds
    while True:
        g = gauges(server)
        if (g["chunkwise_kv_pages_used"], g["chunkwise_num_requests_running"], g["chunkwise_num_requests_waiting"]) \
                == (0, 0, 0):
            return
        assert time.monotonic() < deadline, g
        time.sleep(0.05)


def test_concurrent_clients_get_the_outputs_of_an_engine_of_this_process(server, client, local):
    prompts = [[5 + i, 6, 7 + 2 * i, 40 + i] for i in range(8)]
    params = [dict(temperature=0, max_tokens=6 + i % 3) if i % 2 else
              dict(temperature=0.9, top_p=0.8, seed=100 + i, n=2, max_tokens=5) for i in range(8)]

    def ask(i):
        p = dict(params[i])
        if i % 4 == 3:   # streamed, with logprobs
            stream = client.completions.create(model=MODEL, prompt=prompts[i], stream=True, logprobs=2, **p)
            text, logprobs = "", []
            for event in stream:
                c = event.choices[0]
                text += c.text
                if c.logprobs is not None:
                    logprobs += c.logprobs.token_logprobs
            return [(text, logprobs)]
        r = client.completions.create(model=MODEL, prompt=prompts[i], **p)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        n = p.pop("n", 1)
        if i % 4 == 3:
            out = local.generate([prompt], SamplingParams(**p, logprobs=2))[0]
            assert got[i][0][0] == out.text
            assert got[i][0][1] == pytest.approx([lp[t] for t, lp in zip(out.token_ids, out.logprobs)], abs=1e-5)
        else:
            seeds = [p.get("seed", 0) + j for j in range(n)] if "seed" in p else [None]
            want = [local.generate([prompt], SamplingParams(**{**p, **({"seed": s} if s is not None else {})}))[0].text
                    for s in seeds]
            assert got[i] == want, i
    wait_idle(server)
    g = gauges(server)
    assert g["chunkwise_generation_tokens_total"] >= sum(p["max_tokens"] for p in params)
    assert g["chunkwise_kv_pages_total"] == 64


def test_chunks_register_compose_and_unpin_across_the_process(server, client, local):
    sys_ids, doc = [7, 8, 9, 10, 11, 12, 13, 14], "the document"
    cards = [httpx.post(server.url + "/v1/chunks", json={"model": MODEL, "prompt": p, "pin": pin}).json()
             for p, pin in ((sys_ids, True), (doc, False))]
    assert [c["pinned"] for c in cards] == [True, False]
    r = client.completions.create(model=MODEL, prompt="", max_tokens=6, temperature=0, extra_body={"chunkwise": {
        "prompt": [{"chunk": cards[0]["id"]}, {"chunk": cards[1]["id"]}, [20, 21]]}})
    ids = sys_ids + local.tokenizer.encode(doc, add_special_tokens=False) + [20, 21]
    assert r.choices[0].text == local.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert r.usage.prompt_tokens == len(ids)
    assert httpx.delete(f"{server.url}/v1/chunks/{cards[0]['id']}").status_code == 200
    again = httpx.delete(f"{server.url}/v1/chunks/{cards[0]['id']}")
    assert again.status_code == 400 and "not pinned" in again.json()["error"]["message"]
    assert httpx.delete(f"{server.url}/v1/chunks/chunk-99").status_code == 404


def test_the_engines_own_validation_errors_come_back_as_400s(server, client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=list(range(5, 140)), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="200000"):
        client.completions.create(model=MODEL, prompt=[5, 200000], max_tokens=4)
    ok = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 2   # and it goes on serving


def test_a_disconnect_mid_stream_frees_its_pages_in_the_engine_process(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    assert events == 3
    wait_idle(server)


def test_an_engine_process_that_dies_fails_its_requests_then_the_server_answers_503(tiny_ckpt_with_byte_tokenizer):
    core = EngineCore(tiny_ckpt_with_byte_tokenizer, KW)
    core.start()
    with serving(core, MODEL) as srv:
        events = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        core._process.kill()
        assert events[-1] == "[DONE]" and "exited unexpectedly" in events[-2], events[-2:]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "exited unexpectedly" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2})
        assert r.status_code == 503


@contextmanager
def receiving_loop(core):
    """An event loop on a thread of its own (a server's, without the server) that receives `core`'s messages."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        async def attach():
            core.attach(asyncio.get_running_loop())
        asyncio.run_coroutine_threadsafe(attach(), loop).result(10)
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_stopping_while_an_event_loop_still_receives_takes_the_pipe_from_it(tiny_ckpt_with_byte_tokenizer):
    # a server whose loop ended without detaching would otherwise leave two readers on one pipe
    core = EngineCore(tiny_ckpt_with_byte_tokenizer, KW)
    core.start()
    with receiving_loop(core) as loop:
        outs = asyncio.Queue()
        sub = Submission([[5, 6, 7]], [SamplingParams(max_tokens=LONG, ignore_eos=True)], outs, loop,
                         time.monotonic())
        rids = core.submit(sub).result(60)   # answered by the loop's reader
        handled_on = []
        handle = core._handle
        core._handle = lambda message: (handled_on.append(threading.current_thread()), handle(message))
        core.stop()
        assert core._loop is None and core._process.exitcode == 0
        assert handled_on and set(handled_on) == {threading.current_thread()}   # the loop read none of them
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)   # after the outputs' routing
        finished = []
        while not outs.empty():
            _, out = outs.get_nowait()
            finished += [out.finish_reason] if out.finished else []
        assert finished == ["abort"], (rids, finished)


def test_the_engine_process_sends_token_ids_only_and_the_servers_streams_carry_text(tiny_ckpt_with_byte_tokenizer,
                                                                                      local):
    core = EngineCore(tiny_ckpt_with_byte_tokenizer, KW)
    core.start()
    received = []
    handle = core._handle
    core._handle = lambda message: (received.append(message), handle(message))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        with receiving_loop(core) as loop:
            outs = asyncio.Queue()
            core.submit(Submission([[5, 6, 7]], [params], outs, loop, time.monotonic())).result(60)
            streamed = []
            while not streamed or not streamed[-1].finished:
                streamed.append(asyncio.run_coroutine_threadsafe(outs.get(), loop).result(60)[1])
    finally:
        core.stop()
    sent = [o for m in received if isinstance(m, Outputs) for o in m.outputs]
    assert sent and all(type(o) is CoreOutput for o in sent), {type(o).__name__ for o in sent}
    assert sent[-1].output.text == "" and not any(hasattr(o, "new_text") for o in sent)
    want = local.generate([[5, 6, 7]], params)[0]
    assert want.text and "".join(o.new_text for o in streamed) == streamed[-1].output.text == want.text
    assert [t for o in streamed for t in o.new_token_ids] == want.token_ids


def test_a_large_submission_while_the_engine_waits_for_the_server_to_read_does_not_deadlock():
    # the engine process blocks sending outputs the event loop has not read (the loop was busy); the loop, which
    # alone reads them, must not then block sending a submission larger than the pipe holds
    core = EngineCore(FAKE_MODEL, {"step_s": 0.0005}, engine_class=FakeEngine)
    core.start()
    with receiving_loop(core) as loop:
        def submit(prompts, logprobs=None):
            sub = Submission(prompts, [SamplingParams(max_tokens=10 ** 6, ignore_eos=True, logprobs=logprobs)]
                             * len(prompts), asyncio.Queue(), loop, time.monotonic())
            return core.submit(sub)

        async def flood_then_submit_big():
            flood = submit([[5 + i] for i in range(32)], logprobs=20)   # outputs of several kB a step
            time.sleep(1.0)   # the loop busy: the engine process fills the pipe with outputs and blocks
            return flood, submit([[7] * 2_000_000])   # megabytes to send
        try:
            flood, big = asyncio.run_coroutine_threadsafe(flood_then_submit_big(), loop).result(30)
            assert len(flood.result(30)) == 32 and len(big.result(30)) == 1
        except BaseException:
            core._process.kill()   # a deadlocked pipe: its ends freed, so that the test fails rather than hangs
            raise
        finally:
            core.stop()
    assert core._process.exitcode == 0


def test_a_serving_process_runs_on_a_settled_heap_and_ends_with_it_unfrozen():
    built = []   # a container the collector tracks, alive when the heap settles
    with settled_heap():
        assert not any(o is built for o in gc.get_objects())   # frozen: no collection passes over it
    assert any(o is built for o in gc.get_objects()) and gc.get_freeze_count() == 0


def test_an_engine_that_cannot_be_built_is_reported_with_its_own_error(tmp_path):
    core = EngineCore(tmp_path, {"device": "cpu"})
    with pytest.raises(EngineStartError, match=f"^ValueError: checkpoint directory {tmp_path} has no config.json"):
        core.start()
    assert core._process.exitcode == 0
    # the command line: the engine's error in one line, as with the engine on a thread
    proc = subprocess.run([sys.executable, "-m", "chunkwise", "serve", "--model", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m chunkwise serve: error: ValueError: checkpoint directory {tmp_path} has no config.json"]
