"""Chunks in chat: a message's `{"type": "chunk"}` parts (chunkwise/serve/chat.py), spliced and over real HTTP.

The splice is checked against an oracle that never splits on placeholders: the conversation rendered with the
chunk's text inlined, its token ids, and the character offset where that text lands. Where the tokenizer splits at
the chunk's edges anyway, the spliced ids equal the inlined conversation's ids; always, the chunk's exact ids stand
where its text would start, the template's text before and after tokenized as it is. Over HTTP the openai client
sends chunk parts (a system chunk too) with `chunkwise` reuse options in `extra_body`; the engine gets exactly the
spliced prompt, the answer equals the engine's own generate of it and carries `chunk_reuse`, streamed too; every bad
part is a 400 naming it (an unknown chunk, a chunk in a tool message, a system chunk under a template without a
system role) and the server goes on.

One server: the tiny Qwen3 with the byte-level tokenizer and a ChatML-like template, pages of 4 tokens.
"""
from __future__ import annotations


import httpx
import openai
import pytest

from chunkwise.chunks import Blend, Chunk
from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.serve.chat import splice_chat
from chunkwise.serve.cli import serving
from chunkwise.serve.protocol import ChatMessage
from served import DirectEngine

MODEL = "tiny-chat"
PAGE = 4
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Two ways a template has no system role: it refuses one (as Mistral's and Gemma 2's do) or drops it.
REFUSES_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                  "supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
DROPS_SYSTEM = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
                "{% endfor %}")
SYS_TEXT = " Answer in one word."          # words led by a space: the byte-level tokenizer splits at their edges
DOC_TEXT = " the brown fox sleeps"
THE_BYTES = "the"                          # registered as single-byte ids, which the tokenizer would merge


@pytest.fixture(scope="module")
def chat_ckpt(chat_template_ckpt):
    return chat_template_ckpt(CHATML)


