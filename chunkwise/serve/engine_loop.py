"""The engine, stepped on a thread of its own; each HTTP request gets its StepOutputs through an asyncio queue.

One thread owns the engine: it takes aborts, calls (`call`: chunk registration and unpinning) and submissions
from its inbox between steps (abort, the call, add_request), then steps while any request is unfinished, and
sleeps when none is. The event loop never waits on
the engine: a submission is put in the inbox and answered through a future (the request ids, or the engine's
TypeError/ValueError naming the bad value); every StepOutput goes to its request's queue (`Streams`), tagged with
the sample's index within its HTTP request (n > 1, batched prompts), a step's outputs together through one
`loop.call_soon_threadsafe` (not one per token: each wakes the event loop with a socket write), or at once when
delivered on that event loop (EngineCore receives there).
Because the same thread adds a request and later routes its outputs, no output can arrive before its queue is
known.

`Streams` also feeds the metrics: time to first token and inter-token latency are stamped when the outputs are
handed over, as a client would see them, less the HTTP hop. engine_core.py runs the same engine work in a process
of its own and routes through the same `Streams`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.engine.llm_engine import StepOutput

log = logging.getLogger("chunkwise.serve")


@dataclass
class _Stream:
    """Where one engine request's outputs go, and its timing."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue      # of (index, StepOutput)
    index: int                # the sample's place among its HTTP request's samples
    arrival: float            # time.monotonic() when the HTTP request arrived
    last_token: float | None = None


@dataclass
class Submission:
    """Samples of one HTTP request, added together or not at all."""
    prompts: list[list]                # one prompt per sample: its token ids, or a composite prompt
    params: list[SamplingParams]       # one per sample
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    future: Future = field(default_factory=Future)   # -> list of request ids, one per sample
    reuse: list | None = None          # one `reuse` per sample (a composite's); None: all "exact"
    num_prompt_tokens: int | None = None   # for the metrics; None: the prompts' lengths (plain prompts)


def add_samples(engine, prompts: list, params: list[SamplingParams], reuse: list | None) -> list[int]:
    """Adds one submission's samples to the engine, all or none (a refused sample aborts those already added);
    returns their request ids, or raises the engine's TypeError/ValueError naming the bad value."""
    rids: list[int] = []
    try:
        for ids, p, r in zip(prompts, params, reuse or ["exact"] * len(prompts)):
            rids.append(engine.add_request(ids, p, reuse=r))
    except Exception:
        for rid in rids:
            engine.abort(rid)
        raise
    return rids


def abort_requests(engine, request_ids) -> list[StepOutput]:
    """Aborts these requests; the "abort" output of each that was still running (one that had finished has had its
    last output already)."""
    outs = []
    for rid in request_ids:
        out = engine.abort(rid)
        if out is not None:
            outs.append(StepOutput(rid, [], None, "abort", out))
    return outs


