"""The engine in a process of its own, so that the server's per-token Python does not take the GIL from its steps.

In one process, the event loop's work for each streamed token (parsing, JSON, socket writes) competes with the
engine thread's host work for the GIL: a served step took longer than the same step driven directly, and the
clients' inter-token latency grew with it. Here the engine runs in a spawned process (vLLM's "engine core"):

- `EngineCore` is the server's side. It has EngineLoop's interface (submit, register_chunk, unpin, abort,
  abort_all, stop, num_waiting, num_running, kv_pages_used, failure, streams), so the app cannot tell them apart,
  and an `EngineView` as its `engine`: the config, the tokenizer, a mirror of the chunk registry, all the app reads
  to validate a request before the engine sees it. The server's event loop itself receives the engine's messages
  (`attach`: a reader on the pipe) and routes outputs through `Streams`, which stamps the tokens' times there: one
  wake-up per step. A thread receiving them had to wake, take the GIL from the event loop, then wake the event loop
  (on an H200 at 32 req/s its receipt and the routing were 0.10 ms apart at the median, 0.31 ms at p99). The
  server's messages go out through a thread of their own (`_send_all`), so the event loop, the pipe's only reader,
  never blocks writing: an engine process blocked on a full pipe of outputs would never read the rest of a
  submission larger than the pipe holds.
- `_core_main` is the engine's side: a single-threaded loop that takes the server's messages between steps
  (the same order as EngineLoop: aborts, calls, submissions), steps while any request is unfinished, and sends each
  step's outputs as one message, with the queue depths and pages used.

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
from dataclasses import dataclass

from chunkwise.chunks import ChunkRegistry
from chunkwise.engine import Engine
from chunkwise.engine.frontend import check_blend
from chunkwise.engine_config import EngineConfig
from chunkwise.serve.engine_loop import Streams, Submission, abort_requests, add_samples
from chunkwise.tokenizer import load_tokenizer

log = logging.getLogger("chunkwise.serve")

START_TIMEOUT_S = 600   # building the engine: loading (or converting) a checkpoint, capturing CUDA graphs
EXIT_WAIT_S = 1         # for the exit code of an engine process whose pipe closed (it is exiting)
_CALLS = ("register_chunk", "unpin")   # the engine methods the server may call by name


class EngineStartError(RuntimeError):
    """The engine process could not build its engine; the message is the engine's error, its type first."""


@dataclass(frozen=True)
class _Hello:
    """What the engine process tells the server once its engine is built."""
    config: EngineConfig
    chunk_registry: str      # the engine's ChunkRegistry name, which its Chunk handles carry
    num_pages: int


@dataclass(frozen=True)
class _Load:
    """The engine's queue depths and pages used, as of its last message."""
    waiting: int = 0
    running: int = 0
    pages_used: int = 0


class EngineView:
    """The server's view of an engine in another process: what validating a request reads (its config, tokenizer,
    chunk registry and blend check), none of its state."""

    def __init__(self, hello: _Hello):
        self.engine_config = config = hello.config
        self.model_config, self.max_model_len = config.model_config, config.max_model_len
        self.tokenizer = load_tokenizer(config.path)
        # only this server registers chunks with its engine, so counting those it registered keeps the mirror exact
        self.chunks = ChunkRegistry("", name=hello.chunk_registry)

    def check_blend(self, blend, index: int = 0) -> None:
        check_blend(self.engine_config, blend, index)


class EngineCore:
    """An engine built and stepped in a spawned process; the server's side of it (see the module docstring)."""

    def __init__(self, model, engine_kwargs: dict | None = None, engine_class: type | None = None):
        """The engine process will build `engine_class(model, **engine_kwargs)`: chunkwise.Engine unless another
        class is given (a stand-in for measuring the server alone; importable, so the spawned process finds it)."""
        self.streams = Streams()
        self.failure: str | None = None
        self.engine: EngineView | None = None           # once started
        self._model, self._kwargs, self._engine_class = str(model), dict(engine_kwargs or {}), engine_class
        self._conn = self._process = None
        self._loop: asyncio.AbstractEventLoop | None = None   # the event loop receiving, once attached
        self._done = False       # the engine process sent its last message (stopped, failed) or closed its pipe
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()   # for the sender; None ends it
        self._sender: threading.Thread | None = None
        self._ids = itertools.count()
        self._submissions: dict[int, Submission] = {}    # sent, not yet answered
        self._calls: dict[int, tuple[str, Future]] = {}
        self._load = _Load()
        self._num_pages = 0
        self._stopping = False

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
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while building its engine (exit code "
                               f"{self._process.exitcode})") from None
        except BaseException:
            self._kill()
            raise
        if kind == "error":
            self._process.join(30)
            self._conn.close()
            raise EngineStartError(payload)
        self.engine = EngineView(payload)
        self._num_pages = payload.num_pages
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
        self._send(("stop",))
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
        """Send the samples to the engine; the future holds their request ids or the engine's error."""
        if self._refused(sub.future) or not sub.future.set_running_or_notify_cancel():
            return sub.future
        sid = next(self._ids)
        self._submissions[sid] = sub
        if not self._send(("add", sid, sub.prompts, sub.params, sub.reuse)):
            self._submissions.pop(sid, None)
            sub.future.set_exception(RuntimeError(self.failure))
        return sub.future

    def register_chunk(self, prompt, pin: bool) -> Future:
        """`Engine.register_chunk(prompt, pin=pin)` between steps; the future holds the Chunk or the error."""
        return self._call("register_chunk", prompt, pin)

    def unpin(self, chunk) -> Future:
        return self._call("unpin", chunk)

    def abort(self, request_ids) -> None:
        """Abort these requests (those still running); returns at once."""
        request_ids = list(request_ids)
        if request_ids:
            self._send(("abort", request_ids))

    def abort_all(self) -> None:
        self._send(("abort", None))

    def num_waiting(self) -> int:
        """Requests not yet admitted: sent but not yet answered, or in the scheduler's waiting queue (as of the
        engine's last message, so at worst a step stale)."""
        return len(self._submissions) + self._load.waiting

    def num_running(self) -> int:
        return self._load.running

    def kv_pages_used(self) -> int:
        return self._load.pages_used

    def kv_pages_total(self) -> int:
        return self._num_pages

    def _call(self, name: str, *args) -> Future:
        future: Future = Future()
        if self._refused(future):
            return future
        future.set_running_or_notify_cancel()
        cid = next(self._ids)
        self._calls[cid] = (name, future)
        if not self._send(("call", cid, name, args)):
            self._calls.pop(cid, None)
            future.set_exception(RuntimeError(self.failure))
        return future

    def _refused(self, future: Future) -> bool:
        if self._stopping or self.failure is not None:
            future.set_exception(RuntimeError(self.failure or "the server is shutting down"))
            return True
        return False

    def _send(self, message: tuple) -> bool:
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

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outs, self._load = message
            self.streams.deliver(outs)
        elif kind == "added":
            _, sid, rids, self._load = message
            sub = self._submissions.pop(sid)
            self.streams.add(sub, rids)   # before the future: its outputs may come next
            sub.future.set_result(rids)
        elif kind == "refused":
            _, sid, exc = message
            self._submissions.pop(sid).future.set_exception(exc)
        elif kind == "result":
            _, cid, ok, value = message
            name, future = self._calls.pop(cid)
            if not ok:
                future.set_exception(value)
                return
            if name == "register_chunk":
                chunks = self.engine.chunks
                chunks.num_issued = max(chunks.num_issued, value.chunk_id + 1)
            future.set_result(value)
        elif kind == "failed":
            self._end()
            self._fail(f"the engine failed: {message[1]}")
        elif kind == "stopped":
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
            self._submissions.pop(sid).future.set_exception(error)
        for cid in list(self._calls):
            self._calls.pop(cid)[1].set_exception(error)


