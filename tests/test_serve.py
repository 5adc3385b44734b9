"""The OpenAI-compatible server (`python -m chunkwise serve`), over real HTTP on 127.0.0.1 with the official `openai`
client: its outputs are the engine's own (streamed or not, completions and chat, 32 clients at once, n seeded
samples, logprobs, stop strings and stop ids), a client that disconnects mid-stream leaves no page behind, bad
requests get OpenAI's error object and the server goes on, a request failing inside a step gets a 500 alone, a full
queue a 429, /metrics parses and counts what was served, and SIGTERM aborts in-flight requests and exits cleanly.
Every request field is parsed (strict types, OpenAI's defaults, fields not implemented refused past their no-op
values) and reaches the engine's params; a second, small server serves requests up to its max_model_len.

One server (a tiny Qwen3 with a byte-level tokenizer and a chat template, so outputs have text) serves the whole
module from a thread; expected outputs come from the same engine's `generate`, which may share it with the server.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import example, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.serve.cli import serving
from chunkwise.engine.stop_strings import StopStrings
from served import DirectEngine

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-chat"
GREEDY = {"temperature": 0}
LONG = 500   # max_tokens of a request meant to be cut short: ~a minute of steps on CPU if it ran to the end


@pytest.fixture(scope="module")
def chat_ckpt(tiny_chat_ckpt):
    return tiny_chat_ckpt


@pytest.fixture(scope="module")
def server(chat_ckpt):
    with serving(Engine(chat_ckpt, dtype="float32", device="cpu"), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(server):
    return DirectEngine(server.state.loop)


def expected(engine, prompts, **params) -> list:
    """The engine's own outputs for these prompts (greedy unless params say otherwise)."""
    return engine.generate(prompts, SamplingParams(**{**GREEDY, **params}))


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client, keyed by name and labels other than the model's."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(engine, seconds: float = 10.0) -> None:
    """Until the engine holds no request and every page is free or evictable (the pool whole)."""
    deadline = time.monotonic() + seconds
    while engine.has_unfinished() or engine.page_pool.num_free_pages != engine.page_pool.num_pages:
        assert time.monotonic() < deadline, (f"the engine still holds {len(engine.scheduler.running)} running, "
                                             f"{len(engine.scheduler.waiting)} waiting requests and "
                                             f"{engine.page_pool.num_pages - engine.page_pool.num_free_pages} pages")
        time.sleep(0.02)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_server_keeps_an_idle_connection_longer_than_openais_client_does(server):
    # otherwise a client may reuse a connection just as the server closes it, and get a read error for an answer;
    # the openai client keeps httpx's default
    import httpx
    assert server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry


def test_a_direct_engine_call_under_paused_waits_for_the_servers_request_and_both_keep_their_outputs(server, client):
    """EngineLoop.paused() holds the engine thread once it is idle: a direct `generate` entered while a streamed
    request is in flight waits for it, so neither steps the other's request or takes its outputs."""
    loop, prompt = server.state.loop, [11, 12, 13, 14, 15, 16]
    with loop.paused() as eng:
        want = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))[0]
    stream = iter(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    first = next(stream)   # the engine thread has stepped the request at least once
    with loop.paused() as eng:
        assert not eng.has_unfinished(), "paused() held the engine thread with the server's request in flight"
        direct = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))[0]
    streamed = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    assert direct.token_ids == want.token_ids and streamed == want.text


def test_completions_whole_and_streamed_equal_the_engines_own(engine, client):
    prompt = [5, 6, 7, 8, 9]
    want = expected(engine, [prompt], max_tokens=6, ignore_eos=True)[0]
    assert want.text   # the byte-level tokenizer decodes every id to some text
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True},
                                      **GREEDY)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 6)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **GREEDY))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert len(pieces) == 6, "one event per generated token"
    assert "".join(p.text for p in pieces) == want.text
    assert [p.finish_reason for p in pieces] == [None] * 5 + ["length"]
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_text_prompt_is_encoded_as_the_engine_encodes_it(engine, client):
    want = expected(engine, ["the cat"], max_tokens=4)[0]
    got = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, **GREEDY)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_whole_and_streamed_equal_the_engine_on_the_templated_prompt(engine, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = expected(engine, [ids], max_tokens=5, ignore_eos=True)[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text and whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True,
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_clients_get_the_engines_own_outputs(engine, client):
    """32 clients at once (8 prompts, each asked 4 times, streamed and not) each get exactly what the engine
    gives that prompt."""
    prompts = [[3 + i, 40 + 7 * i, 100 + i, 200 + 3 * i] for i in range(8)]
    want = [o.text for o in expected(engine, prompts, max_tokens=4, ignore_eos=True)]

    def ask(i: int) -> str:
        kw = dict(model=MODEL, prompt=prompts[i % 8], max_tokens=4, extra_body={"ignore_eos": True}, **GREEDY)
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, range(32)))
    assert got == [want[i % 8] for i in range(32)]


