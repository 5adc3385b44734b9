"""The server's chunk extension, over real HTTP on 127.0.0.1: /v1/chunks registers, lists and unpins chunks (on the
engine thread); a completion's `chunkwise` object composes them with text and ids, and its output equals the same
engine's `generate` of the same composite prompt (exact mode: tokens and pieces; blend mode on the same prefix
cache: tokens, logprobs and `chunk_reuse` bit for bit), streamed too, a stop string included; a request and a
registration taken between the same two steps are both answered; every bad extension input is a 400 (404 for an
unknown chunk) with OpenAI's error object naming the field, checked before anything is queued, and the server goes
on.

One server (the tiny Qwen3 with a byte-level tokenizer, pages of 4 tokens so that short chunks fill pages) serves
the module from a thread; a second, without prefix caching, shows the engine's refusal of blend mode.
"""
from __future__ import annotations

import json
import threading
import time
import httpx
import openai
import pytest

from chunkwise.chunks import Blend
from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.serve.cli import serving
from served import DirectEngine

MODEL = "tiny-bytes"
PAGE = 4
SYS, DOC_A, DOC_B = [7, 8, 9, 10, 11, 12, 13, 14], list(range(40, 52)), list(range(60, 70))


@pytest.fixture(scope="module")
def server(tiny_ckpt_with_byte_tokenizer):
    with serving(Engine(tiny_ckpt_with_byte_tokenizer, dtype="float32", device="cpu", page_size=PAGE,
                        num_pages=64, max_model_len=128), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(server):
    return DirectEngine(server.state.loop)


@pytest.fixture(scope="module")
def chunks(server) -> dict[str, dict]:
    """SYS pinned, DOC_A pinned, DOC_B as text, unpinned: their /v1/chunks cards by name."""
    cards = {}
    for name, prompt, pin in (("sys", SYS, True), ("doc_a", DOC_A, True), ("doc_b", "the other document", False)):
        r = httpx.post(server.url + "/v1/chunks", json={"model": MODEL, "prompt": prompt, "pin": pin}, timeout=120)
        assert r.status_code == 200, r.text
        cards[name] = r.json()
    return cards


def post(server, path: str, body, timeout: float = 120) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request("DELETE" if path.startswith("DELETE ") else "POST", server.url + path.removeprefix("DELETE "),
                         content=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def piece(card: dict) -> dict:
    return {"chunk": card["id"]}


def handles(server, pieces: list) -> list:
    """The same pieces for the engine: Chunk handles in place of {"chunk": name}."""
    return [server.state.chunks[p["chunk"]] if isinstance(p, dict) else p for p in pieces]


def reuse_cards(out) -> list[dict]:
    return [{"chunk": None if r.chunk is None else f"chunk-{r.chunk.chunk_id}", "num_tokens": r.num_tokens,
             "exact": r.exact, "blended": r.blended, "recomputed": r.recomputed,
             "context_tokens": None if r.context is None else len(r.context)} for r in out.chunk_reuse]


def assert_same_as_engine(choice, out, tokenizer, same_cache: bool) -> None:
    """A completion choice (logprobs=0) against the engine's RequestOutput: its tokens, text and pieces; with
    `same_cache` (both requests found the same prefix cache), its logprobs and report bit for bit too."""
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in out.token_ids]
    assert choice.text == out.text
    report = choice.model_extra["chunk_reuse"]
    assert [(r["chunk"], r["num_tokens"]) for r in report] == [(r["chunk"], r["num_tokens"]) for r in reuse_cards(out)]
    assert all(r["exact"] + r["blended"] + r["recomputed"] == r["num_tokens"] for r in report)
    if same_cache:
        assert choice.logprobs.token_logprobs == [lps[t] for t, lps in zip(out.token_ids, out.logprobs)]
        assert report == reuse_cards(out)


def test_chunks_are_registered_listed_and_unpinned(server, chunks, engine):
    assert chunks["sys"] == {"id": chunks["sys"]["id"], "object": "chunk", "num_tokens": len(SYS), "pinned": True,
                             "context_tokens": 0}
    doc_b = engine.tokenizer.encode("the other document", add_special_tokens=False)
    assert chunks["doc_b"]["num_tokens"] == len(doc_b) and not chunks["doc_b"]["pinned"]
    assert server.state.chunks[chunks["doc_b"]["id"]].token_ids == tuple(doc_b)
    listed = httpx.get(server.url + "/v1/chunks").json()
    assert listed["object"] == "list" and {c["id"]: c for c in listed["data"]} == {c["id"]: c for c in chunks.values()}
    pinned_pages = engine.page_pool.num_pinned_pages
    assert pinned_pages == (len(SYS) + len(DOC_A)) // PAGE   # both pinned chunks' full pages
    extra = post(server, "/v1/chunks", {"model": MODEL, "prompt": [90, 91, 92, 93, 94], "pin": True}).json()
    assert engine.page_pool.num_pinned_pages == pinned_pages + 1
    r = post(server, f"DELETE /v1/chunks/{extra['id']}", b"")
    assert r.status_code == 200 and r.json() == {**extra, "pinned": False}
    assert engine.page_pool.num_pinned_pages == pinned_pages
    listed = {c["id"]: c for c in httpx.get(server.url + "/v1/chunks").json()["data"]}
    assert listed[extra["id"]]["pinned"] is False   # still a handle to compose with


def test_a_request_and_a_registration_taken_between_the_same_two_steps_are_both_answered(server, engine,
                                                                                         monkeypatch):
    """The engine driver takes the server's messages between steps: a completion and a chunk registration that
    arrive during one step are taken together (the registration first: a prefix job the core runs like a prefill),
    and both are answered."""
    inbox = server.state.loop._transport._inbox
    held, release = threading.Event(), threading.Event()
    step = engine.core.step

    def held_step():
        if not release.is_set():
            held.set()
            release.wait(60)
        return step()

    results = {}

    def call(name, path, body):
        results[name] = post(server, path, body, timeout=60)

    monkeypatch.setattr(engine.core, "step", held_step)
    threads = [threading.Thread(target=call, args=("running", "/v1/completions", {
        "model": MODEL, "prompt": [5], "max_tokens": 3, "ignore_eos": True}))]
    threads[0].start()
    assert held.wait(60)   # the driver is inside a step
    threads.append(threading.Thread(target=call, args=("completion", "/v1/completions", {
        "model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True, "temperature": 0})))
    threads.append(threading.Thread(target=call, args=("chunk", "/v1/chunks", {
        "model": MODEL, "prompt": list(range(100, 124))})))
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while inbox.qsize() < 2:
        assert time.monotonic() < deadline, "the server's messages did not reach the engine's inbox"
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(90)
    assert set(results) == {"running", "chunk", "completion"}, results
    assert all(r.status_code == 200 for r in results.values()), {k: r.text for k, r in results.items()}
    assert results["completion"].json()["usage"]["completion_tokens"] == 2


def test_composite_completion_equals_the_engines_exact_generate(server, client, chunks, engine):
    pieces = [piece(chunks["sys"]), piece(chunks["doc_b"]), [30, 31], piece(chunks["doc_a"]), "which one?"]
    res = client.completions.create(model=MODEL, prompt="", max_tokens=5, temperature=0, logprobs=0, n=2,
                                    extra_body={"ignore_eos": True, "chunkwise": {"prompt": pieces}})
    out = engine.generate([handles(server, pieces)], SamplingParams(max_tokens=5, temperature=0, logprobs=0,
                                                                    ignore_eos=True))[0]
    for choice in res.choices:   # the server's request cached the prompt's pages: the engine's reuses more
        assert_same_as_engine(choice, out, engine.tokenizer, same_cache=False)
    assert [r["chunk"] for r in res.choices[0].model_extra["chunk_reuse"]] == [
        chunks["sys"]["id"], chunks["doc_b"]["id"], None, chunks["doc_a"]["id"], None]
    assert res.choices[0].model_extra["chunk_reuse"][0]["exact"] == len(SYS)   # pinned, opening the prompt
    assert res.usage.prompt_tokens == len(out.prompt_token_ids)


def test_composite_completion_equals_the_engines_blend(server, client, chunks, engine):
    """Back to back on the same engine: a blended request leaves nothing in the prefix cache, and the chunks it
    reuses are pinned, so both see the same cache."""
    pieces = [piece(chunks["doc_a"]), [33], piece(chunks["sys"]), "and?"]
    ext = {"prompt": pieces, "reuse": "blend", "recompute_ratio": 0.25, "policy": "chunk-heads"}
    res = client.completions.create(model=MODEL, prompt=None, max_tokens=4, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "chunkwise": ext})
    out = engine.generate([handles(server, pieces)], SamplingParams(max_tokens=4, temperature=0, logprobs=0,
                                                                    ignore_eos=True),
                          reuse=Blend(recompute_ratio=0.25, policy="chunk-heads"))[0]
    assert_same_as_engine(res.choices[0], out, engine.tokenizer, same_cache=True)
    report = res.choices[0].model_extra["chunk_reuse"]
    assert report[2]["chunk"] == chunks["sys"]["id"] and report[2]["blended"] > 0   # moved from position 0
    default = client.completions.create(model=MODEL, prompt=None, max_tokens=2, temperature=0, extra_body={
        "ignore_eos": True, "chunkwise": {"prompt": pieces, "reuse": "blend"}})   # Blend()'s defaults
    assert sum(r["blended"] for r in default.choices[0].model_extra["chunk_reuse"]) > 0


def test_a_chunk_registered_after_a_context_is_blended_as_that_variant(server, client, chunks, engine):
    """POST /v1/chunks' `after` (a registered chunk, text, ids, or a list of those) is the context the chunk is
    computed after; a blended completion opening with that context places this variant, as the engine does."""
    doc = list(range(100, 111))
    card = post(server, "/v1/chunks", {"model": MODEL, "prompt": doc, "after": piece(chunks["sys"])}).json()
    assert (card["num_tokens"], card["context_tokens"]) == (len(doc), len(SYS)), card
    assert server.state.chunks[card["id"]].context.token_ids == tuple(SYS)
    both = (len(SYS) + len(doc)) // PAGE
    assert len(engine.page_pool.chain_pages(SYS + doc)) == both   # context + chunk computed and cached
    pieces = [piece(chunks["sys"]), [33], piece(card), "and?"]
    res = client.completions.create(model=MODEL, prompt=None, max_tokens=3, temperature=0, logprobs=0, extra_body={
        "ignore_eos": True, "chunkwise": {"prompt": pieces, "reuse": "blend", "recompute_ratio": 0.0}})
    out = engine.generate([handles(server, pieces)], SamplingParams(max_tokens=3, temperature=0, logprobs=0,
                                                                    ignore_eos=True), reuse=Blend(0.0))[0]
    assert_same_as_engine(res.choices[0], out, engine.tokenizer, same_cache=True)
    report = res.choices[0].model_extra["chunk_reuse"]
    assert report[2]["context_tokens"] == len(SYS) and report[2]["blended"] == both * PAGE - len(SYS)
    text = post(server, "/v1/chunks", {"model": MODEL, "prompt": doc, "after": [piece(chunks["sys"]), "x y",
                                                                                  [5]]}).json()
    n_text = len(engine.tokenizer.encode("x y", add_special_tokens=False))
    assert text["context_tokens"] == len(SYS) + n_text + 1, text


def test_streamed_composite_cut_by_a_stop_string_reports_chunk_reuse(server, client, chunks, engine):
    pieces = ["so: ", piece(chunks["doc_b"])]
    out = engine.generate([handles(server, pieces)], SamplingParams(max_tokens=6, temperature=0,
                                                                    ignore_eos=True))[0]
    stop = out.text[2:4]
    assert stop and out.text.find(stop) == 2, out.text   # a stop string whose first occurrence cuts the text
    events = list(client.completions.create(model=MODEL, prompt="", max_tokens=6, temperature=0, stream=True,
                                            stop=[stop], extra_body={"ignore_eos": True,
                                                                     "chunkwise": {"prompt": pieces}}))
    assert "".join(e.choices[0].text for e in events) == out.text[:2]
    last = events[-1].choices[0]
    assert last.finish_reason == "stop" and all(e.choices[0].finish_reason is None for e in events[:-1])
    report = last.model_extra["chunk_reuse"]
    assert [r["chunk"] for r in report] == [None, chunks["doc_b"]["id"]]
    assert [r["num_tokens"] for r in report] == [r.num_tokens for r in out.chunk_reuse]
    assert all(r["exact"] + r["blended"] + r["recomputed"] == r["num_tokens"] for r in report)


def test_a_plain_completion_has_no_chunk_reuse(client):
    res = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=1, temperature=0)
    assert "chunk_reuse" not in res.choices[0].model_extra


# Stand-ins for the ids the `chunks` fixture got (other tests on the same server may have registered chunks
# first), put into each body by the test.
CHUNK, UNPINNED = "<sys>", "<doc_b>"


@pytest.mark.parametrize("path, body, status, param, says", [
    ("/v1/chunks", {"model": MODEL, "prompt": []}, 400, "prompt", "no tokens"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5, 100000]}, 400, "prompt", "100000"),
    ("/v1/chunks", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", None),
    ("/v1/chunks", {"model": "gpt-4", "prompt": [5]}, 404, "model", "gpt-4"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "pin": "yes"}, 400, "pin", None),
    ("/v1/chunks", {"model": MODEL, "prompt": list(range(1, 121)), "pin": True}, 400, "pin",
     "max_pinned_fraction"),   # 30 pages; 5 are pinned, and half of 64 may be
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": {"chunk": "chunk-999"}}, 404, "after.chunk", "chunk-999"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": [[5], {"chunk": "chunk-999"}]}, 404, "after[1].chunk",
     "chunk-999"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": {"x": 1}}, 400, "after", "after"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": [5, 100000]}, 400, "after", "100000"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": ""}, 400, "after", "no tokens"),
    ("/v1/chunks", {"model": MODEL, "prompt": [5], "after": [5] * 130}, 400, "after", "max_model_len"),
    ("DELETE /v1/chunks/chunk-999", b"", 404, None, "chunk-999"),
    ("DELETE /v1/chunks/" + UNPINNED, b"", 400, None, "not pinned"),   # doc_b, registered with pin=false
    ("/v1/completions", {"model": MODEL, "prompt": [5], "chunkwise": {"prompt": [{"chunk": CHUNK}]}}, 400,
     "prompt", "not both"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": "chunk-999"}]}}, 404,
     "chunkwise.prompt[0].chunk", "chunk-999"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}, {"x": 1}]}}, 400,
     "chunkwise.prompt[1]", "chunk"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": ["text", [5, 6]]}}, 400, "chunkwise.prompt",
     "at least one"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}, ""]}}, 400, "chunkwise.prompt",
     "no tokens"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}, [100000]]}}, 400,
     "chunkwise.prompt", "100000"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}, [5] * 130]}}, 400,
     "chunkwise.prompt", "max_model_len"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "reuse": "fuzzy"}}, 400,
     "chunkwise.reuse", "fuzzy"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "reuse": "blend",
                                                       "recompute_ratio": 1.5}}, 400, "chunkwise.recompute_ratio",
     "1.5"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "reuse": "blend",
                                                       "recompute_ratio": -0.1}}, 400, "chunkwise.recompute_ratio",
     "-0.1"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "reuse": "blend",
                                                       "policy": "random"}}, 400, "chunkwise.policy", "random"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "recompute_ratio": 0.5}},
     400, "chunkwise.recompute_ratio", "blend"),
    ("/v1/completions", {"model": MODEL, "chunkwise": {"prompt": [{"chunk": CHUNK}], "frobnicate": 1}}, 400,
     "chunkwise.frobnicate", "Unrecognized"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chunkwise": {"prompt": [{"chunk": CHUNK}]}}, 400, "chunkwise.prompt", "Unrecognized"),
])
def test_bad_chunk_inputs_get_openai_errors_naming_the_field(server, chunks, engine, path, body, status, param,
                                                              says):
    ids = {CHUNK: chunks["sys"]["id"], UNPINNED: chunks["doc_b"]["id"]}
    path = path.replace(UNPINNED, ids[UNPINNED])
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace(CHUNK, ids[CHUNK]))
    listed = httpx.get(server.url + "/v1/chunks").json()
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert says is None or says in err["message"], err
    assert not engine.has_unfinished()   # nothing was queued
    assert httpx.get(server.url + "/v1/chunks").json() == listed   # nothing registered or unpinned


