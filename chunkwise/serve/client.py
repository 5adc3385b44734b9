"""The server's side of an engine: what the app calls (submit, register_chunk, unpin, abort, the load), over a
transport to the engine's `EngineDriver` (serve/driver.py).

`EngineClient` validates with the engine's own `Frontend` (chunkwise/engine/frontend.py: the config, the
tokenizer, the request validation and the chunk registry, the very code the engine validates with), so a bad
request is refused here, naming its value, before anything is sent. Requests cross as `Request`s, chunk jobs as
`ComputeChunk`s, and chunks are issued here once the engine computed them. The engine sends token ids only: this
side's `OutputProcessor` decodes their text and matches stop strings, and a request a stop string ended is aborted
in the engine. Each output goes to its HTTP request's queue through `Streams`.

Two transports, one subclass each: `EngineLoop` (engine_loop.py: the engine on a thread of this process, whose
messages are handled on that thread) and `EngineCore` (engine_core.py: the engine in a process of its own, whose
messages the server's event loop reads from a pipe). They differ only in `_send` and in where `_handle` runs.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from chunkwise.chunks import NO_CONTEXT, ChunkContext
from chunkwise.engine.frontend import Frontend
from chunkwise.engine.outputs import OutputProcessor
from chunkwise.requests import Request, single_prompt
from chunkwise.serve.messages import (IDLE, Abort, Added, CallDone, ComputeChunk, Failed, Outputs, Refused, Stopped,
                                      Submit, Unpin)
from chunkwise.serve.streams import Streams, Submission

log = logging.getLogger("chunkwise.serve")


@dataclass
class _Call:
    future: Future
    ids: list[int] = field(default_factory=list)   # a chunk's, to issue its handle with
    pin: bool = False
    context: ChunkContext = NO_CONTEXT              # the chunk's, likewise


class EngineClient:
    """The server's side of an engine, whatever carries its messages (see the module docstring)."""

    def __init__(self):
        self.streams = Streams()
        self.failure: str | None = None   # set when the engine cannot go on; the server then answers 503
        self.frontend: Frontend | None = None        # once connected
        self.outputs: OutputProcessor | None = None  # once connected
        self._ids = itertools.count()
        self._submissions: dict[int, tuple[Submission, list[Request]]] = {}    # sent, not yet answered
        self._calls: dict[int, _Call] = {}
        self._load = IDLE
        self._num_pages = 0
        self._stopping = False
        self._done = False     # the engine sent its last message (stopped, failed), or is gone
        self._issuing = threading.Lock()
        self._handlers = {Outputs: self._on_outputs, Added: self._on_added, Refused: self._on_refused,
                          CallDone: self._on_call_done, Failed: self._on_failed, Stopped: self._on_stopped}

    def _connect(self, frontend: Frontend, num_pages: int) -> None:
        self.frontend, self._num_pages = frontend, num_pages
        self.outputs = OutputProcessor(frontend)

    def _send(self, message) -> bool:
        """Hands the message to the transport; False once the engine is gone (failure then says why)."""
        raise NotImplementedError

    # ---- called from the event loop (or a signal handler) ----------------------------------------------
    def submit(self, sub: Submission) -> Future:
        """Validate the samples here (the engine's own checks: TypeError/ValueError naming the bad value) and send
        them to the engine; the future holds their request ids or the error."""
        if self._refused(sub.future) or not sub.future.set_running_or_notify_cancel():
            return sub.future
        try:
            requests = [self.frontend.requests(single_prompt(ids), p, [None], r)[0]
                        for ids, p, r in zip(sub.prompts, sub.params, sub.reuse or ["exact"] * len(sub.prompts))]
        except Exception as exc:
            sub.future.set_exception(exc)
            return sub.future
        sid = next(self._ids)
        self._submissions[sid] = (sub, requests)
        if not self._send(Submit(sid, requests)):
            self._submissions.pop(sid, None)
            sub.future.set_exception(RuntimeError(self._gone()))
        return sub.future

    def register_chunk(self, prompt, pin: bool, after=None) -> Future:
        """`Engine.register_chunk(prompt, pin=pin, after=after)`: validated and issued here, computed by the engine
        between steps; the future holds the Chunk or the error."""
        future: Future = Future()
        if self._refused(future):
            return future
        future.set_running_or_notify_cancel()
        try:
            ids, context, request = self.frontend.chunk_job(prompt, pin, after)
        except Exception as exc:
            future.set_exception(exc)
            return future
        if request is None:   # nothing to compute: only a handle
            future.set_result(self._issue(ids, [] if pin else None, context))
            return future
        self._call(ComputeChunk(next(self._ids), request, pin), _Call(future, ids, pin, context))
        return future

    def unpin(self, chunk) -> Future:
        future: Future = Future()
        if self._refused(future):
            return future
        future.set_running_or_notify_cancel()
        try:
            pages = self.frontend.unpin(chunk)
        except Exception as exc:
            future.set_exception(exc)
            return future
        self._call(Unpin(next(self._ids), pages), _Call(future))
        return future

    def abort(self, request_ids) -> None:
        """Abort these requests (those still running); returns at once."""
        request_ids = list(request_ids)
        if request_ids:
            self._send(Abort(request_ids))

    def abort_all(self) -> None:
        """Abort every request in flight; safe from a signal handler."""
        self._send(Abort(None))

    def num_waiting(self) -> int:
        """Requests not yet admitted: sent but not yet answered, or in the scheduler's waiting queue (as of the
        engine's last message, so at worst a step stale)."""
        return len(self._submissions) + self._load.num_waiting

    def num_running(self) -> int:
        return self._load.num_running

    def kv_pages_used(self) -> int:
        return self._load.pages_used

    def kv_pages_total(self) -> int:
        return self._num_pages

    def _call(self, message, call: _Call) -> None:
        self._calls[message.cid] = call
        if not self._send(message):
            self._calls.pop(message.cid, None)
            call.future.set_exception(RuntimeError(self._gone()))

    def _refused(self, future: Future) -> bool:
        if self._stopping or self.failure is not None:
            future.set_exception(RuntimeError(self._gone()))
            return True
        return False

    def _issue(self, ids: list[int], pinned: list[int] | None, context: ChunkContext = NO_CONTEXT):
        """A chunk's handle: issued here (a short chunk) or where the engine's answer is handled, which in-thread is
        the engine's thread, so the registry's count is taken under a lock."""
        with self._issuing:
            return self.frontend.issue(ids, pinned, context)

    def _gone(self) -> str:
        return self.failure or "the server is shutting down"

    # ---- the engine's messages: on the thread the transport receives them on -------------------------------
    def _handle(self, message) -> None:
        self._handlers[type(message)](message)

    def _on_outputs(self, m: Outputs) -> None:
        """The step's token ids become text here; a request a stop string ended is aborted in the engine."""
        self._load = m.load
        self.outputs.process(m.outputs)
        self.streams.deliver(self.outputs.take_unclaimed())
        self.abort(self.outputs.take_stopped())

    def _on_added(self, m: Added) -> None:
        self._load = m.load
        sub, requests = self._submissions.pop(m.sid)
        for rid, request in zip(m.request_ids, requests):
            self.outputs.add(rid, request.pieces, stream=True, stop=request.params.stop)
        self.streams.add(sub, m.request_ids)   # before the future: its outputs may come next
        sub.future.set_result(m.request_ids)

    def _on_refused(self, m: Refused) -> None:
        self._submissions.pop(m.sid)[0].future.set_exception(m.error)

    def _on_call_done(self, m: CallDone) -> None:
        call = self._calls.pop(m.cid)
        done = m.prefix
        if m.error is not None:
            call.future.set_exception(m.error)
        elif done is None:   # an unpin
            call.future.set_result(None)
        elif done.error is not None:
            call.future.set_exception(RuntimeError(f"register_chunk: computing the chunk failed: {done.error}"))
        elif done.refused is not None:
            call.future.set_exception(done.refused)
        else:
            call.future.set_result(self._issue(call.ids, done.pinned if call.pin else None, call.context))

    def _on_failed(self, m: Failed) -> None:
        self._done = True
        self._fail(f"the engine failed: {m.error}")

    def _on_stopped(self, _m: Stopped) -> None:
        self._done = True
        self._refuse_pending(RuntimeError("the server is shutting down"))

    def _fail(self, failure: str) -> None:
        log.error("%s", failure)
        self.failure = failure
        self.streams.fail_all(failure)
        self._refuse_pending(RuntimeError(failure))

    def _refuse_pending(self, error: Exception) -> None:
        """The submissions and calls the engine will never answer."""
        for sid in list(self._submissions):
            self._submissions.pop(sid)[0].future.set_exception(error)
        for cid in list(self._calls):
            self._calls.pop(cid).future.set_exception(error)
