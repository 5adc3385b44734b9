"""OpenAI's request fields and response shapes, and its error object.

Requests are pydantic models in strict mode with unknown fields forbidden: a wrong type or an unrecognised
field is a 400 naming the field. Fields OpenAI defines that this server does not implement are accepted only at
their defaults (a value that would change the output is a 400 naming the field), so a client never gets an answer
that silently ignored what it asked. Extensions, as vLLM's server has them: `top_k`, `ignore_eos`,
`stop_token_ids`; and chunkwise's own, namespaced: a completion's `chunkwise` object (a composite prompt of
registered chunks, text and ids, and its reuse mode: `ChunkwiseOptions`) and a chat's (its reuse mode:
`ReuseOptions`; its chunks are `{"type": "chunk"}` content parts), answered with `chunk_reuse` per choice,
and the chunk registry's request (`ChunkRequest`, for /v1/chunks). Responses are plain dicts in OpenAI's shapes
(`text_completion`, `chat.completion`, their streamed chunks, `list` of models), and `chunk` for a registered chunk.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from chunkwise.chunks import Chunk
from chunkwise.limits import LIMIT
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import all_ints, is_single_prompt

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An HTTP error with OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0                 # OpenAI's default: sampling, not greedy
    top_p: float = 1.0
    top_k: int = 0                           # extension; 0 or -1 keeps every token
    seed: int | None = None
    stop: Any = None                         # a string or a list of strings (checked by `stop_strings`)
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False                 # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                  # accepted, unused
    # OpenAI's, not implemented: only their defaults are accepted
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise bad_request(f"{name} is not supported by this server (only 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if not LIMIT["n"].admits(self.n):
            raise bad_request(f"n must be an integer >= {LIMIT['n'].lower}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def stop_strings(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request(f"stop must be a string or a list of strings, got {stop!r:.80}", "stop")
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """The engine's params for the index-th of n samples: with a seed, sample i draws from seed + i (as vLLM
        does), so n > 1 with a seed gives n different, reproducible samples. A bad value is the engine's own
        TypeError/ValueError naming it."""
        if not LIMIT["openai_top_k"].above_lower(self.top_k):   # the vocabulary's side: the engine's own check
            raise ValueError(f"top_k must be -1 (every token) or an integer >= 0, got {self.top_k}")
        top_k = 0 if self.top_k == -1 else self.top_k
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=top_k, top_p=self.top_p,
                              seed=None if self.seed is None else self.seed + index, logprobs=logprobs,
                              ignore_eos=self.ignore_eos, stop_token_ids=tuple(self.stop_token_ids or ()),
                              stop=tuple(self.stop_strings()))


class ReuseOptions(BaseModel):
    """A chat's `chunkwise` extension (its chunks are content parts): how cached K/V may be reused."""
    model_config = ConfigDict(extra="forbid", strict=True)
    reuse: Literal["exact", "blend"] = "exact"
    recompute_ratio: float | None = None     # blend only; default DEFAULT_BLEND's
    policy: str | None = None                # blend only: "kv-deviation", "chunk-heads" or "adaptive"; default DEFAULT_BLEND's


class ChunkwiseOptions(ReuseOptions):
    """A completion's `chunkwise` extension: its prompt composed of pieces, and how cached K/V may be reused."""
    prompt: list[Any]                        # pieces: {"chunk": "chunk-<n>"}, text, or a list of token ids


class ChunkRequest(BaseModel):
    """POST /v1/chunks: register text or token ids as a chunk, pinned or not, computed after a context or not."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: Any                  # text or a list of token ids (checked by the engine, naming the value)
    pin: bool = False
    after: Any = None            # the context: {"chunk": "chunk-<n>"}, text, ids, or a list of those


class CompletionRequest(_GenerationRequest):
    prompt: Any = None           # a string, a list of token ids, or a list of either (checked by `prompts`);
                                 # absent or empty when `chunkwise` gives the prompt
    chunkwise: ChunkwiseOptions | None = None   # extension
    logprobs: int | None = None  # top logprobs per token, besides the chosen token's
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request(f"best_of is not supported by this server (only best_of == n), got {self.best_of}",
                              "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string or a list of token ids is one prompt; a list of those is a batch."""
        p = self.prompt
        if p is None:
            raise bad_request("prompt is required", "prompt")
        # at C speed (all_ints): a prompt of thousands of ids is checked on the event loop, which meanwhile streams no
        # token
        if is_single_prompt(p):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and all_ints(x)) for x in p):
            return p
        raise bad_request(f"prompt must be a string, a list of token ids, or a non-empty list of those; got "
                          f"{p!r:.80}", "prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    text: str | None = None
    chunk: str | None = None     # extension: {"type": "chunk", "chunk": "chunk-<n>"} (chunkwise/serve/chat.py)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    name: str | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"content part type {part.type!r} is not supported by this server (only text and "
                                  f"chunk)",
                                  f"messages[{index}].content[{j}].type")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chunkwise: ReuseOptions | None = None    # extension: reuse of the chunk parts' K/V
    # OpenAI's, not implemented
    tools: list | None = None
    tool_choice: Any = None
    response_format: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("tools", "tool_choice", "response_format"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported by this server", name)
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """The request, or a 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"]).lstrip(".") or None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param) from None
        if err["type"] == "missing":
            raise bad_request(f"{param} is required", param) from None
        raise bad_request(f"{param}: {err['msg']}, got {err.get('input')!r:.80}", param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk_name(chunk: Chunk) -> str:
    return f"chunk-{chunk.chunk_id}"


def chunk_card(chunk: Chunk, pinned: bool) -> dict:
    return {"id": chunk_name(chunk), "object": "chunk", "num_tokens": len(chunk), "pinned": pinned,
            "context_tokens": len(chunk.context)}


def reuse_card(r) -> dict:
    """One piece's `chunkwise.ChunkReuse` as the response's `chunk_reuse` entry."""
    return {"chunk": None if r.chunk is None else chunk_name(r.chunk), "num_tokens": r.num_tokens, "exact": r.exact,
            "blended": r.blended, "recomputed": r.recomputed,
            "context_tokens": None if r.context is None else len(r.context)}   # the blended variant's context


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "chunkwise", "root": name,
            "max_model_len": max_model_len}