def test_the_server_still_serves_composites_after_bad_inputs(server, client, chunks):
    res = client.completions.create(model=MODEL, prompt="", max_tokens=1, temperature=0,
                                    extra_body={"chunkwise": {"prompt": [piece(chunks["sys"]), "ok"]}})
    assert res.choices[0].finish_reason in ("length", "stop") and res.choices[0].model_extra["chunk_reuse"]


def test_blend_refused_by_the_engine_config_is_a_400_with_its_message(tiny_ckpt_with_byte_tokenizer):
    with serving(Engine(tiny_ckpt_with_byte_tokenizer, dtype="float32", device="cpu", page_size=PAGE, num_pages=64,
                        max_model_len=64, enable_prefix_caching=False), MODEL) as srv:
        card = post(srv, "/v1/chunks", {"model": MODEL, "prompt": SYS}).json()
        assert post(srv, "/v1/chunks", {"model": MODEL, "prompt": SYS, "pin": True}).json()["error"]["param"] == "pin"
        r = post(srv, "/v1/completions", {"model": MODEL, "max_tokens": 1, "chunkwise": {
            "prompt": [piece(card), [5]], "reuse": "blend"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chunkwise.reuse", r.text
        assert "enable_prefix_caching=True" in r.json()["error"]["message"]
        ok = post(srv, "/v1/completions", {"model": MODEL, "max_tokens": 1, "chunkwise": {
            "prompt": [piece(card), [5]]}})   # exact mode needs no prefix cache
        assert ok.status_code == 200 and ok.json()["choices"][0]["chunk_reuse"][0]["exact"] == 0