def test_disconnect_mid_stream_aborts_the_request_and_leaks_no_page(server, engine, client):
    before = metrics(server)
    stream = client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=LONG, stream=True,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    wait_idle(engine)
    after = metrics(server)
    aborted = "chunkwise_request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 1
    assert after["chunkwise_generation_tokens_total"] - before["chunkwise_generation_tokens_total"] < LONG


def test_a_client_leaving_before_a_whole_answer_aborts_its_request(server, engine):
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.0, json={
            "model": MODEL, "prompt": [14, 15], "max_tokens": LONG, "ignore_eos": True, "temperature": 0})
    wait_idle(engine)
    aborted = "chunkwise_request_success_total{finished_reason=abort}"
    assert metrics(server)[aborted] - before.get(aborted, 0) == 1


@pytest.mark.parametrize("path, body, status, param, says", [
    ("completions", b"{not json", 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "JSON object"),
    ("completions", {"prompt": [5]}, 400, "model", "required"),
    ("completions", {"model": "gpt-4", "prompt": [5]}, 404, "model", "gpt-4"),
    ("completions", {"model": MODEL, "prompt": [5], "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    ("completions", {"model": MODEL, "prompt": [5], "max_tokens": "3"}, 400, "max_tokens", "integer"),
    ("completions", {"model": MODEL, "prompt": [5], "max_tokens": 0}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [5], "temperature": -1}, 400, None, "temperature"),
    ("completions", {"model": MODEL, "prompt": [5], "top_p": 1.5}, 400, None, "top_p"),
    ("completions", {"model": MODEL, "prompt": [5, 100000]}, 400, None, "100000"),
    ("completions", {"model": MODEL, "prompt": [5] * 1020, "max_tokens": 8}, 400, None, "max_model_len"),
    ("completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", "prompt"),
    ("completions", {"model": MODEL, "prompt": [5], "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("completions", {"model": MODEL, "prompt": [5], "echo": True}, 400, "echo", "not supported"),
    ("completions", {"model": MODEL, "prompt": [5], "logprobs": 21}, 400, "logprobs", "21"),
    ("completions", {"model": MODEL, "prompt": [5], "n": 0}, 400, "n", "n"),
    ("completions", {"model": MODEL, "prompt": [5], "stop": [""]}, 400, "stop", "empty"),
    ("completions", {"model": MODEL, "prompt": [5], "stop_token_ids": [384]}, 400, None, "384"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "empty"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, None,
     "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "robot"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400,
     "tools", "not supported"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, path, body, status, param, says):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param or (param is not None and err["param"].startswith(param)), err
    assert says is None or says in err["message"], err
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=1).choices[0].finish_reason


def test_chat_without_a_template_is_a_400_naming_the_model(engine, client, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert MODEL in error_of(e.value)["message"] and "chat template" in error_of(e.value)["message"]


def test_stop_strings_cut_the_text_there_and_abort_the_request(server, engine, client, monkeypatch):
    prompt = [21, 22, 23]
    want = expected(engine, [prompt], max_tokens=12, ignore_eos=True)[0]
    # a two-character stop string first found at k >= 2 (so some text comes before it)
    k = next(k for k in range(2, len(want.text) - 1) if want.text.find(want.text[k:k + 2]) == k)
    stop = want.text[k:k + 2]
    before = metrics(server)
    aborts = []   # what the engine's core ended through an abort
    abort = engine.core.abort
    monkeypatch.setattr(engine.core, "abort", lambda rid: aborts.append(abort(rid)) or aborts[-1])
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop, "\x00never"], extra_body={"ignore_eos": True},
              **GREEDY)
    whole = client.completions.create(**kw)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want.text[:k], "stop")
    pieces = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(p.text for p in pieces) == want.text[:k] and pieces[-1].finish_reason == "stop"
    wait_idle(engine)
    after = metrics(server)
    assert [a is not None and len(a.output.token_ids) < 12 for a in aborts] == [True, True], \
        "the engine still ran the stopped requests"
    stopped = "chunkwise_request_success_total{finished_reason=stop}"
    assert after[stopped] - before.get(stopped, 0) == 2   # a stop string's finish, as vLLM counts it
    # stop token ids: the engine's own stop
    stop_id = want.token_ids[3]
    first = want.token_ids.index(stop_id)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body={"stop_token_ids": [stop_id],
                                    "ignore_eos": True}, **GREEDY)
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == first + 1


def test_n_seeded_samples_are_the_engines_samples_with_seed_plus_index(engine, client):
    prompt = [31, 32, 33, 34]
    want = [expected(engine, [prompt], max_tokens=5, temperature=1.0, seed=7 + i, ignore_eos=True)[0].text
            for i in range(3)]
    assert len(set(want)) > 1
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=3, seed=7, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert got.usage.completion_tokens == 15 and got.usage.prompt_tokens == 4


def test_logprobs_are_the_engines_for_completions_and_chat(engine, client):
    prompt = [41, 42, 43]
    want = expected(engine, [prompt], max_tokens=3, logprobs=2, ignore_eos=True)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2,
                                    extra_body={"ignore_eos": True}, **GREEDY).choices[0].logprobs
    assert got.tokens == [engine.tokenizer.decode([t]) for t in want.token_ids]
    assert got.token_logprobs == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert all(len(top) <= 2 for top in got.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= -1e30 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)   # greedy took the top one


