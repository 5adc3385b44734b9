"""The engine in a process of its own, so that the server's per-token Python does not take the GIL from its steps.

In one process, the event loop's work for each streamed token (parsing, JSON, socket writes) competes with the
engine thread's host work for the GIL: a served step took longer than the same step driven directly, and the
clients' inter-token latency grew with it. Here the engine runs in a spawned process (vLLM's "engine core"):

- `EngineCore` is the server's side. It has EngineLoop's interface (submit, register_chunk, unpin, abort,
  abort_all, stop, num_waiting, num_running, kv_pages_used, failure, streams), so the app cannot tell them apart,
  and as its `engine` the engine's own `Frontend` (chunkwise/engine/frontend.py), sent over once built: the config,
  the tokenizer, the request validation and the chunk registry, the very code the engine validates with. Requests
  are validated here and cross as `Request`s; chunks are issued here once the engine computed them. The engine
  process sends token ids only: the server's `OutputProcessor` decodes their text. The server's event loop itself
  receives the engine's messages
  (`attach`: a reader on the pipe) and routes outputs through `Streams`, which stamps the tokens' times there: one
  wake-up per step. A thread receiving them had to wake, take the GIL from the event loop, then wake the event loop
  (measured: docs/BENCHMARKS.md, "Behind the code: engine_core"). The
  server's messages go out through a thread of their own (`_send_all`), so the event loop, the pipe's only reader,
  never blocks writing: an engine process blocked on a full pipe of outputs would never read the rest of a
  submission larger than the pipe holds.
- `_core_main` is the engine's side: a single-threaded loop over the engine's `EngineCore` that takes the server's
  messages between steps (the same order as EngineLoop: aborts, calls, submissions), steps while any request or
  chunk job is unfinished, and sends each step's outputs as one message, with the queue depths and pages used.

Messages are dataclasses, each handled through a table by its type.

One duplex pipe carries both directions, in order: a submission's request ids reach the server before any of
their outputs. The engine process ignores SIGINT (Ctrl-C reaches the whole process group; the server drives the
shutdown) and exits when the pipe closes, so it never outlives the server.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from chunkwise.chunks import NO_CONTEXT, ChunkContext
from chunkwise.engine import Engine
from chunkwise.engine.core import CoreOutput, EngineStats, PrefixOutput
from chunkwise.engine.frontend import Frontend
from chunkwise.engine.outputs import OutputProcessor
from chunkwise.requests import Request, single_prompt
from chunkwise.serve.engine_loop import Streams, Submission

log = logging.getLogger("chunkwise.serve")

START_TIMEOUT_S = 600   # building the engine: loading (or converting) a checkpoint, capturing CUDA graphs
EXIT_WAIT_S = 1         # for the exit code of an engine process whose pipe closed (it is exiting)


class EngineStartError(RuntimeError):
    """The engine process could not build its engine; the message is the engine's error, its type first."""


# ---- messages: server -> engine ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """One submission's requests, validated by the server: added all or none."""
    sid: int
    requests: list[Request]


@dataclass(frozen=True)
class Abort:
    request_ids: list[int] | None   # None: every request in flight


@dataclass(frozen=True)
class ComputeChunk:
    """Compute a chunk's prefix (and pin its pages) for `register_chunk`."""
    cid: int
    request: Request
    pin: bool


@dataclass(frozen=True)
class Unpin:
    cid: int
    pages: list[int]


@dataclass(frozen=True)
class Stop:
    pass


# ---- messages: engine -> server ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine is built: its frontend (validation and chunk registry, for the server's side) and pool size."""
    frontend: Frontend
    num_pages: int


@dataclass(frozen=True)
class StartFailed:
    error: str


@dataclass(frozen=True)
class Outputs:
    """One step's (or aborts') outputs, in token ids, with the engine's load after them."""
    outputs: list[CoreOutput]
    load: EngineStats


@dataclass(frozen=True)
class Added:
    sid: int
    request_ids: list[int]
    load: EngineStats


@dataclass(frozen=True)
class Refused:
    sid: int
    error: Exception


