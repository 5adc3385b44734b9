"""The FastAPI application: OpenAI's completions and chat completions (streamed or not), models, health, metrics,
and chunkwise's chunk registry (/v1/chunks) with composite completion prompts (the `chunkwise` extension).

A request is parsed and checked here (protocol.py), its prompts encoded (a chat through the checkpoint's chat
template), then its samples (n per prompt) are submitted to the engine together (`state.loop`: an EngineClient,
serve/client.py, over an engine on a thread or in a process of its own). Their outputs come back through one asyncio
queue, with their text (stop strings already cut by the client's output processor, which aborts the sample in the
engine). A client that disconnects, streaming or not, has its requests aborted, so their pages are freed at once. Errors use OpenAI's error object: 400 for a bad request (the engine's own TypeError/ValueError message
included), 404 for an unknown model, 429 when the waiting queue is full, 500 for a request that failed inside a
step (only that request), 503 while shutting down or after the engine failed.

Chunks: POST /v1/chunks registers one (`Engine.register_chunk`, run by the engine between steps), named
"chunk-<n>" after its engine id, computed after the context `after` if given (pieces as a composite prompt's:
`{"chunk": "chunk-<n>"}`, text, ids, or a list of those); GET lists those registered here; DELETE /v1/chunks/{id} unpins one. A completion's
`chunkwise.prompt` composes them with text and ids into one composite prompt (`prompt` then absent or empty), with
`chunkwise.reuse` "exact" or "blend" (`recompute_ratio`, `policy`: a `chunkwise.Blend`); each choice then carries
`chunk_reuse`, the engine's report per piece. A chat message's content may hold `{"type": "chunk", "chunk":
"chunk-<n>"}` parts: the template's text is spliced around the chunks' ids (chat.py), `chunkwise` then gives the
reuse mode alone, and each choice carries `chunk_reuse` likewise.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future
from json.encoder import encode_basestring_ascii as _json_str   # a str as json.dumps writes it (ensure_ascii)
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkwise.chunks import BLEND_POLICIES, Blend, Chunk, blend_params
from chunkwise.limits import LIMIT
from chunkwise.serve.chat import has_chunk_parts, splice_chat
from chunkwise.serve.client import EngineClient
from chunkwise.serve.protocol import (APIError, ChatCompletionRequest, ChunkRequest, CompletionRequest, ReuseOptions,
                                      bad_request, chunk_card, chunk_name, model_card, new_id, now, parse, reuse_card,
                                      usage)
from chunkwise.serve.streams import Submission
from chunkwise.tokenizer import chat_prompt, encode_prompts, is_int

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; a chat defaults to the room left


@dataclass
class ServerState:
    loop: EngineClient   # the engine on a thread of this process (EngineLoop), or in a process of its own (EngineCore)
    model_name: str
    max_waiting: int = 1024        # requests waiting for admission before new ones get 429
    max_logprobs: int = 20         # the most top logprobs a request may ask for (OpenAI allows 20)
    accepting: bool = True         # False once shutting down
    created: int = field(default_factory=now)
    # chunks registered through /v1/chunks, by name; written as the engine's answers arrive
    chunks: dict[str, Chunk] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)

    def __post_init__(self):
        check_server_options(self.max_waiting, self.max_logprobs)

    @property
    def engine(self):
        return self.loop.engine


def check_server_options(max_waiting, max_logprobs) -> None:
    """The server's own options, each an integer inside its row of chunkwise.limits; else ValueError naming it."""
    for name, value in (("max_waiting", max_waiting), ("max_logprobs", max_logprobs)):
        if not is_int(value) or not LIMIT[name].admits(value):
            raise ValueError(f"{name} must be an integer >= {LIMIT[name].lower}, got {value!r}")