def test_logprobs_up_to_the_servers_max_are_served_and_one_more_refused(server, engine, client):
    """logprobs (completions) and top_logprobs (chat) equal to --max-logprobs are served, the engine's top that
    many per token; one more is a 400 naming the field."""
    most = server.state.max_logprobs
    want = expected(engine, [[44, 45]], max_tokens=2, logprobs=most, ignore_eos=True)[0]
    # completions key the top entries by token text, so byte tokens decoding alike share one key
    tops = [{engine.tokenizer.decode([u]) for u, _ in sorted(lps.items(), key=lambda kv: -kv[1])[:most]}
            for lps in want.logprobs]
    assert all(len(lps) >= most for lps in want.logprobs)
    got = client.completions.create(model=MODEL, prompt=[44, 45], max_tokens=2, logprobs=most,
                                    extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert got.finish_reason == "length" and [set(top) for top in got.logprobs.top_logprobs] == tops
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=most, extra_body={"ignore_eos": True},
                                          **GREEDY).choices[0]
    assert chat.finish_reason == "length" and [len(c.top_logprobs) for c in chat.logprobs.content] == [most, most]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[44, 45], max_tokens=2, logprobs=most + 1)
    assert error_of(e.value)["param"] == "logprobs" and str(most + 1) in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=most + 1)
    assert error_of(e.value)["param"] == "top_logprobs" and str(most + 1) in error_of(e.value)["message"]


def test_a_refused_sample_leaves_none_of_its_requests_samples_queued(server, engine):
    """A batched prompt whose second prompt the engine refuses (prompt + max_tokens over max_model_len): a 400
    naming the limit, and the first prompt's sample, added before the refusal, is not left running unseen."""
    wait_idle(engine)
    fits = [5, 6]
    too_long = [7] * (engine.max_model_len - LONG + 1)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [fits, too_long], "max_tokens": LONG, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    # the engine thread takes the whole submission back before answering, so nothing may be queued by now
    assert not engine.has_unfinished(), (f"{len(engine.scheduler.waiting)} waiting and "
                                         f"{len(engine.scheduler.running)} running requests left by a refused request")
    wait_idle(engine)


def test_a_request_failing_inside_a_step_gets_500_alone(engine, client, monkeypatch):
    poison = 377
    execute = engine.executor.execute

    def failing(batch):
        if any(s.prompt_token_ids[0] == poison for s in batch.seqs):
            raise RuntimeError("injected fault")
        return execute(batch)
    monkeypatch.setattr(engine.executor, "execute", failing)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=[poison, 5], max_tokens=3)
    assert "injected fault" in error_of(e.value)["message"]
    with pytest.raises(openai.APIError, match="injected fault"):
        list(client.completions.create(model=MODEL, prompt=[poison, 6], max_tokens=3, stream=True))
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).usage.completion_tokens >= 1
    wait_idle(engine)


