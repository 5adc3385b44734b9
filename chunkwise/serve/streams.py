"""Where each engine request's outputs go: its HTTP request's asyncio queue, with the token-timing metrics.

Every output is tagged with the sample's index within its HTTP request (n > 1, batched prompts) and handed over
with one `loop.call_soon_threadsafe` per step and event loop (not one per token: each wakes the event loop with a
socket write), or at once when delivered on that event loop (an engine process's messages are received there).
Time to first token and inter-token latency are stamped when the outputs are handed over, as a client would see
them, less the HTTP hop.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.engine.outputs import StepOutput


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


class Streams:
    """Where each engine request's outputs go (its HTTP request's asyncio queue), with the token-timing metrics.
    Used by one thread at a time: the one that adds requests and routes their outputs."""

    def __init__(self):
        self.metrics = None
        self._by_id: dict[int, _Stream] = {}

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
        here = running_loop()
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


def _route(batch: list[tuple[asyncio.Queue, int, StepOutput]]) -> None:
    """On the event loop: one step's outputs into their requests' queues, in the step's order."""
    for q, index, out in batch:
        q.put_nowait((index, out))


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
