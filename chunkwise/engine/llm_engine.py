"""chunkwise.Engine: the paged, chunked-prefill engine behind the interface both engines share.

`generate` for batches; `add_request` / `step` / `abort` for streaming. Every request is validated in
full before any of it touches the scheduler, so a bad request never disturbs the others. A step is
schedule -> run -> postprocess over one `ScheduledBatch`; if the forward or sampling raises, the step's
requests finish with finish_reason "error" (the exception kept on their outputs), their pages are freed,
and the engine goes on as if they had never run. One lock serialises the public calls, so threads may
share an engine.

`tensor_parallel_size=N` shards the model over N ranks: this process is rank 0 (it schedules, samples and
postprocesses as with one device) and starts N-1 worker processes (chunkwise/engine/executor/workers.py). The engine
talks only to its executor (chunkwise/engine/executor/executor.py), the same calls on one device or N. A failure
inside a step's forward cannot be contained there (the ranks' caches may disagree): the engine closes and raises
TensorParallelError. `close()` (or `with Engine(...) as eng:`) stops the workers; an engine that is garbage
collected, or still open at interpreter exit, stops them too.

Overlap scheduling (`async_scheduling`, on by default with CUDA): a step's postprocess waits until the
next step is launched, so the host schedules and prepares step k+1 while the device runs step k. Step
k's sampled tokens stay on the device and feed k+1 there (see `HostStep`). A sequence that step k
finishes has computed one more token in k+1 in vain: it is dropped, and its pages were freed when k
finished. Steps that sample with a generator or return logprobs are postprocessed at once (their token
must be drawn on the host before the next step can read it). An abort drops the request's token in
flight: its output holds the tokens streamed so far.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from chunkwise.chunks import Chunk, ChunkRegistry, reuse_report
from chunkwise.engine_config import EngineConfig
from chunkwise.limits import LIMIT, pin_cap
from chunkwise.open_config import open_config
from chunkwise.requests import single_prompt, validate_requests
from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.tokenizer import TextStream, decode, load_tokenizer
from chunkwise.engine.blend import Blender
from chunkwise.engine.host_step import Launched
from chunkwise.engine.model import Model
from chunkwise.engine.page_pool import PagePool
from chunkwise.engine.executor.executor import Executor, MultiprocExecutor
from chunkwise.engine.executor.workers import TensorParallelError
from chunkwise.engine.scheduler import ScheduledBatch, Scheduler
from chunkwise.engine.sequence import Sequence

TQDM_MIN_PROMPTS = 16   # progress bars only for batches worth watching


@dataclass
class StepOutput:
    """What one step did for one request: its new token (with logprobs if asked) and, once it finished,
    the reason and the whole output."""
    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None     # set once finished
    # A request queued by add_request, with a tokenizer: the text its tokens so far complete (TextStream); joined
    # over its steps, its output's text.
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Step(NamedTuple):
    """A launched step awaiting its postprocess: what was scheduled and what the executor launched."""
    batch: ScheduledBatch
    launched: Launched

    @property
    def can_overlap(self) -> bool:
        """Its tokens can feed the next step on the device: greedy, and no logprobs to compute from its logits."""
        return not self.launched.needs_logits


def check_blend(config: EngineConfig, blend, index: int = 0) -> None:
    """ValueError naming what keeps an engine of this config from serving reuse=`blend` (prompt `index`)."""
    if not config.enable_prefix_caching:
        raise ValueError(f"prompt {index}: reuse={blend!r} needs enable_prefix_caching=True: a chunk's own K/V are "
                         f"kept in the prefix cache")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"prompt {index}: reuse={blend!r} is not supported with tensor_parallel_size="
                         f"{config.tensor_parallel_size} (blended prefills run on one device)")


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
        self.tokenizer = load_tokenizer(config.path)
        self._closed: str | None = None                      # why the engine takes no more work, once closed
        executor = Executor if config.tensor_parallel_size == 1 else MultiprocExecutor
        self.executor = executor(config, self.model_class)
        self.page_pool = PagePool(self.executor.num_pages, config.page_size, config.enable_prefix_caching)
        self.blender = Blender(self.model_config.num_layers)   # blended prefills' plans and reports
        self.scheduler = Scheduler(config, self.page_pool, self.model_config.eos_token_ids, row_planner=self.blender)
        self.chunks = ChunkRegistry("chunkwise.Engine")       # registered chunks, and the pages of pinned ones
        self._claims: dict[int, list[StepOutput]] = {}       # outputs collected by a generate/prefill_kv call
        self._backlog: list[StepOutput] = []                 # streamed requests' outputs made inside those calls
        self._texts: dict[int, TextStream] = {}              # streamed requests' text so far, with a tokenizer
        self._num_ids = 0                                    # request ids handed out: 0 .. _num_ids - 1
        self._in_flight: _Step | None = None                 # launched, not yet postprocessed (overlap only)
        self._lock = threading.RLock()

    # ---- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the tensor-parallel workers, if any, and frees the KV cache and weights; later calls to
        generate, add_request, step or prefill_kv raise RuntimeError. Closing twice is harmless."""
        with self._lock:
            self._close("close() was called")

    def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
            self.executor.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError(f"this Engine is closed ({self._closed})")

    # ---- requests ----------------------------------------------------------------------------------
    def _prepare(self, prompts, sampling_params, chunk_sizes, reuse="exact") -> list[Sequence]:
        """Validated sequences for a batch of prompts (nothing is scheduled yet)."""
        self._check_open()
        requests = validate_requests(self.model_config, self.tokenizer, self.max_model_len, prompts, sampling_params,
                                     chunk_sizes, reuse, self.chunks)
        for i, r in enumerate(requests):
            if r.reuse != "exact":
                self.check_blend(r.reuse, i)
        seqs = [Sequence.from_request(r) for r in requests]
        for i, seq in enumerate(seqs):   # the scheduler's own check, for the whole batch before any is added
            self.scheduler.check_fits(seq, name=f"prompt {i}")
        return seqs

    def check_blend(self, blend, index: int = 0) -> None:
        """ValueError naming what keeps this engine from serving reuse=`blend` (prompt `index` of a batch);
        reads the config only, so a server may ask before queueing anything."""
        check_blend(self.engine_config, blend, index)

    def _submit(self, seq: Sequence, check_fits: bool = True) -> int:
        rid = self._num_ids
        self._num_ids += 1
        seq.seq_id = rid
        if seq.sampling_params.logprobs is not None:
            seq.logprobs = []
        self.scheduler.add(seq, check_fits)
        return rid

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, chunk_sizes=None,
                    reuse: str = "exact") -> int:
        """Queue one prompt (plain, or composite: chunkwise/chunks.py); returns its request id. Tokens arrive
        through `step`."""
        with self._lock:
            rid = self._submit(self._prepare(single_prompt(prompt), sampling_params, [chunk_sizes], reuse)[0])
            if self.tokenizer is not None:
                self._texts[rid] = TextStream(self.tokenizer)
            return rid

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request and free its pages; returns its output (the tokens so far, finish_reason "abort"),
        or None if it had already finished. Under overlap scheduling its token in flight is dropped: the output
        holds the tokens `step` has returned."""
        with self._lock:
            if not isinstance(request_id, int) or not 0 <= request_id < self._num_ids:
                raise ValueError(f"no request with id {request_id!r}")
            seq = self.scheduler.abort(request_id)
            self._texts.pop(request_id, None)
            if seq is None:
                return None
            final = self._ended(seq, "abort")
            if request_id in self._claims:
                self._claims[request_id].append(final)
            return final.output

    def _ended(self, seq: Sequence, reason: str) -> StepOutput:
        """The last StepOutput of a request ended outside sampling (abort, error): no new token."""
        return StepOutput(seq.seq_id, [], [] if seq.logprobs is not None else None, reason, self._finish(seq, reason))

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        """The finished request's output; the engine forgets it."""
        self.executor.release(seq.seq_id)
        return RequestOutput(seq.seq_id, list(seq.prompt_token_ids), token_ids=seq.completion_token_ids,
                             text=decode(self.tokenizer, seq.completion_token_ids), logprobs=seq.logprobs,
                             finish_reason=reason, num_cached_tokens=seq.num_cached_tokens, error=seq.error,
                             chunk_reuse=self.blender.pop_report(seq.seq_id)
                             or reuse_report(seq.pieces, seq.num_cached_tokens))

    # ---- chunks ------------------------------------------------------------------------------------
    def register_chunk(self, prompt, pin: bool = False) -> Chunk:
        """A handle to `prompt` (text, tokenized without special tokens, or token ids) for composite prompts.

        Its K/V are computed once, as the opening of a prompt (positions 0 .. n-1: exact wherever the chunk
        opens a prompt), and its full pages kept in the prefix cache. `pin=True` keeps those pages out of LRU
        eviction until `unpin`; pinned pages are at most `max_pinned_fraction` of the pool, and a pin leaving some
        queued request no room is refused too (ValueError; no handle is issued, the computed pages stay
        evictable). A chunk shorter than a page fills no page: it is only a handle."""
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        with self._lock:
            self._check_open()
            ids = self.chunks.chunk_ids(prompt, self.tokenizer, self.model_config.vocab_size)
            pool = self.page_pool
            if pin and not pool.enable_prefix_caching:
                raise ValueError("register_chunk(pin=True) needs enable_prefix_caching=True: pinned pages are "
                                 "prefix-cache pages")
            num_full = len(ids) // self.page_size
            if pin:   # before computing: pages not cached yet will be new pins
                cached = pool.chain_pages(ids)
                self._check_pin_cap(num_full - len(cached) + sum(1 for p in cached if p not in pool.pins))
            if num_full and pool.enable_prefix_caching:
                out = self.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
                if out.finish_reason == "error":
                    raise RuntimeError(f"register_chunk: computing the chunk failed: {out.error}")
            pages = pool.chain_pages(ids) if pin else []
            if pin:
                if len(pages) != num_full:
                    raise RuntimeError(f"register_chunk: {num_full - len(pages)} of the chunk's {num_full} pages "
                                       f"left the prefix cache before they could be pinned")
                self._check_pin_cap(sum(1 for p in pages if p not in pool.pins))
                for seq in self.scheduler.seqs.values():
                    self.scheduler.check_fits(seq, f"pinning these {num_full} pages: request {seq.seq_id}", pages)
                pool.pin(pages)
            chunk = self.chunks.issue(ids)
            if pin:
                self.chunks.pinned[chunk.chunk_id] = pages
            return chunk

    def _check_pin_cap(self, num_new: int) -> None:
        pool, fraction = self.page_pool, self.engine_config.max_pinned_fraction
        cap = pin_cap(fraction, pool.num_pages)
        if not LIMIT["pinned_pages"].admits(pool.num_pinned_pages + num_new, pin_cap=cap):
            raise ValueError(f"pinning {num_new} more pages would exceed the cap: {pool.num_pinned_pages} pages are "
                             f"pinned, max_pinned_fraction={fraction} of {pool.num_pages} pages allows {cap}")

    def unpin(self, chunk: Chunk) -> None:
        """Let a pinned chunk's pages be evicted again (they stay cached until then)."""
        with self._lock:
            self.chunks.check_pinned(chunk)
            self.page_pool.unpin(self.chunks.pinned.pop(chunk.chunk_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One scheduler step: a forward over the batch, sampling, bookkeeping. Returns what each request
        got (requests collected by a running `generate` or `prefill_kv` are left to those calls); under
        overlap scheduling, what the step before got, once this one is launched."""
        with self._lock:
            backlog, self._backlog = self._backlog, []
            return self._stream_text(backlog + self._route(self._step()))

    def _stream_text(self, outs: list[StepOutput]) -> list[StepOutput]:
        """Sets each streamed request's new_text; a finished one's holds all its text not sent before."""
        for o in outs:
            stream = self._texts.get(o.request_id)
            if stream is not None:
                o.new_text = stream.push(o.new_token_ids)
                if o.finished:
                    o.new_text += stream.finish()
                    del self._texts[o.request_id]
        return outs

    def _route(self, outs: list[StepOutput]) -> list[StepOutput]:
        """Hands claimed requests' outputs to their claimant; returns the others."""
        free = []
        for o in outs:
            if o.request_id in self._claims:
                self._claims[o.request_id].append(o)
            else:
                free.append(o)
        return free

    def _step(self) -> list[StepOutput]:
        """Schedule and launch a step, then postprocess the step before it (overlap) or this one."""
        self._check_open()
        batch = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        if batch.is_empty:
            if prev is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with unfinished requests queued")
            return self._postprocess(prev)
        launched, exc = self._guarded(self.executor.execute, batch)
        if exc is not None:   # contained: only this step's requests end, with the error on them
            self.page_pool.release_again(batch.page_changes)   # the page tables may not have applied them
            return self._postprocess(prev) + self._fail(batch, exc)
        step = _Step(batch, launched)
        self.scheduler.advance(batch)
        outs = self._postprocess(prev)
        if self.engine_config.async_scheduling and step.can_overlap:
            self._in_flight = step
            return outs
        return outs + self._postprocess(step)

    def _postprocess(self, step: _Step | None) -> list[StepOutput]:
        """Sample a launched step (waiting for its tokens), append them, finish the requests that end."""
        if step is None:
            return []
        batch, launched = step
        result, exc = self._guarded(self.executor.sample, launched)
        if exc is not None:   # contained as in `_step`
            return self._fail(batch, exc)
        tokens, logprobs = result
        if launched.row_plan is not None:   # its row plans' reports (a blend's chunk_reuse)
            self.blender.report(*launched.row_plan)
        sampled = [s for s in launched.seqs if s.seq_id in tokens]   # those that ended since are skipped
        finished = {s.seq_id for s in self.scheduler.postprocess(batch, tokens)}
        results = []
        for seq in sampled:
            rid = seq.seq_id
            lp = None
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[rid])
                lp = [logprobs[rid]]
            out = self._finish(seq, seq.finish_reason) if rid in finished else None
            results.append(StepOutput(rid, [tokens[rid]], lp, out.finish_reason if out else None, out))
        return results

    def _drain(self) -> list[StepOutput]:
        """Postprocess the step in flight, if any."""
        step, self._in_flight = self._in_flight, None
        return self._postprocess(step)

    def _guarded(self, fn, arg):
        """(fn(arg), None), or (None, the exception) for a failure the step can contain. A tensor-parallel failure
        cannot be contained (the workers are gone): it closes the engine and goes on, as does a KeyboardInterrupt
        that stopped the workers inside a tensor-parallel step."""
        try:
            return fn(arg), None
        except TensorParallelError as exc:
            self._close(f"a tensor-parallel step failed: {exc}")
            raise
        except Exception as exc:
            return None, exc
        except BaseException:
            if self.executor.failure is not None:
                self._close(f"interrupted inside a tensor-parallel step: {self.executor.failure}")
            raise

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[StepOutput]:
        error = f"{type(exc).__name__}: {exc}"
        results = []
        for seq in batch.seqs:
            if self.scheduler.abort(seq.seq_id, reason="error") is None:
                continue
            seq.error = error
            results.append(self._ended(seq, "error"))
        return results

    def generate(self, prompts, sampling_params=None, chunk_sizes=None, use_tqdm=None,
                 reuse="exact") -> list[RequestOutput]:
        """Run prompts to completion (other queued requests advance too); outputs in prompt order. A prompt may
        be composite (a list holding registered Chunks, text and id lists: chunkwise/chunks.py); `reuse` is
        "exact" (or one per prompt)."""
        with self._lock:
            rids = [self._submit(s) for s in self._prepare(prompts, sampling_params, chunk_sizes, reuse)]
            for r in rids:
                self._claims[r] = []
        show = len(rids) >= TQDM_MIN_PROMPTS if use_tqdm is None else use_tqdm
        done: dict[int, RequestOutput] = {}
        generated = 0
        try:
            with tqdm(total=len(rids), desc="chunkwise.Engine.generate", unit="req", disable=not show,
                      leave=False, delay=0.5, miniters=0) as bar:
                while len(done) < len(rids):
                    finished = len(done)
                    with self._lock:
                        self._backlog += self._route(self._step())
                        for r in rids:
                            for o in self._claims[r]:
                                generated += len(o.new_token_ids)
                                if o.finished:
                                    done[r] = o.output
                            self._claims[r].clear()
                    # The count first, then update, which redraws (miniters=0: after any step, at most every
                    # mininterval, and after the last step always): every frame, the last too, shows the count.
                    bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
                    if len(done) == len(rids):
                        bar.mininterval = 0
                    bar.update(len(done) - finished)
        finally:
            with self._lock:
                for r in rids:
                    self._claims.pop(r, None)
                    if r not in done:   # interrupted: nothing of it stays behind (None if it had ended)
                        self.abort(r)
        return [done[r] for r in rids]

    def prefill_kv(self, prompt, chunk_sizes=None, reuse="exact") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of the prompt as this engine cached them
        (after k-norm and RoPE), gathered from its own pages."""
        with self._lock:
            seq = self._prepare(single_prompt(prompt), SamplingParams(max_tokens=1, ignore_eos=True), [chunk_sizes],
                                reuse)[0]
            # Two tokens, so the request still holds its pages after the step that computes the prompt's
            # last token; it is aborted right after that step. It never computes past the prompt, which is what
            # _prepare checked against the pool (with max_tokens 1), so the second token needs no page.
            seq.sampling_params = replace(seq.sampling_params, max_tokens=2)
            rid = self._submit(seq, check_fits=False)
            self._claims[rid] = []
        try:
            while True:
                with self._lock:
                    self._backlog += self._route(self._step())
                    if seq.num_computed_tokens >= seq.num_prompt_tokens:   # launched: wait for it to succeed
                        self._backlog += self._route(self._drain())
                    failed = next((o for o in self._claims[rid] if o.finished), None)
                    if failed is not None:
                        raise RuntimeError(f"prefill_kv: the request failed: {failed.output.error}")
                    if seq.num_computed_tokens >= seq.num_prompt_tokens:
                        return self.executor.gather_kv(seq, seq.num_prompt_tokens)
        except TensorParallelError as exc:
            with self._lock:
                self._close(f"a tensor-parallel step failed: {exc}")
            raise
        finally:
            with self._lock:
                self._claims.pop(rid, None)
                self.abort(rid)   # None once it has ended