def test_a_full_waiting_queue_answers_429(server, client):
    limit = server.state.max_waiting
    server.state.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=[5], max_tokens=1)
        assert "queue" in error_of(e.value)["message"]
    finally:
        server.state.max_waiting = limit
    assert client.completions.create(model=MODEL, prompt=[5], max_tokens=1).choices


def test_metrics_parse_and_count_what_was_served(server, engine, client):
    wait_idle(engine)
    before = metrics(server)
    client.completions.create(model=MODEL, prompt=[51, 52, 53, 54, 55], max_tokens=4, extra_body={"ignore_eos": True},
                              **GREEDY)
    after = metrics(server)

    def delta(name):
        return after[name] - before.get(name, 0)
    assert delta("chunkwise_prompt_tokens_total") == 5 and delta("chunkwise_generation_tokens_total") == 4
    assert delta("chunkwise_time_to_first_token_seconds_count") == 1
    assert delta("chunkwise_inter_token_latency_seconds_count") == 3
    assert delta("chunkwise_request_success_total{finished_reason=length}") == 1
    # one request's first-token time plus its gaps is its whole latency
    assert delta("chunkwise_time_to_first_token_seconds_sum") + delta("chunkwise_inter_token_latency_seconds_sum") \
        == pytest.approx(delta("chunkwise_e2e_request_latency_seconds_sum"), abs=1e-6)
    assert after["chunkwise_num_requests_waiting"] == after["chunkwise_num_requests_running"] == 0
    assert after["chunkwise_kv_pages_used"] == 0 and after["chunkwise_kv_pages_total"] == engine.page_pool.num_pages


def test_sigterm_aborts_in_flight_requests_and_exits_cleanly():
    """The command line from the README: serve tiny-qwen3, stream a long request, SIGTERM: the stream ends with
    finish_reason "abort" and [DONE], and the process exits with status 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "chunkwise", "serve", "--model", "tiny-qwen3", "--port", "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"running on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it runs"
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny-qwen3", "prompt": [5, 6, 7], "max_tokens": LONG, "stream": True, "ignore_eos": True,
                "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort" and len(events) < LONG
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@settings(max_examples=300)   # microseconds each
@example(text="xabcd", cuts=[], stops=["abcd", "c"])   # "c" completes first, though "abcd" starts earlier
@example(text="aab", cuts=[1, 2], stops=["ab"])          # a held "a" is sent once the next "a" shows it was not one
@given(text=st.text(alphabet="abcx", max_size=24), cuts=st.lists(st.integers(0, 24), max_size=8),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_end_the_text_where_the_first_one_completes_whatever_the_pieces(text, cuts, stops):
    """The text sent is the text before the stop string that completes first (or all of it), however the text was
    cut into pieces; as what is sent only grows, no piece ever held part of the stop string."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    watcher, sent, stopped = StopStrings(stops), "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, stopped = watcher.push(text[a:b])
        sent += piece
        if stopped:
            break
    if stopped:
        assert watcher.push("abc") == ("", True), "text after the stop string was sent"
    else:
        sent += watcher.flush()
    assert stopped == bool(ends)
    assert sent == (text[:min(ends)[1]] if ends else text)