@dataclass
class _Choice:
    """One sample's progress: what was sent, what ended it."""
    index: int
    request_id: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)   # (token, its logprob dict)
    finish_reason: str | None = None
    error: str | None = None
    chunk_reuse: list[dict] | None = None   # the engine's report, once ended

    def feed(self, out) -> tuple[str, list[tuple[int, dict[int, float]]]]:
        """The text and (token, logprobs) pairs that `out` adds; sets finish_reason when the sample ends (a stop
        string is "stop", as the engine's own stop tokens are)."""
        self.num_tokens += len(out.new_token_ids)
        pairs = list(zip(out.new_token_ids, out.new_logprobs)) if out.new_logprobs else []
        self.logprobs += pairs
        piece = out.new_text
        if out.finished:
            report = out.output.chunk_reuse if out.output is not None else None
            self.chunk_reuse = None if report is None else [reuse_card(r) for r in report]
            self.finish_reason = out.finish_reason
            if out.finish_reason == "error":
                self.error = out.output.error if out.output is not None else "the request failed"
        self.text += piece
        return piece, pairs


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="chunkwise", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        problem = state.loop.failure or (None if state.accepting else "shutting down")
        if problem:
            raise APIError(503, problem)
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state.model_name, state.engine.max_model_len, state.created)]}

    @app.get("/metrics")
    async def metrics():
        m = state.loop.streams.metrics
        return Response(m.render() if m is not None else b"", media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chunks")
    async def register_chunk(request: Request):
        return await _register_chunk(state, request)

    @app.get("/v1/chunks")
    async def list_chunks():
        chunks = list(state.chunks.items())
        return {"object": "list", "data": [chunk_card(c, name in state.pinned) for name, c in chunks]}

    @app.delete("/v1/chunks/{name}")
    async def unpin_chunk(name: str):
        return await _unpin_chunk(state, name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, chat=True)

    return app


async def _body(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _check_serving(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    if not state.accepting or state.loop.failure:
        raise APIError(503, state.loop.failure or "the server is shutting down")


async def _register_chunk(state: ServerState, request: Request) -> dict:
    req = parse(ChunkRequest, await _body(request))
    _check_serving(state, req.model)
    engine = state.engine
    # the prompt's own errors (no tokenizer for text, empty, outside the vocabulary) before the engine
    _engine_check(engine.chunks.chunk_ids, req.prompt, engine.tokenizer, engine.model_config.vocab_size,
                  param="prompt")
    after = None if req.after is None else _after(state, req.after)

    def record(registered: Future) -> None:   # as it resolves, so a client that left still has it listed
        if registered.exception() is None:
            chunk = registered.result()
            state.chunks[chunk_name(chunk)] = chunk
            if req.pin:
                state.pinned.add(chunk_name(chunk))

    registered = state.loop.register_chunk(req.prompt, req.pin, after)
    registered.add_done_callback(record)
    try:
        chunk = await asyncio.wrap_future(registered)
    except (TypeError, ValueError) as e:   # the pin's: the cap, a queued request left without room
        msg = str(e)
        raise bad_request(msg, "pin" if "pin" in msg else "after" if msg.startswith("after") else "prompt") from None
    except RuntimeError as e:
        raise APIError(503 if state.loop.failure or not state.accepting else 500, str(e)) from None
    return chunk_card(chunk, req.pin)


async def _unpin_chunk(state: ServerState, name: str) -> dict:
    chunk = state.chunks.get(name)
    if chunk is None:
        raise APIError(404, f"The chunk `{name}` does not exist (register it with POST /v1/chunks).",
                       code="chunk_not_found")
    if name not in state.pinned:
        raise bad_request(f"the chunk `{name}` is not pinned (registered with pin=false, or unpinned already)")

    def record(unpinned: Future) -> None:
        if unpinned.exception() is None:
            state.pinned.discard(name)

    unpinned = state.loop.unpin(chunk)
    unpinned.add_done_callback(record)
    try:
        await asyncio.wrap_future(unpinned)
    except ValueError as e:   # unpinned meanwhile by another request
        raise bad_request(str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e)) from None
    return chunk_card(chunk, False)


async def _generate(state: ServerState, request: Request, chat: bool):
    arrival = time.monotonic()
    req = parse(ChatCompletionRequest if chat else CompletionRequest, await _body(request))
    _check_serving(state, req.model)
    req.refuse_unsupported()
    engine = state.engine
    composite = req.chunkwise is not None or (chat and has_chunk_parts(req.messages))
    if composite and chat:
        prompt = _chat_chunks(state, req)
        prompts, reuse, prompt_tokens = [list(prompt.pieces)], _reuse(engine, req.chunkwise), prompt.num_tokens
    elif composite:
        pieces, reuse, prompt_tokens = _composite(state, req)
        prompts = [pieces]
    else:
        prompts = _chat_prompt(state, req) if chat else _completion_prompts(engine, req)
        reuse, prompt_tokens = "exact", sum(len(p) for p in prompts)
    lengths = [prompt_tokens] if composite else [len(p) for p in prompts]
    stops = req.stop_strings()
    if stops and engine.tokenizer is None:
        raise bad_request(f"stop strings need a tokenizer, and {state.model_name} has none; use stop_token_ids",
                          "stop")
    k = _logprobs(state, req, chat)
    params = []
    for num_ids in lengths:
        if chat:
            max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                              max(1, engine.max_model_len - num_ids))   # OpenAI's default: the room left
        else:
            max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params += [_engine_check(req.sampling_params, max_tokens, k, j) for j in range(req.n)]
    samples = [ids for ids in prompts for _ in range(req.n)]
    if not LIMIT["waiting_requests"].admits(state.loop.num_waiting() + len(samples), max_waiting=state.max_waiting):
        raise APIError(429, f"the server's waiting queue is full ({state.max_waiting} requests); retry later",
                       code="queue_full")
    queue: asyncio.Queue = asyncio.Queue()
    future = state.loop.submit(Submission(samples, params, queue, asyncio.get_running_loop(), arrival,
                                          reuse=[reuse] * len(samples), num_prompt_tokens=prompt_tokens * req.n))
    try:
        request_ids = await asyncio.wrap_future(future)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), ("messages" if chat else "chunkwise.prompt") if composite else None) from None
    except RuntimeError as e:
        raise APIError(503, str(e)) from None
    except asyncio.CancelledError:   # the client left before the engine took the request: abort once it has
        future.add_done_callback(lambda f: not f.cancelled() and f.exception() is None
                                 and state.loop.abort(f.result()))
        raise
    choices = [_Choice(i, rid) for i, rid in enumerate(request_ids)]
    reply = _Reply(state, req, chat, choices, queue, prompt_tokens, composite)
    if req.stream:
        return _AbortingStream(reply)
    return await reply.collect(request)


