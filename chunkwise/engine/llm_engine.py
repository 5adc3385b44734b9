"""chunkwise.Engine: the library facade over the engine core, behind the interface both engines share.

`generate` for batches; `add_request` / `step` / `abort` for streaming. The engine's `Frontend`
(chunkwise/engine/frontend.py) validates every request in full before any of it reaches the core, so a bad request
never disturbs the others; the `EngineCore` (chunkwise/engine/core.py) schedules, runs and postprocesses steps in
token ids; the `OutputProcessor` (chunkwise/engine/outputs.py) turns them into text and hands each to the call waiting
for it. If a step's forward or sampling raises, the step's requests finish with finish_reason "error" (the exception
kept on their outputs), their pages are freed, and the engine goes on as if they had never run. One lock serialises
the public calls, so threads may share an engine; a call that steps the core (`generate`, `register_chunk`,
`prefill_kv`) leaves the outputs of requests queued by `add_request` for the next `step()`.

`tensor_parallel_size=N` shards the model over N ranks: this process is rank 0 (it schedules, samples and
postprocesses as with one device) and starts N-1 worker processes (chunkwise/engine/executor/workers.py). The core
talks only to its executor (chunkwise/engine/executor/executor.py), the same calls on one device or N. A failure
inside a step's forward cannot be contained there (the ranks' caches may disagree): the engine closes and raises
TensorParallelError. `close()` (or `with Engine(...) as eng:`) stops the workers; an engine that is garbage
collected, or still open at interpreter exit, stops them too.

Overlap scheduling (`async_scheduling`, on by default with CUDA) lives in the core: under it, `step()` returns what
the step before got, once this one is launched. An abort drops the request's token in flight: its output holds the
tokens streamed so far.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from chunkwise.chunks import Chunk, ChunkRegistry
from chunkwise.engine_config import EngineConfig
from chunkwise.open_config import open_config
from chunkwise.requests import single_prompt
from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.tokenizer import load_tokenizer
from chunkwise.engine.core import EngineCore, EngineStats, PrefixOutput
from chunkwise.engine.frontend import PREFIX_PARAMS, Frontend, check_blend
from chunkwise.engine.model import Model
from chunkwise.engine.outputs import OutputProcessor, StepOutput

__all__ = ["Engine", "StepOutput", "check_blend"]

TQDM_MIN_PROMPTS = 16   # progress bars only for batches worth watching


class Engine:
    """The shared interface plus the paging knobs of `EngineConfig` (page pool size, per-step token budget,
    running-sequence cap, prefix caching, CUDA graphs, split-KV threshold and split size)."""

    # What runs the steps' forward: a subclass may set a stand-in with Model's constructor and forward, on one
    # device (chunkwise/engine/stand_in_model.py: the host's work alone, as benchmarks/bench_host.py times it).
    model_class: type = Model

    def __init__(self, model, **kwargs):
        self.engine_config = config = open_config(EngineConfig(model, **kwargs))
        self.model_config, self.dtype, self.device = config.model_config, config.dtype, config.device
        self.max_model_len, self.page_size = config.max_model_len, config.page_size
        tokenizer = load_tokenizer(config.path)
        self.frontend = Frontend(config, tokenizer, ChunkRegistry("chunkwise.Engine"))
        self.core = EngineCore(config, self.model_class)
        self.outputs = OutputProcessor(self.frontend)
        self._lock = threading.RLock()
        self._turn_check = None   # hand_over's

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        """One tokenizer for both sides: what validation encodes with is what the outputs decode with."""
        self.frontend.tokenizer = tokenizer

    @property
    def chunks(self) -> ChunkRegistry:
        return self.frontend.chunks

    @property
    def executor(self):
        return self.core.executor

    @property
    def page_pool(self):
        return self.core.page_pool

    @property
    def scheduler(self):
        return self.core.scheduler

    # ---- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the tensor-parallel workers, if any, and frees the KV cache and weights; later calls to
        generate, add_request, step or prefill_kv raise RuntimeError. Closing twice is harmless."""
        with self._lock:
            self.core.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hand_over(self, check: Callable[[str], None] | None) -> None:
        """Another driver steps this engine's core from now on (a server's engine thread): each call that steps or
        changes it first calls `check(name of the call)`, which raises when the caller may not. None: the
        caller's again."""
        self._turn_check = check

    def _check_turn(self, call: str) -> None:
        if self._turn_check is not None:
            self._turn_check(call)

    # ---- requests ----------------------------------------------------------------------------------
    def check_blend(self, blend, index: int = 0) -> None:
        """ValueError naming what keeps this engine from serving reuse=`blend` (prompt `index` of a batch);
        reads the config only, so a server may ask before queueing anything."""
        self.frontend.check_blend(blend, index)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, chunk_sizes=None,
                    reuse: str = "exact") -> int:
        """Queue one prompt (plain, or composite: chunkwise/chunks.py); returns its request id. Tokens arrive
        through `step`."""
        self._check_turn("add_request")
        with self._lock:
            self.core.check_open()
            request = self.frontend.requests(single_prompt(prompt), sampling_params, [chunk_sizes], reuse)[0]
            rid = self.core.add_requests([request])[0]
            self.outputs.add(rid, request.pieces, stream=True, stop=request.params.stop)
            return rid

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request and free its pages; returns its output (the tokens so far, finish_reason "abort"),
        or None if it had already finished. Under overlap scheduling its token in flight is dropped: the output
        holds the tokens `step` has returned."""
        self._check_turn("abort")
        with self._lock:
            final = self.outputs.ended(self.core.abort(request_id), request_id)
            return None if final is None else final.output

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def stats(self) -> EngineStats:
        """The core's queues and pages, now."""
        return self.core.stats()

    # ---- chunks ------------------------------------------------------------------------------------
    def register_chunk(self, prompt, pin: bool = False, after=None) -> Chunk:
        """A handle to `prompt` (text, tokenized without special tokens, or token ids) for composite prompts.

        Its K/V are computed once, as the continuation of the context `after` (None: as the opening of a prompt,
        positions 0 .. n-1; else ids as a composite prompt gives them, e.g. a chat head and system prompt:
        chunkwise/chunks.py), and the full pages of context + chunk kept in the prefix cache: exact wherever a
        prompt opens with them, and blend mode's variant for that context (docs/ARCHITECTURE.md, "Blend mode").
        `pin=True` keeps those pages out of LRU eviction until `unpin`; pinned pages are at most
        `max_pinned_fraction` of the pool, and a pin leaving some queued request no room is refused too
        (ValueError; no handle is issued, the computed pages stay evictable). Context and chunk shorter than a page
        fill no page: the chunk is only a handle."""
        self._check_turn("register_chunk")
        with self._lock:
            self.core.check_open()
            ids, context, request = self.frontend.chunk_job(prompt, pin, after)
            if request is None:
                return self.frontend.issue(ids, [] if pin else None, context)
        done = self._compute_prefix(request, pin=pin)
        if done.error is not None:
            raise RuntimeError(f"register_chunk: computing the chunk failed: {done.error}")
        if done.refused is not None:
            raise done.refused
        with self._lock:
            return self.frontend.issue(ids, done.pinned if pin else None, context)

    def unpin(self, chunk: Chunk) -> None:
        """Let a pinned chunk's pages be evicted again (they stay cached until then)."""
        self._check_turn("unpin")
        with self._lock:
            self.core.unpin(self.frontend.unpin(chunk))

    def prefill_kv(self, prompt, chunk_sizes=None, reuse="exact") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of the prompt as this engine cached them
        (after k-norm and RoPE), gathered from its own pages."""
        self._check_turn("prefill_kv")
        with self._lock:
            self.core.check_open()
            request = self.frontend.requests(single_prompt(prompt), PREFIX_PARAMS, [chunk_sizes], reuse)[0]
        done = self._compute_prefix(request, gather_kv=True)
        if done.error is not None:
            raise RuntimeError(f"prefill_kv: the request failed: {done.error}")
        return done.kv

    def _compute_prefix(self, request, gather_kv: bool = False, pin: bool = False) -> PrefixOutput:
        """Steps the core until its prefix job for `request` is done (other requests advance too)."""
        with self._lock:
            rid = self.core.compute_prefix(request, gather_kv=gather_kv, pin=pin)
            mine: list[PrefixOutput] = []
            self.outputs.add(rid, sink=mine)
        try:
            while not mine:
                with self._lock:
                    self._step()
            return mine[0]
        finally:
            if not mine:   # interrupted: nothing of it stays behind
                with self._lock:
                    self.outputs.forget(rid)
                    self.core.abort(rid)

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One scheduler step: a forward over the batch, sampling, bookkeeping. Returns what each request queued by
        `add_request` got (with its new text), this step or while another call stepped the engine; under overlap
        scheduling, what the step before got, once this one is launched."""
        self._check_turn("step")
        with self._lock:
            self._step()
            return self.outputs.take_unclaimed()

    def _step(self) -> None:
        """One core step, its outputs processed; a request a stop string ended is aborted in the core at once, and
        its abort's output finishes it."""
        self.outputs.process(self.core.step())
        for rid in self.outputs.take_stopped():
            out = self.core.abort(rid)
            if out is not None:
                self.outputs.process([out])

    def generate(self, prompts, sampling_params=None, chunk_sizes=None, use_tqdm=None,
                 reuse="exact") -> list[RequestOutput]:
        """Run prompts to completion (other queued requests advance too); outputs in prompt order. A prompt may
        be composite (a list holding registered Chunks, text and id lists: chunkwise/chunks.py); `reuse` is
        "exact" (or one per prompt)."""
        self._check_turn("generate")
        mine: list[StepOutput] = []
        with self._lock:
            self.core.check_open()
            requests = self.frontend.requests(prompts, sampling_params, chunk_sizes, reuse)
            rids = self.core.add_requests(requests)
            for rid, request in zip(rids, requests):
                self.outputs.add(rid, request.pieces, sink=mine, stop=request.params.stop)
        show = len(rids) >= TQDM_MIN_PROMPTS if use_tqdm is None else use_tqdm
        done: dict[int, RequestOutput] = {}
        generated = 0
        try:
            with tqdm(total=len(rids), desc="chunkwise.Engine.generate", unit="req", disable=not show,
                      leave=False, delay=0.5, miniters=0) as bar:
                while len(done) < len(rids):
                    finished = len(done)
                    with self._lock:
                        self._step()
                        for o in mine:
                            generated += len(o.new_token_ids)
                            if o.finished:
                                done[o.request_id] = o.output
                        mine.clear()
                    # The count first, then update, which redraws (miniters=0: after any step, at most every
                    # mininterval, and after the last step always): every frame, the last too, shows the count.
                    bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
                    if len(done) == len(rids):
                        bar.mininterval = 0
                    bar.update(len(done) - finished)
        finally:
            with self._lock:
                for r in rids:
                    if r not in done:   # interrupted: nothing of it stays behind (None if it had ended)
                        self.outputs.forget(r)
                        self.core.abort(r)
        return [done[r] for r in rids]
