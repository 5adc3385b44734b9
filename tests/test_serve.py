"""The OpenAI-compatible server (`python -m chunkwise serve`), over real HTTP on 127.0.0.1 with the official `openai`
client: its outputs are the engine's own (streamed or not, completions and chat, 32 clients at once, n seeded
samples, logprobs, stop strings and stop ids), a client that disconnects mid-stream leaves no page behind, bad
requests get OpenAI's error object and the server goes on, a request failing inside a step gets a 500 alone, a full
queue a 429, /metrics parses and counts what was served, and SIGTERM aborts in-flight requests and exits cleanly.

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
from chunkwise.serve.stops import StopStrings

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-chat"
GREEDY = {"temperature": 0}
LONG = 500   # max_tokens of a request meant to be cut short: ~a minute of steps on CPU if it ran to the end


@pytest.fixture(scope="module")
def chat_ckpt(tiny_ckpt_with_byte_tokenizer, tmp_path_factory):
    """The byte-tokenizer tiny Qwen3 plus a simple chat template."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny-qwen3-chat"
    shutil.copytree(tiny_ckpt_with_byte_tokenizer, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(chat_ckpt):
    with serving(Engine(chat_ckpt, dtype="float32", device="cpu"), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(server):
    return server.state.engine


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


def test_stop_strings_cut_the_text_there_and_abort_the_request(server, engine, client):
    prompt = [21, 22, 23]
    want = expected(engine, [prompt], max_tokens=12, ignore_eos=True)[0]
    # a two-character stop string first found at k >= 2 (so some text comes before it)
    k = next(k for k in range(2, len(want.text) - 1) if want.text.find(want.text[k:k + 2]) == k)
    stop = want.text[k:k + 2]
    before = metrics(server)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop, "\x00never"], extra_body={"ignore_eos": True},
              **GREEDY)
    whole = client.completions.create(**kw)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want.text[:k], "stop")
    pieces = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(p.text for p in pieces) == want.text[:k] and pieces[-1].finish_reason == "stop"
    wait_idle(engine)
    after = metrics(server)
    aborted = "chunkwise_request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 2, "the engine still ran the stopped requests"
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
    if not stopped:
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