class _AbortingStream(StreamingResponse):
    """A streamed reply that, however it ends (done, failed, the client gone, even before the first event was
    sent), aborts its samples still running, so their pages are freed at once."""

    def __init__(self, reply: "_Reply"):
        super().__init__(reply.stream(), media_type="text/event-stream")
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reply.state.loop.abort(self.reply.running_ids())


def _engine_check(make, *args, param: str | None = None):
    """The engine's own validation errors (TypeError/ValueError naming the value) as 400s."""
    try:
        return make(*args)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), param) from None


def _composite(state: ServerState, req: CompletionRequest) -> tuple[list, str | Blend, int]:
    """The `chunkwise` extension's composite prompt (its pieces: Chunk handles, text, token ids), its reuse and
    its number of tokens; a 400 (404 for an unknown chunk) naming the field otherwise."""
    ext, engine = req.chunkwise, state.engine
    if req.prompt not in (None, "", []):
        raise bad_request("give the prompt as `prompt` or as `chunkwise.prompt`, not both: with `chunkwise`, `prompt` "
                          "must be absent, null or empty", "prompt")
    pieces = [_piece(state, p, f"chunkwise.prompt[{j}]") for j, p in enumerate(ext.prompt)]
    if not any(isinstance(p, Chunk) for p in pieces):
        raise bad_request('chunkwise.prompt must hold at least one {"chunk": ...} piece (a prompt of text and ids '
                          'alone goes in `prompt`)', "chunkwise.prompt")
    ids, _ = _engine_check(engine.chunks.pieces, pieces, engine.tokenizer, 0, param="chunkwise.prompt")
    return pieces, _reuse(engine, ext), len(ids)


def _piece(state: ServerState, p, where: str):
    """One piece of a composite prompt or a context: a registered Chunk for `{"chunk": "chunk-<n>"}` (a 404 naming
    an unknown one), text or token ids as given; a 400 naming `where` otherwise."""
    if isinstance(p, dict) and set(p) == {"chunk"} and isinstance(p["chunk"], str):
        chunk = state.chunks.get(p["chunk"])
        if chunk is None:
            raise APIError(404, f"{where}: the chunk `{p['chunk']}` does not exist (register it with POST "
                                f"/v1/chunks)", where + ".chunk", "chunk_not_found")
        return chunk
    if isinstance(p, str) or (isinstance(p, list) and all(is_int(t) for t in p)):
        return p
    raise bad_request(f'{where} must be {{"chunk": "chunk-<n>"}}, text or a list of token ids, got {p!r:.80}', where)