def test_serve_command_refuses_a_bad_engine_option_in_one_line(capsys):
    from chunkwise.__main__ import main

    assert main(["serve", "--model", "tiny-qwen3", "--page-size", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "page_size" in err and "0" in err


@pytest.mark.parametrize("top_k,want", [(-1, 0), (0, 0), (1, 1), (7, 7)])
def test_top_k_minus_one_and_zero_keep_every_token(top_k, want):
    """vLLM's -1 ("every token") is accepted like 0; anything below is the engine's error naming top_k."""
    from chunkwise.serve.protocol import CompletionRequest, parse
    req = parse(CompletionRequest, {"model": "m", "prompt": [1, 2], "top_k": top_k})
    assert req.sampling_params(4, None, 0).top_k == want


def test_top_k_below_minus_one_is_refused_naming_it():
    from chunkwise.serve.protocol import CompletionRequest, parse
    req = parse(CompletionRequest, {"model": "m", "prompt": [1, 2], "top_k": -2})
    with pytest.raises(ValueError, match="top_k"):
        req.sampling_params(4, None, 0)


# ---- every request field, parsed and mapped without a server (microseconds each) ------------------------------

def completion(**fields):
    from chunkwise.serve.protocol import CompletionRequest, parse
    return parse(CompletionRequest, {"model": MODEL, "prompt": [5, 6], **fields})


def chat_request(**fields):
    from chunkwise.serve.protocol import ChatCompletionRequest, parse
    return parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("make", [completion, chat_request])
def test_each_sampling_field_reaches_the_engines_params_and_defaults_are_openais(make):
    """Unset, a request samples at temperature 1 with every token kept (OpenAI's defaults), no seed, no stop ids;
    set, each field is the engine's value, and the index-th of n seeded samples draws from seed + index."""
    default = make().sampling_params(7, None, 0)
    assert default == SamplingParams(max_tokens=7, temperature=1.0, top_k=0, top_p=1.0, seed=None, logprobs=None,
                                     ignore_eos=False, stop_token_ids=())
    req = make(temperature=0.3, top_p=0.75, top_k=5, seed=11, stop_token_ids=[9, 4], ignore_eos=True, n=3)
    for index in range(3):
        assert req.sampling_params(2, 4, index) == SamplingParams(
            max_tokens=2, temperature=0.3, top_k=5, top_p=0.75, seed=11 + index, logprobs=4, ignore_eos=True,
            stop_token_ids=(9, 4))
    assert make(seed=0).sampling_params(1, None, 2).seed == 2    # a seed of 0 is a seed


def refusal(make, fields) -> tuple[str | None, str]:
    """(param, message) of the 400 refusing these fields, or (None, "") when the request is accepted."""
    from chunkwise.serve.protocol import APIError
    try:
        req = make(**fields)
        req.refuse_unsupported()
        req.stop_strings()
    except APIError as e:
        assert e.status == 400, e.status
        return e.param, e.message
    return None, ""


@pytest.mark.parametrize("make,accepted,refused,param", [
    (completion, {"frequency_penalty": 0}, {"frequency_penalty": 0.5}, "frequency_penalty"),
    (completion, {"frequency_penalty": 0.0}, {"frequency_penalty": -0.1}, "frequency_penalty"),
    (completion, {"presence_penalty": 0}, {"presence_penalty": 1.5}, "presence_penalty"),
    (chat_request, {"presence_penalty": None}, {"presence_penalty": 0.1}, "presence_penalty"),
    (completion, {"logit_bias": {}}, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (completion, {"n": 1}, {"n": 0}, "n"),
    (chat_request, {"n": 2}, {"n": -1}, "n"),
    (completion, {"stream": True, "stream_options": {"include_usage": True}},
     {"stream_options": {"include_usage": True}}, "stream_options"),
    (completion, {"echo": False}, {"echo": True}, "echo"),
    (completion, {"suffix": ""}, {"suffix": "tail"}, "suffix"),
    (completion, {"best_of": 2, "n": 2}, {"best_of": 3, "n": 2}, "best_of"),
    (completion, {"best_of": None}, {"best_of": 2}, "best_of"),
    (completion, {"stop": "ab"}, {"stop": ""}, "stop"),
    (completion, {"stop": ["a", "b"]}, {"stop": ["a", ""]}, "stop"),
    (completion, {"stop": None}, {"stop": [1]}, "stop"),
    (chat_request, {"stop": ["x"]}, {"stop": {"x": 1}}, "stop"),
    (chat_request, {"tools": None}, {"tools": []}, "tools"),
    (chat_request, {"tool_choice": None}, {"tool_choice": "auto"}, "tool_choice"),
    (chat_request, {"response_format": None}, {"response_format": {"type": "json_object"}}, "response_format"),
    (chat_request, {"logprobs": True, "top_logprobs": 2}, {"top_logprobs": 2}, "top_logprobs"),
    (chat_request, {"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 3},
     "max_completion_tokens"),
    (chat_request, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     {"messages": []}, "messages"),
])
def test_openai_fields_are_accepted_at_what_is_implemented_and_refused_past_it_naming_the_field(
        make, accepted, refused, param):
    """Fields OpenAI defines that the server does not implement are accepted at their no-op values and refused at any
    other with a 400 naming the field, so no client gets an answer that silently ignored what it asked."""
    assert refusal(make, accepted) == (None, "")
    got, message = refusal(make, refused)
    assert got == param and message, (got, message)


@pytest.mark.parametrize("prompt,batch", [
    ("the cat", ["the cat"]),
    ([5, 6, 7], [[5, 6, 7]]),
    (["a", "b c"], ["a", "b c"]),
    ([[5], [6, 7]], [[5], [6, 7]]),
    (["a", [6, 7]], ["a", [6, 7]]),
])
def test_a_completion_prompt_is_one_prompt_or_a_batch_as_openai_reads_it(prompt, batch):
    assert completion(prompt=prompt).prompts() == batch


@pytest.mark.parametrize("prompt", [None, [], {"a": 1}, [5, "a"], [[5], 6], [True], 5, [[5], [True]]])
def test_a_prompt_of_any_other_shape_is_a_400_naming_prompt(prompt):
    from chunkwise.serve.protocol import APIError
    with pytest.raises(APIError) as e:
        completion(prompt=prompt).prompts()
    assert (e.value.status, e.value.param) == (400, "prompt")


@pytest.mark.parametrize("make,fields,param", [
    (completion, {"temperature": "1"}, "temperature"),
    (completion, {"max_tokens": 1.5}, "max_tokens"),
    (completion, {"max_tokens": True}, "max_tokens"),
    (completion, {"n": 2.0}, "n"),
    (completion, {"top_k": 1.0}, "top_k"),
    (completion, {"seed": "7"}, "seed"),
    (completion, {"stop_token_ids": [1.0]}, "stop_token_ids[0]"),
    (completion, {"ignore_eos": 1}, "ignore_eos"),
    (completion, {"logprobs": True}, "logprobs"),
    (completion, {"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    (chat_request, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (chat_request, {"messages": [{"role": "user", "content": "a", "extra": 1}]}, "messages[0].extra"),
    (chat_request, {"logprobs": 1}, "logprobs"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_its_path(make, fields, param):
    """Strict types, as OpenAI's API has them: no string for a number, no float or bool for an integer."""
    from chunkwise.serve.protocol import APIError
    with pytest.raises(APIError) as e:
        make(**fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_chat_content_parts_join_and_a_part_other_than_text_is_named():
    from chunkwise.serve.protocol import APIError
    req = chat_request(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}])
    assert req.chat() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}]
    req = chat_request(messages=[{"role": "user", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}]}])
    with pytest.raises(APIError) as e:
        req.chat()
    assert e.value.param == "messages[1].content[1].type" and "image_url" in e.value.message


# ---- request fields over HTTP: each one's effect is the engine's own output ------------------------------------

def test_temperature_defaults_to_one_and_top_k_and_top_p_reach_the_sampler(engine, client):
    """Unset, temperature is 1 (OpenAI's default): a seeded request is the engine's seeded sample at 1, as with
    top_k=-1 (vLLM's "every token"); top_k=1 or a top_p below the top token's mass leave only the greedy token."""
    prompt, seed = [61, 62, 63], 3
    sampled = expected(engine, [prompt], max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)[0].text
    greedy = expected(engine, [prompt], max_tokens=4, ignore_eos=True)[0].text
    assert sampled != greedy, "the seed draws tokens greedy decoding would not: the test lost its power"

    def ask(**fields) -> str:
        body = {"ignore_eos": True, **{k: fields.pop(k) for k in list(fields) if k == "top_k"}}
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, seed=seed, extra_body=body,
                                         **fields).choices[0].text
    assert ask() == sampled, "no temperature given: not OpenAI's default of 1"
    assert ask(temperature=1.0, top_k=-1) == sampled, "top_k=-1 restricted the tokens"
    assert ask(temperature=1.0, top_k=1) == greedy, "top_k=1 kept more than the top token"
    assert ask(temperature=1.0, top_p=1e-6) == greedy, "a tiny top_p kept more than the top token"


def test_a_batch_of_prompts_with_n_samples_each_is_indexed_prompt_major(engine, client):
    """OpenAI's order: choice p * n + j is the j-th sample of prompt p (seed + j); usage counts each prompt once."""
    prompts = [[71, 72], [73, 74, 75]]
    want = [expected(engine, [p], max_tokens=2, temperature=1.0, seed=20 + j, ignore_eos=True)[0].text
            for p in prompts for j in range(2)]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, seed=20,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (5, 8)


def test_a_completion_without_max_tokens_generates_openais_default_of_16(client):
    got = client.completions.create(model=MODEL, prompt=[76, 77], extra_body={"ignore_eos": True}, **GREEDY)
    assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (16, "length")


def test_a_stop_string_alone_is_a_list_of_one_and_held_back_text_is_sent_when_the_request_ends(
        engine, client):
    """A stop string given alone is a list of one. Text that could begin a stop string is held back, and sent once
    the request ends without the stop string completing, whole and streamed."""
    want = expected(engine, [[21, 22, 23]], max_tokens=5, ignore_eos=True)[0].text
    kw = dict(model=MODEL, prompt=[21, 22, 23], max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    stop = want[2:4]
    got = client.completions.create(stop=stop, **kw).choices[0]
    assert (got.text, got.finish_reason) == (want[:want.find(stop)], "stop")
    never = want[-1] + "\x00\x00"   # begins with the last character, so that character is held back to the end
    assert never not in want
    got = client.completions.create(stop=never, **kw).choices[0]
    assert (got.text, got.finish_reason) == (want, "length")
    pieces = [c.choices[0] for c in client.completions.create(stop=[never], stream=True, **kw)]
    assert "".join(p.text for p in pieces) == want and pieces[-1].finish_reason == "length"


def test_completion_logprobs_streamed_equal_whole_and_offsets_count_the_token_text(client):
    """Each token's text_offset is the length of the token texts before it (continued across streamed events),
    and the streamed tokens, logprobs and offsets are the whole answer's."""
    kw = dict(model=MODEL, prompt=[81, 82, 83], max_tokens=4, logprobs=1, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kw).choices[0].logprobs
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]
    assert whole.text_offset[-1] > 0
    events = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [t for e in events for t in e.tokens] == whole.tokens
    assert [o for e in events for o in e.text_offset] == whole.text_offset
    assert [lp for e in events for lp in e.token_logprobs] == whole.token_logprobs


def test_chat_logprobs_without_top_logprobs_hold_each_tokens_own_and_no_top_list(engine, client):
    messages = [{"role": "user", "content": "hi"}]
    want = expected(engine, [chat_ids(engine, messages)], max_tokens=3, logprobs=0, ignore_eos=True)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True,
                                         extra_body={"ignore_eos": True}, **GREEDY).choices[0].logprobs.content
    assert [c.token for c in got] == [engine.tokenizer.decode([t]) for t in want.token_ids]
    assert [c.logprob for c in got] == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)],
                                                     abs=1e-5)
    assert all(c.top_logprobs == [] and c.bytes == list(c.token.encode()) for c in got)