@dataclass(frozen=True)
class CallDone:
    """A ComputeChunk's or Unpin's answer: the prefix job's output, or the error refusing it."""
    cid: int
    prefix: PrefixOutput | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Stopped:
    pass


_IDLE = EngineStats(0, 0, 0, 0, 0, 0)


@dataclass
class _Call:
    future: Future
    ids: list[int] = field(default_factory=list)   # a chunk's, to issue its handle with
    pin: bool = False
    context: ChunkContext = NO_CONTEXT              # the chunk's, likewise


class EngineCore:
    """An engine built and stepped in a spawned process; the server's side of it (see the module docstring)."""

    def __init__(self, model, engine_kwargs: dict | None = None, engine_class: type | None = None):
        """The engine process will build `engine_class(model, **engine_kwargs)`: chunkwise.Engine unless another
        class is given (a stand-in for measuring the server alone; importable, so the spawned process finds it)."""
        self.streams = Streams()
        self.failure: str | None = None
        self.engine: Frontend | None = None             # once started
        self.outputs: OutputProcessor | None = None     # once started
        self._model, self._kwargs, self._engine_class = str(model), dict(engine_kwargs or {}), engine_class
        self._conn = self._process = None
        self._loop: asyncio.AbstractEventLoop | None = None   # the event loop receiving, once attached
        self._done = False       # the engine process sent its last message (stopped, failed) or closed its pipe
        self._outbox: queue.SimpleQueue[object | None] = queue.SimpleQueue()   # for the sender; None ends it
        self._sender: threading.Thread | None = None
        self._ids = itertools.count()
        self._submissions: dict[int, tuple[Submission, list[Request]]] = {}    # sent, not yet answered
        self._calls: dict[int, _Call] = {}
        self._load = _IDLE
        self._num_pages = 0
        self._stopping = False
        self._handlers = {Outputs: self._on_outputs, Added: self._on_added, Refused: self._on_refused,
                          CallDone: self._on_call_done, Failed: self._on_failed, Stopped: self._on_stopped}

    # ---- lifetime ------------------------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Spawns the engine process and waits until its engine is built; RuntimeError naming why it could not
        be (the engine's own error, or the process's exit)."""
        ctx = multiprocessing.get_context("spawn")   # CUDA cannot be used in a forked child
        self._conn, child = ctx.Pipe()
        # not a daemon: a tensor-parallel engine starts worker processes of its own
        self._process = ctx.Process(target=_core_main, args=(child, self._model, self._kwargs, self._engine_class),
                                    name="chunkwise-engine-core")
        self._process.start()
        child.close()
        try:
            if not self._conn.poll(timeout):
                raise RuntimeError(f"the engine process did not build its engine within {timeout:.0f} s")
            hello = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while building its engine (exit code "
                               f"{self._process.exitcode})") from None
        except BaseException:
            self._kill()
            raise
        if isinstance(hello, StartFailed):
            self._process.join(30)
            self._conn.close()
            raise EngineStartError(hello.error)
        self.engine, self._num_pages = hello.frontend, hello.num_pages
        self.outputs = OutputProcessor(self.engine.tokenizer)
        self._sender = threading.Thread(target=self._send_all, name="chunkwise-engine-core-sender", daemon=True)
        self._sender.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on `loop`, the server's running event loop (called on it), receives the engine's messages."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._receive)

    def detach(self) -> None:
        """The event loop receives no more (called on it, before it ends); stop() takes the rest."""
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._loop = None

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request gets its "abort" output), then end the engine process; the
        messages left are received here (taken from an event loop that still receives them)."""
        if self._sender is None or self._conn.closed:   # never started, or stopped already
            return
        self._stopping = True
        deadline = time.monotonic() + timeout
        self._take_from_loop(timeout)
        self._send(Stop())
        while not self._done and self._conn.poll(max(0.0, deadline - time.monotonic())):
            self._receive()
        self._outbox.put(None)
        self._sender.join(max(0.0, deadline - time.monotonic()))
        self._process.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    close = stop   # the engine is the process's: stopping it closes it

    def _take_from_loop(self, timeout: float) -> None:
        """If an event loop still receives (its server ended without detaching), this thread receives instead."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._loop = None
        elif loop.is_running():
            detached = threading.Event()
            loop.call_soon_threadsafe(lambda: (self.detach(), detached.set()))
            detached.wait(timeout)
        else:
            self.detach()

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    # ---- called from the event loop (or a signal handler) ----------------------------------------------
    def submit(self, sub: Submission) -> Future:
        """Validate the samples here (the engine's own checks: TypeError/ValueError naming the bad value) and send
        them to the engine; the future holds their request ids or the error."""
        if self._refused(sub.future) or not sub.future.set_running_or_notify_cancel():
            return sub.future
        try:
            requests = [self.engine.requests(single_prompt(ids), p, [None], r)[0]
                        for ids, p, r in zip(sub.prompts, sub.params, sub.reuse or ["exact"] * len(sub.prompts))]
        except Exception as exc:
            sub.future.set_exception(exc)
            return sub.future
        sid = next(self._ids)
        self._submissions[sid] = (sub, requests)
        if not self._send(Submit(sid, requests)):
            self._submissions.pop(sid, None)
            sub.future.set_exception(RuntimeError(self.failure))
        return sub.future

    def register_chunk(self, prompt, pin: bool, after=None) -> Future:
        """`Engine.register_chunk(prompt, pin=pin, after=after)`: validated and issued here, computed by the engine
        between steps; the future holds the Chunk or the error."""
        future: Future = Future()
        if self._refused(future):
            return future
        future.set_running_or_notify_cancel()
        try:
            ids, context, request = self.engine.chunk_job(prompt, pin, after)
        except Exception as exc:
            future.set_exception(exc)
            return future
        if request is None:   # nothing to compute: only a handle
            future.set_result(self.engine.issue(ids, [] if pin else None, context))
            return future
        self._call(ComputeChunk(next(self._ids), request, pin), _Call(future, ids, pin, context))
        return future

    def unpin(self, chunk) -> Future:
        future: Future = Future()
        if self._refused(future):
            return future
        future.set_running_or_notify_cancel()
        try:
            pages = self.engine.unpin(chunk)
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
            call.future.set_exception(RuntimeError(self.failure))

    def _refused(self, future: Future) -> bool:
        if self._stopping or self.failure is not None:
            future.set_exception(RuntimeError(self.failure or "the server is shutting down"))
            return True
        return False

    def _send(self, message) -> bool:
        """Queues the message for the sender thread; False once the pipe has closed (the engine process gone: the
        receiving side reports it)."""
        if not self._sender.is_alive():
            if self.failure is None:
                self.failure = "the engine process is gone"
            return False
        self._outbox.put(message)
        return True

    def _send_all(self) -> None:
        """The sender thread: the queued messages in order, until stop() ends it or the pipe closes."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    # ---- receiving: on the event loop (its reader), or in stop() -------------------------------------------
    def _receive(self) -> None:
        """Handles the pipe's next message. One per call: the event loop calls again while the pipe is readable,
        and asking the pipe whether more is there costs about as much as unpickling a step's outputs."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._end()
            if not self._stopping:
                self._process.join(EXIT_WAIT_S)
                self._fail(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")
            return
        self._handle(message)

    def _handle(self, message) -> None:
        self._handlers[type(message)](message)

    def _on_outputs(self, m: Outputs) -> None:
        """The step's token ids become text here, in the server's process."""
        self._load = m.load
        self.outputs.process(m.outputs)
        self.streams.deliver(self.outputs.take_unclaimed())

    def _on_added(self, m: Added) -> None:
        self._load = m.load
        sub, requests = self._submissions.pop(m.sid)
        for rid, request in zip(m.request_ids, requests):
            self.outputs.add(rid, request.pieces, stream=True)
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
            call.future.set_result(self.engine.issue(call.ids, done.pinned if call.pin else None, call.context))

    def _on_failed(self, m: Failed) -> None:
        self._end()
        self._fail(f"the engine failed: {m.error}")

    def _on_stopped(self, _m: Stopped) -> None:
        self._end()
        self._refuse_pending(RuntimeError("the server is shutting down"))

    def _end(self) -> None:
        """The engine process will send nothing more."""
        self._done = True
        self.detach()

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


@contextmanager
def settled_heap():
    """For a serving process, once built: collects, then keeps what lives now (modules, the engine, the app: a few
    hundred thousand objects once torch is imported) out of the garbage collector's full passes (gc.freeze), each
    of which otherwise holds the GIL long enough to stall every stream (docs/BENCHMARKS.md, "Behind the code:
    settled_heap"). Unfrozen on exit, so that the process ends freeing it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---- the engine process ------------------------------------------------------------------------------
def _core_main(conn, model: str, engine_kwargs: dict, engine_class: type | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = (engine_class or Engine)(model, **engine_kwargs)
    except Exception as e:   # one line: the engine's errors name what is wrong
        conn.send(StartFailed(f"{type(e).__name__}: {' '.join(str(e).split())}"))
        return
    try:
        conn.send(Ready(engine.frontend, engine.stats().num_pages))
        with settled_heap():
            _CoreLoop(engine.core, conn).run()
    finally:
        engine.close()
        conn.close()


_ORDER = {Stop: 0, Abort: 1, ComputeChunk: 2, Unpin: 2, Submit: 3}   # EngineLoop's order: aborts, calls, submissions


class _CoreLoop:
    """The engine process's loop over its core: the server's messages between steps, then a step."""

    def __init__(self, core, conn):
        self.core, self.conn = core, conn
        self.live: set[int] = set()       # request ids added and not yet finished
        self.chunks: dict[int, int] = {}  # a chunk's prefix job (its request id) -> the server's call id
        self._handlers = {Abort: self._abort, ComputeChunk: self._compute_chunk, Unpin: self._unpin,
                          Submit: self._add}

    def run(self) -> None:
        core = self.core
        while True:
            try:
                if not core.has_unfinished():
                    self.conn.poll(None)
                messages = []
                while self.conn.poll():
                    messages.append(self.conn.recv())
            except (EOFError, OSError):   # the server is gone
                return
            messages.sort(key=lambda m: _ORDER[type(m)])
            if messages and isinstance(messages[0], Stop):
                self._abort(Abort(list(self.live)))
                self.conn.send(Stopped())
                return
            for m in messages:
                self._handlers[type(m)](m)
            if not core.has_unfinished():
                continue
            try:
                outs = core.step()
            except Exception as exc:   # not contained by the core (it contains a failing step's requests)
                self.conn.send(Failed(f"{type(exc).__name__}: {exc}"))
                return
            self._send_outputs(outs)

    def _send_outputs(self, outs: list) -> None:
        tokens = []
        for out in outs:
            if isinstance(out, PrefixOutput):
                self.conn.send(CallDone(self.chunks.pop(out.request_id), prefix=out))
                continue
            if out.finished:
                self.live.discard(out.request_id)
            tokens.append(out)
        self.conn.send(Outputs(tokens, self.core.stats()))

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
            self.conn.send(CallDone(m.cid, error=_portable(exc)))

    def _unpin(self, m: Unpin) -> None:
        try:
            self.core.unpin(m.pages)
        except Exception as exc:
            self.conn.send(CallDone(m.cid, error=_portable(exc)))
            return
        self.conn.send(CallDone(m.cid))

    def _add(self, m: Submit) -> None:
        try:
            rids = self.core.add_requests(m.requests)
        except Exception as exc:   # the pool: nothing of this submission stays queued
            self.conn.send(Refused(m.sid, _portable(exc)))
            return
        self.live.update(rids)
        self.conn.send(Added(m.sid, rids, self.core.stats()))


def _portable(exc: Exception) -> Exception:
    """The error as the server's side handles it (TypeError and ValueError: a bad request), with only its message,
    so that it pickles whatever it held."""
    kind = type(exc) if type(exc) in (TypeError, ValueError) else RuntimeError
    return kind(str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}")