def _after(state: ServerState, after) -> list:
    """POST /v1/chunks' `after`: one piece or a list of pieces (as `_piece`), checked by the engine's registry
    (text without a tokenizer, empty, outside the vocabulary) before the engine sees it; a 400 naming it."""
    one = not isinstance(after, list) or all(is_int(t) for t in after)
    pieces = [_piece(state, after, "after")] if one else [_piece(state, p, f"after[{j}]") for j, p in
                                                          enumerate(after)]
    engine = state.engine
    _engine_check(engine.chunks.context, pieces, engine.tokenizer, engine.model_config.vocab_size, param="after")
    return pieces


def _reuse(engine, ext: ReuseOptions | None) -> str | Blend:
    """The `chunkwise` extension's reuse mode ("exact" without one); a 400 naming the field otherwise."""
    if ext is None or ext.reuse == "exact":
        for name in ("recompute_ratio", "policy"):
            if ext is not None and getattr(ext, name) is not None:
                raise bad_request(f'chunkwise.{name} applies to reuse="blend" only, and reuse is "exact"',
                                  f"chunkwise.{name}")
        return "exact"
    given = {k: getattr(ext, k) for k in ("recompute_ratio", "policy") if getattr(ext, k) is not None}
    try:
        blend = replace(blend_params("blend"), **given)   # the fields given override DEFAULT_BLEND's
    except ValueError as e:
        bad_policy = ext.policy is not None and ext.policy not in BLEND_POLICIES
        raise bad_request(str(e), "chunkwise.policy" if bad_policy else "chunkwise.recompute_ratio") from None
    # the engine's own refusal (no prefix caching, tensor parallelism), checked on its immutable config
    _engine_check(engine.check_blend, blend, 0, param="chunkwise.reuse")
    return blend


def _completion_prompts(engine, req: CompletionRequest) -> list[list[int]]:
    prompts = req.prompts()
    if engine.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise bad_request("this model has no tokenizer: give the prompt as token ids", "prompt")
    return _engine_check(encode_prompts, prompts, engine.tokenizer, engine.model_config)