def test_models_lists_the_served_model_with_its_max_model_len(server, engine):
    card = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(c["id"], c["object"], c["max_model_len"]) for c in card] == [(MODEL, "model", engine.max_model_len)]


def test_without_a_tokenizer_text_prompts_and_stop_strings_are_refused_and_tokens_named_by_id(
        engine, client, monkeypatch):
    """A model without a tokenizer: text prompts and stop strings are 400s naming the field; logprobs name each token
    "token_id:N" (vLLM's form), with no text and so every text_offset 0."""
    want = expected(engine, [[84, 85]], max_tokens=2, logprobs=0, ignore_eos=True)[0]
    monkeypatch.setattr(engine.served, "tokenizer", None)
    for fields, param in (({"prompt": "the cat"}, "prompt"), ({"prompt": [84, 85], "stop": "x"}, "stop")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, max_tokens=2, **fields)
        assert error_of(e.value)["param"] == param
    got = client.completions.create(model=MODEL, prompt=[84, 85], max_tokens=2, logprobs=0,
                                    extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert got.text == "" and got.logprobs.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert got.logprobs.text_offset == [0, 0]


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404),
                                                ("GET", "/v1/models/x/y", 404)])
def test_an_unknown_path_or_method_gets_openais_error_object(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"   # a client's error, as every 4xx is


def test_a_chat_template_refusing_the_messages_is_a_400_naming_messages(engine, client, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    err = error_of(e.value)
    assert err["param"] == "messages" and "roles must alternate" in err["message"]


def test_while_shutting_down_health_and_requests_get_503(server, client):
    server.state.accepting = False
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt=[5], max_tokens=1)
        assert e.value.status_code == 503 and error_of(e.value)["type"] == "server_error"
    finally:
        server.state.accepting = True
    assert httpx.get(server.url + "/health").status_code == 200


def chat_ids(engine, messages) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


SMALL_LEN = 20   # the small server's max_model_len: room for 4 tokens after a chat of "hi"


@pytest.fixture(scope="module")
def small(chat_ckpt):
    """A second server whose max_model_len is small enough to generate up to it."""
    with serving(Engine(chat_ckpt, dtype="float32", device="cpu", page_size=4, max_model_len=SMALL_LEN), MODEL) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield srv


def test_a_chat_without_max_tokens_may_generate_up_to_max_model_len(small):
    engine = DirectEngine(small.state.loop)
    messages = [{"role": "user", "content": "hi"}]
    room = SMALL_LEN - len(chat_ids(engine, messages))
    assert room == 4
    got = small.client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True},
                                               **GREEDY)
    assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (room, "length")
    assert got.choices[0].message.content == expected(engine, [chat_ids(engine, messages)], max_tokens=room,
                                                      ignore_eos=True)[0].text


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_plus_max_tokens_of_exactly_max_model_len_is_served_and_one_more_is_a_400(small, chat):
    engine, client = DirectEngine(small.state.loop), small.client
    messages = [{"role": "user", "content": "hi"}]
    prompt = chat_ids(engine, messages) if chat else list(range(90, 90 + SMALL_LEN - 3))

    def ask(max_tokens: int):
        if chat:
            return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens,
                                                  extra_body={"ignore_eos": True}, **GREEDY)
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         extra_body={"ignore_eos": True}, **GREEDY)
    room = SMALL_LEN - len(prompt)
    assert ask(room).usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError) as e:
        ask(room + 1)
    assert "max_model_len" in error_of(e.value)["message"] and str(room + 1) in error_of(e.value)["message"]


