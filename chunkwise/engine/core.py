"""The engine core: requests in, token ids out, one scheduler step at a time. No text, no validation of prompts.

`EngineCore` owns the executor, the page pool and the scheduler. Its callers (the `chunkwise.Engine` facade, the
server's engine process) validate a request first (chunkwise/engine/frontend.py) and hand it over as a
`Request`; the core checks only that it fits the pool, once, and queues it. `step()` is nano-vllm's step:

    schedule -> launch -> postprocess (the step before, under overlap scheduling, or this one)

and returns token-level `CoreOutput`s (ids, logprobs, finish reason, error) and the `PrefixOutput` of each
`compute_prefix` job it completed. A step whose forward or sampling raises ends only its own requests, with
finish_reason "error"; a tensor-parallel failure cannot be contained and closes the core.

`compute_prefix(request)` computes a prompt's K/V and samples nothing: a job the scheduler runs like any
prefill, reported by the step that completes it, with its K/V gathered (`prefill_kv`) or its full pages pinned
in the prefix cache (`register_chunk(pin=True)`). It is not a request with an extra token; nothing steps inside
another call.

Overlap scheduling (`async_scheduling`): a step's postprocess waits until the next step is launched, so the host
schedules and prepares step k+1 while the device runs step k (docs/ARCHITECTURE.md, "Overlap scheduling").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from chunkwise.engine_config import EngineConfig
from chunkwise.requests import Request
from chunkwise.sampling import RequestOutput
from chunkwise.limits import LIMIT, pin_cap
from chunkwise.engine.blend import Blender
from chunkwise.engine.host_step import Launched
from chunkwise.engine.model import Model
from chunkwise.engine.page_pool import PagePool
from chunkwise.engine.executor.executor import Executor, MultiprocExecutor
from chunkwise.engine.executor.workers import TensorParallelError
from chunkwise.engine.scheduler import ScheduledBatch, Scheduler
from chunkwise.engine.sequence import Sequence, SequenceStatus

@dataclass
class CoreOutput:
    """What one step did for one request, in token ids: its new token (with logprobs if asked) and, once it
    finished, the reason and its whole output (no text: the caller's output processor decodes)."""
    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None     # set once finished; its text is ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PrefixOutput:
    """A `compute_prefix` job, done: the K/V asked for, or the pages pinned; or why it failed (`error`: the
    step's exception, as text) or was refused once computed (`refused`: the pin no longer fits)."""
    request_id: int
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    pinned: list[int] | None = None
    error: str | None = None
    refused: ValueError | None = None

    @property
    def finished(self) -> bool:
        return True


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the core's queues and page pool."""
    num_waiting: int       # queued, not admitted
    num_running: int
    num_pages: int         # in the pool
    pages_used: int        # held by requests or pins
    pages_cached: int      # in the prefix cache and held by no one: evictable, reusable until evicted
    pages_pinned: int


@dataclass(frozen=True)
class _PrefixJob:
    gather_kv: bool
    pin: bool


class _Step(NamedTuple):
    """A launched step awaiting its postprocess: what was scheduled and what the executor launched."""
    batch: ScheduledBatch
    launched: Launched

    @property
    def can_overlap(self) -> bool:
        """Its tokens can feed the next step on the device: greedy, and no logprobs to compute from its logits."""
        return not self.launched.needs_logits


class EngineCore:
    """Executor, page pool and scheduler, driven by `add_requests`, `compute_prefix`, `abort` and `step`. Not
    thread-safe: one caller at a time (the facade holds a lock; the server's engine thread or process is alone)."""

    def __init__(self, config: EngineConfig, model_class: type = Model):
        self.config = config
        executor = Executor if config.tensor_parallel_size == 1 else MultiprocExecutor
        self.executor = executor(config, model_class)
        self.page_pool = PagePool(self.executor.num_pages, config.page_size, config.enable_prefix_caching)
        self.blender = Blender(config.model_config.num_layers)   # blended prefills' plans and reports
        self.scheduler = Scheduler(config, self.page_pool, config.model_config.eos_token_ids, row_planner=self.blender)
        self.closed: str | None = None                 # why the core takes no more work, once closed
        self._num_ids = 0                              # request ids handed out: 0 .. _num_ids - 1
        self._in_flight: _Step | None = None           # launched, not yet postprocessed (overlap only)
        self._prefixes: dict[int, _PrefixJob] = {}     # compute_prefix jobs not yet done, by request id

    # ---- lifetime ----------------------------------------------------------------------------------
    def close(self, reason: str = "close() was called") -> None:
        if self.closed is None:
            self.closed = reason
            self.executor.close()

    def check_open(self) -> None:
        if self.closed is not None:
            raise RuntimeError(f"this Engine is closed ({self.closed})")

    # ---- requests ----------------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> list[int]:
        """Queue validated requests, all or none: each is checked against the pool (at its longest) before any is
        queued; ValueError naming the prompt otherwise. Returns their request ids."""
        self.check_open()
        seqs = [Sequence.from_request(r) for r in requests]
        for i, seq in enumerate(seqs):
            self.scheduler.check_fits(seq, name=f"prompt {i}")
        return [self._submit(seq) for seq in seqs]

    def compute_prefix(self, request: Request, gather_kv: bool = False, pin: bool = False) -> int:
        """Queue a job that computes `request`'s prompt into the prefix cache and samples nothing (validated with
        max_tokens 1, which is what its fit is checked with); its
        `PrefixOutput` comes from the step that completes it, with the prompt's K/V (`gather_kv`) or its full
        pages pinned (`pin`). Returns the job's request id (`abort` takes it)."""
        self.check_open()
        seq = Sequence.from_request(request)
        seq.prefill_only = True
        if pin:   # before computing: pages not cached yet will be new pins
            pool = self.page_pool
            cached = pool.chain_pages(seq.prompt_token_ids)
            num_full = seq.num_prompt_tokens // pool.page_size
            self.check_pin_cap(num_full - len(cached) + sum(1 for p in cached if p not in pool.pins))
        self.scheduler.check_fits(seq, name="prompt 0")
        rid = self._submit(seq)
        self._prefixes[rid] = _PrefixJob(gather_kv, pin)
        return rid

    def _submit(self, seq: Sequence) -> int:
        rid = self._num_ids
        self._num_ids += 1
        seq.seq_id = rid
        if seq.sampling_params.logprobs is not None:
            seq.logprobs = []
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: int) -> CoreOutput | None:
        """Stop a request (or prefix job) and free its pages; its last output (finish_reason "abort", the tokens
        so far), or None if it had already finished. ValueError for an id never handed out."""
        if not isinstance(request_id, int) or not 0 <= request_id < self._num_ids:
            raise ValueError(f"no request with id {request_id!r}")
        self._prefixes.pop(request_id, None)
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._ended(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        pool, sched = self.page_pool, self.scheduler
        return EngineStats(len(sched.waiting), len(sched.running), pool.num_pages,
                           pool.num_pages - pool.num_free_pages, len(pool.evictable), pool.num_pinned_pages)

    # ---- pins ----------------------------------------------------------------------------------------
    def check_pin_cap(self, num_new: int) -> None:
        pool, fraction = self.page_pool, self.config.max_pinned_fraction
        cap = pin_cap(fraction, pool.num_pages)
        if not LIMIT["pinned_pages"].admits(pool.num_pinned_pages + num_new, pin_cap=cap):
            raise ValueError(f"pinning {num_new} more pages would exceed the cap: {pool.num_pinned_pages} pages are "
                             f"pinned, max_pinned_fraction={fraction} of {pool.num_pages} pages allows {cap}")

    def _pin(self, token_ids: list[int]) -> list[int]:
        """Pins the cached full pages of a computed prefix; ValueError if they no longer fit the rules."""
        pool = self.page_pool
        num_full = len(token_ids) // pool.page_size
        pages = pool.chain_pages(token_ids)
        if len(pages) != num_full:
            raise ValueError(f"register_chunk: {num_full - len(pages)} of the chunk's {num_full} pages left the "
                             f"prefix cache before they could be pinned")
        self.check_pin_cap(sum(1 for p in pages if p not in pool.pins))
        for seq in self.scheduler.seqs.values():
            self.scheduler.check_fits(seq, f"pinning these {num_full} pages: request {seq.seq_id}", pages)
        pool.pin(pages)
        return pages

    def unpin(self, pages: list[int]) -> None:
        self.page_pool.unpin(pages)

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput | PrefixOutput]:
        """Schedule and launch a step, then postprocess the step before it (overlap) or this one."""
        self.check_open()
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
        if self.config.async_scheduling and step.can_overlap:
            self._in_flight = step
            return outs
        return outs + self._postprocess(step)

    def _postprocess(self, step: _Step | None) -> list[CoreOutput | PrefixOutput]:
        """Sample a launched step (waiting for its tokens), append them, finish the requests that end."""
        if step is None:
            return []
        batch, launched = step
        result, exc = self._guarded(self.executor.sample, launched)
        if exc is not None:   # contained as in `step`
            return self._fail(batch, exc)
        tokens, logprobs = result
        if launched.row_plan is not None:   # its row plans' reports (a blend's chunk_reuse)
            self.blender.report(*launched.row_plan)
        sampled = [s for s in launched.seqs if s.seq_id in tokens]   # those that ended since are skipped
        finished = {s.seq_id for s in self.scheduler.postprocess(batch, tokens)}
        results: list[CoreOutput | PrefixOutput] = []
        for seq in sampled:
            rid = seq.seq_id
            lp = None
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[rid])
                lp = [logprobs[rid]]
            out = self._finish(seq, seq.finish_reason) if rid in finished else None
            results.append(CoreOutput(rid, [tokens[rid]], lp, out.finish_reason if out else None, out))
        if self._prefixes:
            results += self._prefixes_done(batch)
        return results

    def _prefixes_done(self, batch: ScheduledBatch) -> list[PrefixOutput]:
        """The prefix jobs whose prompt this postprocessed batch completed (and still held: not preempted since). Not
        `num_computed_tokens`: under overlap scheduling the step after it counts as computed already."""
        done = []
        for seq, end in zip(batch.seqs, batch.ends):
            job = self._prefixes.get(seq.seq_id)
            if job is None or end < seq.num_prompt_tokens or seq.status is not SequenceStatus.RUNNING:
                continue
            del self._prefixes[seq.seq_id]
            kv = self.executor.gather_kv(seq, seq.num_prompt_tokens) if job.gather_kv else None
            self.scheduler.abort(seq.seq_id, reason="stop")
            self.executor.release(seq.seq_id)
            out = PrefixOutput(seq.seq_id, kv)
            if job.pin:
                try:
                    out.pinned = self._pin(seq.prompt_token_ids)
                except ValueError as exc:
                    out.refused = exc
            done.append(out)
        return done

    def _guarded(self, fn, arg):
        """(fn(arg), None), or (None, the exception) for a failure the step can contain. A tensor-parallel failure
        cannot be contained (the workers are gone): it closes the core and goes on, as does a KeyboardInterrupt
        that stopped the workers inside a tensor-parallel step."""
        try:
            return fn(arg), None
        except TensorParallelError as exc:
            self.close(f"a tensor-parallel step failed: {exc}")
            raise
        except Exception as exc:
            return None, exc
        except BaseException:
            if self.executor.failure is not None:
                self.close(f"interrupted inside a tensor-parallel step: {self.executor.failure}")
            raise

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[CoreOutput | PrefixOutput]:
        error = f"{type(exc).__name__}: {exc}"
        results: list[CoreOutput | PrefixOutput] = []
        for seq in batch.seqs:
            if self.scheduler.abort(seq.seq_id, reason="error") is None:
                continue
            seq.error = error
            if self._prefixes.pop(seq.seq_id, None) is not None:
                self.executor.release(seq.seq_id)
                results.append(PrefixOutput(seq.seq_id, error=error))
            else:
                results.append(self._ended(seq, "error"))
        return results

    def _ended(self, seq: Sequence, reason: str) -> CoreOutput:
        """The last output of a request ended outside sampling (abort, error): no new token."""
        return CoreOutput(seq.seq_id, [], [] if seq.logprobs is not None else None, reason, self._finish(seq, reason))

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        """The finished request's output, in token ids; the core forgets it."""
        self.executor.release(seq.seq_id)
        return RequestOutput(seq.seq_id, list(seq.prompt_token_ids), token_ids=seq.completion_token_ids,
                             logprobs=seq.logprobs, finish_reason=reason, num_cached_tokens=seq.num_cached_tokens,
                             error=seq.error, chunk_reuse=self.blender.pop_report(seq.seq_id))