def _chat_template(state: ServerState):
    """The tokenizer, if it has a chat template; else a 400."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request(f"the model {state.model_name} has no chat template in its tokenizer (checkpoint "
                          f"{state.engine.engine_config.path}); use /v1/completions", "messages")
    return tokenizer


def _chat_chunks(state: ServerState, req: ChatCompletionRequest):
    """A chat with chunk parts as a composite prompt (chat.py); a 400 naming the bad part or field."""
    tokenizer = _chat_template(state)
    if not has_chunk_parts(req.messages):
        raise bad_request('chunkwise applies to a chat with {"type": "chunk"} content parts, and these messages '
                          'have none', "chunkwise")
    return splice_chat(tokenizer, req.messages, state.chunks)


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[list[int]]:
    tokenizer = _chat_template(state)
    messages = req.chat()
    try:
        return [chat_prompt(tokenizer, messages)]
    except Exception as e:   # the template itself may refuse a conversation (e.g. roles out of order)
        raise bad_request(f"the chat template could not format these messages: {type(e).__name__}: {e}",
                          "messages") from None


def _logprobs(state: ServerState, req, chat: bool) -> int | None:
    """How many top logprobs each token gets, or None for none."""
    if chat:
        k, name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        k, name = req.logprobs, "logprobs"
    if k is not None and not LIMIT["server_logprobs"].admits(k, max_logprobs=state.max_logprobs):
        raise bad_request(f"{name} must be between 0 and {state.max_logprobs}, got {k}", name)
    return k


class _Reply:
    """The answer to one HTTP request, from its samples' outputs: collected whole, or streamed as events."""

    def __init__(self, state: ServerState, req, chat: bool, choices: list[_Choice], queue: asyncio.Queue,
                 prompt_tokens: int, composite: bool = False):
        self.state, self.req, self.chat, self.choices, self.queue = state, req, chat, choices, queue
        self.prompt_tokens = prompt_tokens
        self.composite = composite   # each choice reports chunk_reuse
        self.k = _logprobs(state, req, chat)
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.tokenizer = state.engine.tokenizer
        self.offsets = [0] * len(choices)   # completions' text_offset: characters of token text so far
        # every streamed event's JSON up to its choices, as json.dumps writes it: only the choices vary
        head = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": state.model_name}
        self._head = "data: " + json.dumps(head)[:-1] + ', "choices": ['

    # ---- driving -------------------------------------------------------------------------------------
    async def _next(self):
        """The next (choice, piece, pairs)."""
        index, out = await self.queue.get()
        choice = self.choices[index]
        piece, pairs = choice.feed(out)
        return choice, piece, pairs

    def running_ids(self) -> list[int]:
        return [c.request_id for c in self.choices if c.finish_reason is None]

    def _open(self) -> bool:
        """Whether some choice still waits for an output."""
        return any(c.finish_reason is None for c in self.choices)

    def _failed(self) -> _Choice | None:
        return next((c for c in self.choices if c.finish_reason == "error"), None)

    def _error(self, failed: _Choice) -> APIError:
        return APIError(500, f"the request failed inside an engine step: {failed.error}")

    async def collect(self, request: Request):
        task = asyncio.ensure_future(self._collect_all())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():   # the client left: nobody will read the answer
                task.cancel()
                return Response(status_code=499)
            failed = self._failed()
            if failed is not None:
                raise self._error(failed)
            return self._whole()
        finally:
            gone.cancel()
            self.state.loop.abort(self.running_ids())

    async def _collect_all(self) -> None:
        while self._open() and self._failed() is None:
            await self._next()

    async def stream(self):
        """The events; whatever is still running when they end is aborted by `_AbortingStream`."""
        if self.chat:   # the role first, as OpenAI sends it
            for c in self.choices:
                role = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield self._event([json.dumps(role)])
        while self._open():
            choice, piece, pairs = await self._next()
            if choice.finish_reason == "error":   # the others are aborted
                yield f"data: {json.dumps(self._error(choice).body())}\n\n"
                break
            # one event per engine output, text or not, so a client sees each token's arrival
            yield self._event([self._choice_json(choice, piece, pairs, choice.finish_reason)])
        else:
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._event([], usage=self._usage())
        yield "data: [DONE]\n\n"

    # ---- shapes --------------------------------------------------------------------------------------
    def _usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices))

    def _whole(self) -> dict:
        choices = []
        for c in self.choices:
            lp = self._logprobs(c, c.logprobs) if self.k is not None else None
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
            if self.composite:
                choices[-1]["chunk_reuse"] = c.chunk_reuse
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices,
                "usage": self._usage()}

    def _choice_json(self, c: _Choice, piece: str, pairs, finish_reason) -> str:
        """One streamed choice, {"index", "delta" (chat: {"content"}) or "text", "logprobs", "finish_reason"[,
        "chunk_reuse"]}, written as json.dumps writes that dict but without building it: this runs per token."""
        lp = json.dumps(self._logprobs(c, pairs)) if self.k is not None and pairs else "null"
        reason = "null" if finish_reason is None else _json_str(finish_reason)
        reuse = f', "chunk_reuse": {json.dumps(c.chunk_reuse)}' if self.composite and finish_reason is not None else ""
        if self.chat:
            return (f'{{"index": {c.index}, "delta": {{"content": {_json_str(piece)}}}, "logprobs": {lp}, '
                    f'"finish_reason": {reason}{reuse}}}')
        return f'{{"index": {c.index}, "text": {_json_str(piece)}, "logprobs": {lp}, "finish_reason": {reason}{reuse}}}'

    def _event(self, choices: list[str], usage: dict | None = None) -> str:
        """The SSE event of a chunk {"id", "object", "created", "model", "choices"[, "usage"]} whose choices are
        given as JSON text."""
        tail = "]" if usage is None else f'], "usage": {json.dumps(usage)}'
        return f"{self._head}{', '.join(choices)}{tail}}}\n\n"

    def _token(self, token_id: int) -> str:
        # Without a tokenizer a token is named by its id, in vLLM's "token_id:N" form.
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _top(self, lps: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lps.items(), key=lambda kv: -kv[1])[:self.k]

    def _logprobs(self, c: _Choice, pairs) -> dict:
        if self.chat:
            def entry(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
            return {"content": [{**entry(t, lps[t]), "top_logprobs": [entry(u, v) for u, v in self._top(lps)]}
                                for t, lps in pairs]}
        tokens = [self._token(t) for t, _ in pairs]
        offsets = []
        for s in tokens:
            offsets.append(self.offsets[c.index])
            self.offsets[c.index] += len(s) if self.tokenizer is not None else 0   # no tokenizer: no text
        return {"tokens": tokens, "token_logprobs": [lps[t] for t, lps in pairs],
                "top_logprobs": [{self._token(u): v for u, v in self._top(lps)} for _, lps in pairs],
                "text_offset": offsets}


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