@pytest.fixture(scope="module")
def server(chat_ckpt):
    with serving(Engine(chat_ckpt, dtype="float32", device="cpu", page_size=PAGE, num_pages=128,
                        max_model_len=256), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(server):
    return server.state.engine.tokenizer


@pytest.fixture(scope="module")
def chunks(server, tok) -> dict[str, str]:
    """Names of the registered chunks: "sys" and "doc" from text (sys pinned), "the" from single-byte ids."""
    the_ids = [tok.convert_tokens_to_ids(c) for c in THE_BYTES]
    assert len(tok.encode(THE_BYTES, add_special_tokens=False)) < len(the_ids), "the tokenizer should merge them"
    names = {}
    for name, prompt, pin in (("sys", SYS_TEXT, True), ("doc", DOC_TEXT, False), ("the", the_ids, False)):
        r = httpx.post(server.url + "/v1/chunks", json={"model": MODEL, "prompt": prompt, "pin": pin}, timeout=120)
        assert r.status_code == 200, r.text
        names[name] = r.json()["id"]
    return names


def chunk_part(name: str) -> dict:
    return {"type": "chunk", "chunk": name}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def conversation(chunks) -> list[dict]:
    """A system chunk, a user turn with text around a chunk, an assistant turn, a user turn of one chunk."""
    return [{"role": "system", "content": [chunk_part(chunks["sys"])]},
            {"role": "user", "content": [text_part("Where does"), chunk_part(chunks["doc"]), text_part(" go?")]},
            {"role": "assistant", "content": "home"},
            {"role": "user", "content": [text_part("and"), chunk_part(chunks["the"])]}]


def inlined(messages: list[dict], texts: dict[str, str]) -> list[dict]:
    """The same conversation with each chunk part's text in its place."""
    def content(c):
        return c if isinstance(c, str) else "".join(p["text"] if p["type"] == "text" else texts[p["chunk"]] for p in c)
    return [{"role": m["role"], "content": content(m["content"])} for m in messages]


def spliced_ids(server, messages: list[dict]) -> tuple[list[int], list]:
    """The server's splice of these messages: the prompt's ids and its pieces."""
    state = server.state
    prompt = splice_chat(state.engine.tokenizer, [ChatMessage.model_validate(m) for m in messages], state.chunks)
    ids = [t for p in prompt.pieces for t in (p.token_ids if isinstance(p, Chunk) else p)]
    assert prompt.num_tokens == len(ids)
    return ids, list(prompt.pieces)


def test_a_chunk_whose_edges_the_tokenizer_splits_anyway_gives_the_inlined_conversations_ids(server, chunks, tok):
    messages = conversation(chunks)[:3]   # the system and document chunks, both text at word edges
    texts = {chunks["sys"]: SYS_TEXT, chunks["doc"]: DOC_TEXT}
    ids, pieces = spliced_ids(server, messages)
    expected = tok.apply_chat_template(inlined(messages, texts), add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)
    assert [p for p in pieces if isinstance(p, Chunk)] == [server.state.chunks[chunks[n]] for n in ("sys", "doc")]


@pytest.mark.parametrize("upto", [1, 2, 4])
def test_each_chunks_exact_ids_stand_where_its_text_would_start(server, chunks, tok, upto):
    """Whatever the tokenizer would make of the chunk's text in context (the "the" chunk's single bytes would
    merge), the prompt is the template's text before the chunk tokenized, the chunk's own ids, then the rest."""
    messages = conversation(chunks)[:upto]
    handles = {n: server.state.chunks[chunks[n]] for n in ("sys", "doc", "the")}
    marks = {chunks[n]: f"\u2062{n}\u2063" for n in handles}   # invisible separators, in no template or text here
    rendered = tok.apply_chat_template(inlined(messages, marks), add_generation_prompt=True, tokenize=False)
    expected, start = [], 0
    while True:   # the oracle: cut the inlined rendering at each mark's characters
        at = [(rendered.find(m, start), n) for n, m in ((n, marks[chunks[n]]) for n in handles)]
        at = [(i, n) for i, n in at if i >= 0]
        if not at:
            break
        i, n = min(at)
        expected += tok.encode(rendered[start:i], add_special_tokens=False) + list(handles[n].token_ids)
        start = i + len(marks[chunks[n]])
    expected += tok.encode(rendered[start:], add_special_tokens=False)
    ids, _ = spliced_ids(server, messages)
    assert ids == expected


def record_requests(server, monkeypatch) -> list:
    """From now on, the requests the engine's core is given."""
    core, seen = server.state.engine.core, []
    add_requests = core.add_requests

    def recorded(requests):
        seen.extend(requests)
        return add_requests(requests)
    monkeypatch.setattr(core, "add_requests", recorded)
    return seen


def test_chat_chunk_parts_over_http_give_the_engines_generate_of_the_spliced_prompt(server, client, chunks,
                                                                                    monkeypatch):
    messages = conversation(chunks)
    ids, pieces = spliced_ids(server, messages)
    seen = record_requests(server, monkeypatch)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"chunkwise": {"reuse": "exact"}, "ignore_eos": True})
    assert len(seen) == 1 and seen[0].prompt_token_ids == ids, "the engine did not get the spliced prompt"
    assert [(p.chunk, p.num_tokens) for p in seen[0].pieces] == \
        [(p if isinstance(p, Chunk) else None, len(p)) for p in pieces]
    engine = DirectEngine(server.state.loop)
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].message.content == out.text
    assert r.usage.prompt_tokens == len(ids)
    report = r.choices[0].model_extra["chunk_reuse"]
    assert [(x["chunk"], x["num_tokens"]) for x in report] == \
        [(f"chunk-{p.chunk_id}" if isinstance(p, Chunk) else None, len(p)) for p in pieces]
    assert all(x["exact"] + x["blended"] + x["recomputed"] == x["num_tokens"] for x in report)