def test_an_engine_failing_outside_a_step_ends_its_requests_with_500_and_then_answers_503(chat_ckpt):
    """The engine raising out of step() (not one request's failure, which a step contains): the request in flight
    gets a 500 naming the error, and from then on /health and every request get a 503 saying the engine failed."""
    with serving(Engine(chat_ckpt, dtype="float32", device="cpu", page_size=4, max_model_len=32), MODEL) as srv:
        def lost():
            raise RuntimeError("device lost")
        srv.state.engine.core.step = lost
        ask = dict(model=MODEL, prompt=[5, 6], max_tokens=2)
        r = httpx.post(srv.url + "/v1/completions", json=ask, timeout=60)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"], r.text
        for method, path, body in (("GET", "/health", None), ("POST", "/v1/completions", ask),
                                   ("POST", "/v1/chunks", {"model": MODEL, "prompt": [5, 6]})):
            r = httpx.request(method, srv.url + path, json=body, timeout=60)
            assert r.status_code == 503 and "the engine failed: RuntimeError: device lost" in r.json()["error"][
                "message"], (path, r.text)


def test_a_direct_call_on_a_served_engine_outside_paused_is_refused_by_name_and_changes_nothing(server, engine):
    """The engine thread is a served engine's only stepper: a call that would step or change it from another thread
    is refused, naming the call and `paused()`, before it touches the core; inside `paused()` it runs."""
    loop = server.state.loop
    raw, before = engine.served, engine.stats()
    calls = {"generate": lambda: raw.generate([[5, 6, 7]], SamplingParams(max_tokens=2)),
             "add_request": lambda: raw.add_request([5, 6, 7]), "step": raw.step,
             "register_chunk": lambda: raw.register_chunk([5, 6, 7, 8], pin=True), "abort": lambda: raw.abort(0),
             "prefill_kv": lambda: raw.prefill_kv([5, 6, 7])}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"Engine\.{name}: this engine is served.*loop\.paused\(\)"):
            call()
    assert engine.stats() == before and not raw.has_unfinished()
    with loop.paused() as eng:
        assert len(eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