@contextmanager
def settled_heap():
    """For a serving process, once built: collects, then keeps what lives now (modules, the engine, the app: a few
    hundred thousand objects once torch is imported) out of the garbage collector's full passes (gc.freeze), each
    of which otherwise holds the GIL for 0.1-0.3 s: every stream stalled that long, at times, on an H200 at 32 req/s
    (TTFT p99 300 ms against 53 ms driven directly). Unfrozen on exit, so that the process ends freeing it."""
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
        conn.send(("error", f"{type(e).__name__}: {' '.join(str(e).split())}"))
        return
    try:
        conn.send(("ready", _Hello(engine.engine_config, engine.chunks.name, engine.stats().num_pages)))
        with settled_heap():
            _CoreLoop(engine, conn).run()
    finally:
        engine.close()
        conn.close()


class _CoreLoop:
    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self.live: set[int] = set()    # request ids added and not yet finished

    def run(self) -> None:
        engine = self.engine
        while True:
            try:
                if not engine.has_unfinished():
                    self.conn.poll(None)
                messages = []
                while self.conn.poll():
                    messages.append(self.conn.recv())
            except (EOFError, OSError):   # the server is gone
                return
            # EngineLoop's order: aborts, then calls, then submissions
            messages.sort(key=lambda m: {"stop": 0, "abort": 1, "call": 2}.get(m[0], 3))
            if messages and messages[0][0] == "stop":
                self._abort(list(self.live))
                self.conn.send(("stopped",))
                return
            called = False
            for m in messages:
                if m[0] == "abort":   # ids the server was given; a finished one has nothing to abort
                    self._abort(list(self.live) if m[1] is None else m[1])
                elif m[0] == "call":
                    called = True
                    self._call(*m[1:])
                else:
                    self._add(*m[1:])
            # a call may step the engine itself (register_chunk computes the chunk): streamed requests' outputs
            # made then wait in the engine's backlog for the next step(), taken even if nothing is unfinished
            if not engine.has_unfinished() and not called:
                continue
            try:
                outs = engine.step()
            except Exception as exc:   # not contained by the engine (it contains a failing step's requests)
                self.conn.send(("failed", f"{type(exc).__name__}: {exc}"))
                return
            self._send_outputs(outs)

    def _load(self) -> _Load:
        stats = self.engine.stats()
        return _Load(stats.num_waiting, stats.num_running, stats.pages_used)

    def _send_outputs(self, outs) -> None:
        for out in outs:
            if out.finished:
                self.live.discard(out.request_id)
        self.conn.send(("outputs", outs, self._load()))

    def _abort(self, rids) -> None:
        outs = abort_requests(self.engine, rids)
        if outs:
            self._send_outputs(outs)

    def _call(self, cid: int, name: str, args: tuple) -> None:
        assert name in _CALLS, name
        try:
            self.conn.send(("result", cid, True, getattr(self.engine, name)(*args)))
        except Exception as exc:
            self.conn.send(("result", cid, False, _portable(exc)))

    def _add(self, sid: int, prompts: list, params: list, reuse: list | None) -> None:
        try:
            rids = add_samples(self.engine, prompts, params, reuse)
        except Exception as exc:   # validation: nothing of this submission stays queued
            self.conn.send(("refused", sid, _portable(exc)))
            return
        self.live.update(rids)
        self.conn.send(("added", sid, rids, self._load()))


def _portable(exc: Exception) -> Exception:
    """The error as the server's side handles it (TypeError and ValueError: a bad request), with only its message,
    so that it pickles whatever it held."""
    kind = type(exc) if type(exc) in (TypeError, ValueError) else RuntimeError
    return kind(str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}")