def test_streamed_chat_with_chunks_joins_to_the_whole_answer_and_ends_with_chunk_reuse(server, client, chunks):
    messages = conversation(chunks)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                  extra_body={"chunkwise": {"reuse": "exact"}, "ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    events = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(e.choices[0].delta.content or "" for e in events) == whole.choices[0].message.content
    last = events[-1].choices[0]
    assert last.finish_reason == "length"
    assert [x["chunk"] for x in last.model_extra["chunk_reuse"]] == \
        [x["chunk"] for x in whole.choices[0].model_extra["chunk_reuse"]]


def test_blend_options_reach_the_engine_for_a_chat(server, client, chunks, monkeypatch):
    seen = record_requests(server, monkeypatch)
    r = client.chat.completions.create(model=MODEL, messages=conversation(chunks), max_tokens=2, temperature=0,
                                       extra_body={"chunkwise": {"reuse": "blend", "recompute_ratio": 0.5,
                                                                 "policy": "chunk-heads"}})
    assert [r.reuse for r in seen] == [Blend(0.5, "chunk-heads")]
    assert all(x["exact"] + x["blended"] + x["recomputed"] == x["num_tokens"]
               for x in r.choices[0].model_extra["chunk_reuse"])


BAD = [
    ("an unknown chunk",
     lambda c: [{"role": "user", "content": [text_part("hi"), chunk_part("chunk-999")]}], {},
     "messages[0].content[1].chunk", "chunk-999"),
    ("a chunk in a tool message",
     lambda c: [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "t1",
                                                     "content": [chunk_part(c["doc"])]}], {},
     "messages[1].content[0]", "tool message"),
    ("a chunk part without its chunk",
     lambda c: [{"role": "user", "content": [{"type": "chunk"}, chunk_part(c["doc"])]}], {},
     "messages[0].content[0]", "'type': 'chunk'"),
    ("a part of another type beside a chunk",
     lambda c: [{"role": "user", "content": [{"type": "image_url"}, chunk_part(c["doc"])]}], {},
     "messages[0].content[0].type", "image_url"),
    ("chunkwise without chunk parts",
     lambda c: [{"role": "user", "content": "hi"}], {"chunkwise": {"reuse": "exact"}}, "chunkwise", "none"),
    ("a chunkwise prompt in a chat",
     lambda c: [{"role": "user", "content": [chunk_part(c["doc"])]}], {"chunkwise": {"prompt": ["x"]}},
     "chunkwise.prompt", "Unrecognized"),
    ("a ratio with exact reuse",
     lambda c: [{"role": "user", "content": [chunk_part(c["doc"])]}],
     {"chunkwise": {"reuse": "exact", "recompute_ratio": 0.5}}, "chunkwise.recompute_ratio", "blend"),
]


@pytest.mark.parametrize("what,messages_of,extra,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_chunk_parts_are_400s_naming_the_part(server, client, chunks, what, messages_of, extra, param,
                                                       words, monkeypatch):
    seen = record_requests(server, monkeypatch)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages_of(chunks), max_tokens=1, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
    assert not seen, "a bad request reached the engine"


@pytest.mark.parametrize("template,how", [(REFUSES_SYSTEM, "refuses system"), (DROPS_SYSTEM, "drops system")])
def test_a_system_chunk_under_a_template_without_a_system_role_is_a_400_naming_it(server, client, chunks, tok,
                                                                                 monkeypatch, template, how):
    monkeypatch.setattr(tok, "chat_template", template)
    messages = [{"role": "system", "content": [text_part("be brief"), chunk_part(chunks["sys"])]},
                {"role": "user", "content": [chunk_part(chunks["doc"])]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    body = e.value.body
    assert body["param"] == "messages[0].content[1]" and "no system role" in body["message"] and how in body["message"]
    # the same template serves the user chunk alone
    r = client.chat.completions.create(model=MODEL, messages=messages[1:], max_tokens=1)
    assert [x["chunk"] for x in r.choices[0].model_extra["chunk_reuse"]] == [None, chunks["doc"], None]


def test_a_tool_message_of_text_is_served_beside_chunks_where_a_tool_chunk_is_refused(server, client, chunks):
    messages = [{"role": "user", "content": [chunk_part(chunks["doc"])]},
                {"role": "tool", "tool_call_id": "t1", "content": [text_part(" sleeps")]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert [x["chunk"] for x in r.choices[0].model_extra["chunk_reuse"]] == [None, chunks["doc"], None]


def test_the_server_still_serves_chat_chunks_after_bad_parts(server, client, chunks):
    r = client.chat.completions.create(model=MODEL, messages=conversation(chunks), max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [chunk_part("nope")]}])
    r = client.chat.completions.create(model=MODEL, messages=conversation(chunks), max_tokens=1)
    assert r.choices[0].finish_reason == "length"
