"""The server's streaming path under many concurrent streams: the engine thread hands each step's outputs to the
event loop together, and each streamed chunk's JSON is written directly rather than through json.dumps of a dict.

Over real HTTP with a stand-in engine (benchmarks/bench_http_overhead.py's FakeEngine: no model, so one step serves
dozens of streams in a millisecond): every client gets each of its tokens exactly once, in order, with its own
logprobs and text offsets, its usage, and the same text a whole (not streamed) answer has. And the chunk JSON
written directly is byte for byte json.dumps of OpenAI's chunk, for any text, finish reason and logprobs.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from benchmarks.bench_http_overhead import VOCAB, FakeEngine
from chunkwise.serve.app import _Choice, _Reply
from chunkwise.serve.cli import serving
from chunkwise.serve.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "fake"


@pytest.fixture(scope="module")
def url():
    with serving(FakeEngine(step_s=0.001), MODEL) as srv:
        yield srv.url


def expected_ids(first: int, n: int) -> list[int]:
    """FakeEngine's tokens for a prompt beginning with `first`."""
    return [(first + i) % (VOCAB - 1) + 1 for i in range(n)]


async def stream(client: httpx.AsyncClient, first: int, max_tokens: int) -> list[dict]:
    body = dict(model=MODEL, prompt=[first, 7], max_tokens=max_tokens, ignore_eos=True, stream=True, logprobs=2,
                stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_concurrent_streams_each_get_every_token_once_in_order_with_its_logprobs(url):
    lengths = [3 + (7 * i) % 40 for i in range(48)]   # streams ending at different steps, most running together

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await asyncio.gather(*(stream(client, 10 * i + 1, n) for i, n in enumerate(lengths)))

    for i, (n, events) in enumerate(zip(lengths, asyncio.run(run()))):
        want = expected_ids(10 * i + 1, n)
        *tokens, last = events
        assert all(len(e["choices"]) == 1 for e in tokens), "one event per token"
        choices = [e["choices"][0] for e in tokens]
        assert [c["logprobs"]["tokens"] for c in choices] == [[f" {t}"] for t in want], i
        assert [c["text"] for c in choices] == [f" {t}" for t in want]
        assert all(c["logprobs"]["token_logprobs"] == [-0.5] for c in choices)
        assert [list(c["logprobs"]["top_logprobs"][0].values())[0] for c in choices] == [-0.5] * n
        assert [c["finish_reason"] for c in choices] == [None] * (n - 1) + ["length"]
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 2, "completion_tokens": n,
                                                           "total_tokens": n + 2}
    whole = httpx.post(url + "/v1/completions", json=dict(model=MODEL, prompt=[1, 7], max_tokens=5, ignore_eos=True))
    assert whole.json()["choices"][0]["text"] == "".join(f" {t}" for t in expected_ids(1, 5))


def reply(chat: bool, logprobs: int | None, composite: bool = False) -> _Reply:
    """A _Reply to one request with one choice, over a server state of the bare minimum."""
    state = SimpleNamespace(max_logprobs=20, model_name="m\u00e9\"x", engine=SimpleNamespace(tokenizer=None))
    if chat:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    logprobs=logprobs is not None, top_logprobs=logprobs)
    else:
        req = CompletionRequest(model="m", prompt=[1], logprobs=logprobs)
    return _Reply(state, req, chat, [_Choice(0, 0, None)], None, 1, composite)


def openai_chunk(r: _Reply, piece: str, pairs, finish_reason) -> str:
    """The event as json.dumps writes OpenAI's chunk dict."""
    c = r.choices[0]
    lp = r._logprobs(c, pairs) if r.k is not None and pairs else None
    choice = ({"index": 0, "delta": {"content": piece}} if r.chat else {"index": 0, "text": piece}) | {
        "logprobs": lp, "finish_reason": finish_reason}
    if r.composite and finish_reason is not None:
        choice["chunk_reuse"] = c.chunk_reuse
    return "data: " + json.dumps({"id": r.id, "object": "chat.completion.chunk" if r.chat else "text_completion",
                                  "created": r.created, "model": r.state.model_name, "choices": [choice]}) + "\n\n"


@settings(max_examples=200, deadline=None)
@given(piece=st.text(), chat=st.booleans(), logprobs=st.sampled_from([None, 0, 2]), composite=st.booleans(),
       finish_reason=st.sampled_from([None, "stop", "length", "abort"]),
       lps=st.lists(st.floats(max_value=0, allow_nan=False), min_size=1, max_size=3))
def test_a_streamed_chunk_is_byte_for_byte_json_dumps_of_openais_chunk(piece, chat, logprobs, composite,
                                                                       finish_reason, lps):
    composite = composite and not chat
    fast, slow = reply(chat, logprobs, composite), reply(chat, logprobs, composite)
    slow.id, slow.created = fast.id, fast.created
    for r in (fast, slow):
        r.choices[0].chunk_reuse = [{"chunk": "chunk-1", "num_tokens": 3}] if composite else None
    pairs = [(5, {5: lps[0], **{u: v for u, v in enumerate(lps[1:], 7)}})]
    assert fast._event([fast._choice_json(fast.choices[0], piece, pairs, finish_reason)]) == openai_chunk(
        slow, piece, pairs, finish_reason)