class Streams:
    """Where each engine request's outputs go (its HTTP request's asyncio queue), with the token-timing metrics.
    Used by one thread at a time: the one that adds requests and routes their outputs."""

    def __init__(self):
        self.metrics = None
        self._by_id: dict[int, _Stream] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._by_id

    def ids(self) -> list[int]:
        return list(self._by_id)

    def add(self, sub: Submission, request_ids: list[int]) -> None:
        for index, rid in enumerate(request_ids):
            self._by_id[rid] = _Stream(sub.loop, sub.queue, index, sub.arrival)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sub.num_prompt_tokens if sub.num_prompt_tokens is not None
                                           else sum(len(ids) for ids in sub.prompts))

    def fail_all(self, error: str) -> None:
        """Every request ends with an error (the engine cannot go on)."""
        self.deliver([StepOutput(rid, [], None, "error", RequestOutput(rid, [], finish_reason="error", error=error))
                      for rid in self.ids()])

    def deliver(self, outs: list[StepOutput]) -> None:
        """Hands a step's outputs to their requests' queues: at once on the event loop delivering, else with one
        call per event loop (each call wakes the loop through a socket write, and may lose the GIL to it)."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        tokens = 0
        for out in outs:
            stream = self._by_id.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                self._time_token(stream, now)
            if out.finished:
                del self._by_id[out.request_id]
                if self.metrics is not None:
                    self.metrics.e2e.observe(now - stream.arrival)
                    self.metrics.finished(out.finish_reason)
            batch = batches.get(stream.loop)
            if batch is None:
                batch = batches[stream.loop] = []
            batch.append((stream.queue, stream.index, out))
        if tokens and self.metrics is not None:
            self.metrics.generation_tokens.inc(tokens)
        here = _running_loop()
        for loop, batch in batches.items():
            if loop is here:
                _route(batch)
                continue
            try:
                loop.call_soon_threadsafe(_route, batch)
            except RuntimeError:   # the event loop has closed: nobody is listening any more
                pass

    def _time_token(self, stream: _Stream, now: float) -> None:
        if self.metrics is not None:
            if stream.last_token is None:
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                self.metrics.itl.observe(now - stream.last_token)
        stream.last_token = now


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self.streams = Streams()
        self._submissions: queue.SimpleQueue[Submission] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[int | None] = queue.SimpleQueue()   # None: abort every request
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self.failure: str | None = None    # set when the engine cannot go on; the server then answers 503
        self._thread = threading.Thread(target=self._run, name="chunkwise-engine", daemon=True)

    # ---- called from the event loop (or a signal handler) ----------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to do: each submission names its event loop, and this engine's thread hands its outputs there."""

    def detach(self) -> None:
        """Nothing to do (see attach)."""

    def submit(self, sub: Submission) -> Future:
        """Queue the samples for the engine thread; the future holds their request ids or the engine's error."""
        if self._stopping or self.failure is not None:
            sub.future.set_exception(RuntimeError(self.failure or "the server is shutting down"))
            return sub.future
        self._submissions.put(sub)
        self._wake.set()
        return sub.future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the engine thread between steps (never during one); the future holds its result or
        exception."""
        future: Future = Future()
        if self._stopping or self.failure is not None:
            future.set_exception(RuntimeError(self.failure or "the server is shutting down"))
            return future
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def register_chunk(self, prompt, pin: bool, after=None) -> Future:
        """`Engine.register_chunk(prompt, pin=pin, after=after)` between steps; the future holds the Chunk or the
        error."""
        return self.call(lambda: self.engine.register_chunk(prompt, pin=pin, after=after))

    def unpin(self, chunk) -> Future:
        return self.call(lambda: self.engine.unpin(chunk))

    def abort(self, request_ids) -> None:
        """Abort these requests (those still running); returns at once."""
        for rid in request_ids:
            self._aborts.put(rid)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight; safe from a signal handler."""
        self._aborts.put(None)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request gets its "abort" output) and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        """stop(), then close the engine."""
        self.stop()
        self.engine.close()

    def num_waiting(self) -> int:
        """Requests not yet admitted: in the inbox or the scheduler's waiting queue. Read without the engine's
        lock (lengths only), so at worst one step stale."""
        return self._submissions.qsize() + self.engine.stats().num_waiting

    def num_running(self) -> int:
        return self.engine.stats().num_running

    def kv_pages_used(self) -> int:
        return self.engine.stats().pages_used

    def kv_pages_total(self) -> int:
        return self.engine.stats().num_pages

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.wait()
            self._wake.clear()
            self._take_aborts()
            if self._stopping:
                self._abort(self.streams.ids())
                self._refuse_calls("the server is shutting down")
                return
            # a call may step the engine itself (register_chunk computes the chunk): streamed requests' outputs
            # made then wait in the engine's backlog for the next step(), taken even if nothing is unfinished
            called = self._take_calls()
            self._take_submissions()
            if not self.engine.has_unfinished() and not called:
                continue
            try:
                outs = self.engine.step()
            except Exception as exc:   # not contained by the engine (it contains a failing step's requests)
                self._fail_all(f"{type(exc).__name__}: {exc}")
                self._refuse_calls(self.failure)
                return
            self.streams.deliver(outs)

    def _take_calls(self) -> bool:
        """Runs the calls in the inbox; whether there were any."""
        called = False
        for fn, future in _drained(self._calls):
            called = True
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        return called

    def _refuse_calls(self, reason: str) -> None:
        """The calls still in the inbox once the thread ends: nobody will run them."""
        for _fn, future in _drained(self._calls):
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(reason))

    def _take_submissions(self) -> None:
        for sub in _drained(self._submissions):
            if not sub.future.set_running_or_notify_cancel():   # its client left while it queued
                continue
            try:
                rids = add_samples(self.engine, sub.prompts, sub.params, sub.reuse)
            except Exception as exc:   # validation: nothing of this submission stays queued
                sub.future.set_exception(exc)
                continue
            self.streams.add(sub, rids)
            sub.future.set_result(rids)

    def _take_aborts(self) -> None:
        rids = set(_drained(self._aborts))   # None: every request
        if rids:
            self._abort(self.streams.ids() if None in rids else [rid for rid in rids if rid in self.streams])

    def _abort(self, rids) -> None:
        """One delivery for all of them: each call wakes the event loop."""
        outs = abort_requests(self.engine, rids)
        if outs:
            self.streams.deliver(outs)

    def _fail_all(self, error: str) -> None:
        """The engine raised out of step(): every request ends with an error, and the server takes no more."""
        log.error("the engine failed: %s", error)
        self.failure = f"the engine failed: {error}"
        self.streams.fail_all(error)


def _route(batch: list[tuple[asyncio.Queue, int, StepOutput]]) -> None:
    """On the event loop: one step's outputs into their requests' queues, in the step's order."""
    for q, index, out in batch:
        q.put_nowait((index, out))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _drained(q: queue.Queue):
    """What q holds now, taken without waiting."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
