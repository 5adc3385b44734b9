"""What a caller of the engine core checks a request with: config, tokenizer, validation, the chunk registry.

`Frontend` is built by the engine and is picklable (its tokenizer is reloaded from the checkpoint on the other side),
so the server validates with the very code the engine uses: `requests` turns prompts into the `Request`s the core
queues, `chunk_job` says what registering a chunk must compute, and the registry issues the `Chunk` handles once the
core has computed (and pinned) them. The core never sees text or handles, only token ids.
"""
from __future__ import annotations

from chunkwise.chunks import NO_CONTEXT, Chunk, ChunkContext, ChunkRegistry
from chunkwise.engine_config import EngineConfig
from chunkwise.requests import Request, validate_requests
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import load_tokenizer

PREFIX_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)   # a prefix job's fit: its prompt, nothing after


def check_blend(config: EngineConfig, blend, index: int = 0) -> None:
    """ValueError naming what keeps an engine of this config from serving reuse=`blend` (prompt `index`)."""
    reason = config.blend_refusal()
    if reason is not None:
        raise ValueError(f"prompt {index}: reuse={blend!r} {reason}")


class Frontend:
    """One engine's request validation and chunk registry, usable in any process."""

    def __init__(self, config: EngineConfig, tokenizer, chunks: ChunkRegistry):
        self.engine_config = config
        self.model_config, self.max_model_len = config.model_config, config.max_model_len
        self.tokenizer = tokenizer
        self.chunks = chunks

    def __getstate__(self) -> dict:
        return {"config": self.engine_config, "chunks": self.chunks}

    def __setstate__(self, state: dict) -> None:
        config = state["config"]
        self.__init__(config, load_tokenizer(config.path), state["chunks"])

    def requests(self, prompts, sampling_params=None, chunk_sizes=None, reuse="exact") -> list[Request]:
        """The batch's validated requests; TypeError/ValueError naming the bad value (nothing is queued)."""
        requests = validate_requests(self.model_config, self.tokenizer, self.max_model_len, prompts, sampling_params,
                                     chunk_sizes, reuse, self.chunks)
        for i, r in enumerate(requests):
            if r.params.stop and self.tokenizer is None:
                raise ValueError(f"prompt {i}: stop strings {list(r.params.stop)!r:.80} need a tokenizer, and "
                                 f"{self.engine_config.path} has none; use stop_token_ids")
            if r.reuse != "exact":
                self.check_blend(r.reuse, i)
        return requests

    def check_blend(self, blend, index: int = 0) -> None:
        """ValueError naming what keeps this engine from serving reuse=`blend` (prompt `index` of a batch);
        reads the config only, so a server may ask before queueing anything."""
        check_blend(self.engine_config, blend, index)

    def chunk_job(self, prompt, pin, after=None) -> tuple[list[int], ChunkContext, Request | None]:
        """A chunk to register after the context `after`: its ids, its context, and the request whose prefix the
        core must compute, context then chunk (None when they fill no page, or the prefix cache is off: the chunk
        is only a handle)."""
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        ids = self.chunks.chunk_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        context = self.chunks.context(after, self.tokenizer, self.model_config.vocab_size)
        caching = self.engine_config.enable_prefix_caching
        if pin and not caching:
            raise ValueError("register_chunk(pin=True) needs enable_prefix_caching=True: pinned pages are "
                             "prefix-cache pages")
        try:   # context and chunk fit the model
            request = self.requests([list(context.token_ids) + ids], PREFIX_PARAMS)[0]
        except ValueError as e:
            if not context.token_ids:
                raise
            raise ValueError(f"after ({len(context)} tokens) and the chunk: {e}") from None
        if not caching or len(request.prompt_token_ids) < self.engine_config.page_size:
            return ids, context, None
        return ids, context, request

    def issue(self, ids: list[int], pinned: list[int] | None, context: ChunkContext = NO_CONTEXT) -> Chunk:
        """The handle of a registered chunk (a variant after `context`); `pinned`: the pages its pin holds (None:
        not pinned)."""
        chunk = self.chunks.issue(ids, context)
        if pinned is not None:
            self.chunks.pinned[chunk.chunk_id] = pinned
        return chunk

    def unpin(self, chunk) -> list[int]:
        """The pages a pinned chunk held, which the core unpins; ValueError if it is not pinned here."""
        self.chunks.check_pinned(chunk)
        return self.chunks.pinned.pop(chunk.chunk_id)
