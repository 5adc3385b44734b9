"""The one driver of an engine core for the server: between steps it takes the server's messages, in one order,
then runs a step and sends its outputs.

`EngineDriver` runs on the engine's side of a `Transport`: a queue on a thread of the server's process
(engine_loop.py) or a pipe into a process of its own (engine_core.py). Both transports drive this same loop, so
the order between steps exists once:

    recv (wait only when idle) -> process inputs: stop; aborts; chunk calls; submissions -> step -> send outputs

It is SGLang's scheduler event loop. Overlap lives inside the step: under overlap scheduling `core.step()`
launches step k+1 before it postprocesses step k, so what the driver takes and sends here overlaps the device's
work. Aborts go first so that their pages are free before calls and submissions are fitted to the pool; chunk
calls before submissions, as a caller who registered a chunk and then submitted would expect.
"""
from __future__ import annotations

from typing import Protocol

from chunkwise.engine.core import EngineCore, PrefixOutput
from chunkwise.serve.messages import (Abort, Added, CallDone, ComputeChunk, Failed, Outputs, Refused, Stop, Stopped,
                                      Submit, Unpin, portable)


class Transport(Protocol):
    """The driver's side of the way to the server."""

    def recv(self, wait: bool) -> list | None:
        """The messages the server sent since the last call (waiting for one if `wait`); None once it is gone."""

    def send(self, message) -> None:
        """One message to the server, in order."""


_ORDER = {Stop: 0, Abort: 1, ComputeChunk: 2, Unpin: 2, Submit: 3}   # the between-steps order, by message type


class EngineDriver:
    """An engine core stepped for the server over a transport (see the module docstring). Alone with its core."""

    def __init__(self, core: EngineCore, transport: Transport):
        self.core, self.transport = core, transport
        self.live: set[int] = set()       # request ids added and not yet finished
        self.chunks: dict[int, int] = {}  # a chunk's prefix job (its request id) -> the server's call id
        self._handlers = {Abort: self._abort, ComputeChunk: self._compute_chunk, Unpin: self._unpin,
                          Submit: self._add}

    def run(self) -> None:
        """Until the server stops it or is gone, or a step fails beyond its own requests."""
        while True:
            messages = self.transport.recv(wait=not self.core.has_unfinished())
            if messages is None or not self.process_inputs(messages):
                return
            if self.core.has_unfinished() and not self.run_step():
                return

    def process_inputs(self, messages: list) -> bool:
        """The server's messages in the between-steps order; False after a Stop (every request aborted)."""
        messages = sorted(messages, key=lambda m: _ORDER[type(m)])
        if messages and isinstance(messages[0], Stop):
            self._abort(Abort(None))
            self.transport.send(Stopped())
            return False
        for m in messages:
            self._handlers[type(m)](m)
        return True

    def run_step(self) -> bool:
        """One core step, its outputs sent; False when it raised (not contained by the core: every request ends)."""
        try:
            outs = self.core.step()
        except Exception as exc:
            self.transport.send(Failed(f"{type(exc).__name__}: {exc}"))
            return False
        self._send_outputs(outs)
        return True

    def _send_outputs(self, outs: list) -> None:
        tokens = []
        for out in outs:
            if isinstance(out, PrefixOutput):
                self.transport.send(CallDone(self.chunks.pop(out.request_id), prefix=out))
                continue
            if out.finished:
                self.live.discard(out.request_id)
            tokens.append(out)
        self.transport.send(Outputs(tokens, self.core.stats()))

    def _abort(self, m: Abort) -> None:
        """Ids the server was given; a finished one has nothing to abort."""
        outs = [out for rid in (list(self.live) if m.request_ids is None else m.request_ids)
                if (out := self.core.abort(rid)) is not None]
        if outs:
            self._send_outputs(outs)

    def _compute_chunk(self, m: ComputeChunk) -> None:
        try:
            self.chunks[self.core.compute_prefix(m.request, pin=m.pin)] = m.cid
        except Exception as exc:
            self.transport.send(CallDone(m.cid, error=portable(exc)))

    def _unpin(self, m: Unpin) -> None:
        try:
            self.core.unpin(m.pages)
        except Exception as exc:
            self.transport.send(CallDone(m.cid, error=portable(exc)))
            return
        self.transport.send(CallDone(m.cid))

    def _add(self, m: Submit) -> None:
        try:
            rids = self.core.add_requests(m.requests)
        except Exception as exc:   # the pool: nothing of this submission stays queued
            self.transport.send(Refused(m.sid, portable(exc)))
            return
        self.live.update(rids)
        self.transport.send(Added(m.sid, rids, self.core.stats()))
