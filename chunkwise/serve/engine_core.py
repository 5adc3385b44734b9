"""The engine in a process of its own, so that the server's per-token Python does not take the GIL from its steps.

In one process, the event loop's work for each streamed token (parsing, JSON, socket writes) competes with the
engine thread's host work for the GIL: a served step took longer than the same step driven directly, and the
clients' inter-token latency grew with it. Here the engine runs in a spawned process (vLLM's "engine core"), and
the transport between the server's side (`EngineClient`, serve/client.py) and the `EngineDriver` (serve/driver.py)
is one duplex pipe carrying both directions, in order: a submission's request ids reach the server before any of
their outputs.

- `EngineCore` is the server's side. Once the engine is built it receives the engine's `Frontend` (sent over
  picklable) and validates, issues chunks and decodes with it, as engine_loop.py's client does. The server's event
  loop itself receives the engine's messages (`attach`: a reader on the pipe, added on the event loop of the first
  call made on one) and routes outputs through `Streams`, which stamps the tokens' times there: one wake-up per
  step. A thread receiving them had to wake, take the GIL from the event loop, then wake the event loop (measured:
  docs/BENCHMARKS.md, "Behind the code: engine_core"). The server's messages go out through a thread of their own
  (`_send_all`), so the event loop, the pipe's only reader, never blocks writing: an engine process blocked on a
  full pipe of outputs would never read the rest of a submission larger than the pipe holds.
- `_core_main` is the engine's side: the engine's `EngineDriver` over the pipe (`_PipeTransport`).

The engine process ignores SIGINT (Ctrl-C reaches the whole process group; the server drives the shutdown) and
exits when the pipe closes, so it never outlives the server.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import queue
import signal
import threading
import time
from contextlib import contextmanager

from chunkwise.engine import Engine
from chunkwise.serve.client import EngineClient
from chunkwise.serve.driver import EngineDriver
from chunkwise.serve.messages import Ready, StartFailed, Stop
from chunkwise.serve.streams import running_loop

log = logging.getLogger("chunkwise.serve")

START_TIMEOUT_S = 600   # building the engine: loading (or converting) a checkpoint, capturing CUDA graphs
EXIT_WAIT_S = 1         # for the exit code of an engine process whose pipe closed (it is exiting)


class EngineStartError(RuntimeError):
    """The engine process could not build its engine; the message is the engine's error, its type first."""


class EngineCore(EngineClient):
    """An engine built and stepped in a spawned process; the server's side of it (see the module docstring)."""

    def __init__(self, model, engine_kwargs: dict | None = None, engine_class: type | None = None):
        """The engine process will build `engine_class(model, **engine_kwargs)`: chunkwise.Engine unless another
        class is given (a stand-in for measuring the server alone; importable, so the spawned process finds it)."""
        super().__init__()
        self.engine = None    # once started: the engine's Frontend, the app's validation surface
        self._model, self._kwargs, self._engine_class = str(model), dict(engine_kwargs or {}), engine_class
        self._conn = self._process = None
        self._loop: asyncio.AbstractEventLoop | None = None   # the event loop receiving, once attached
        self._outbox: queue.SimpleQueue[object | None] = queue.SimpleQueue()   # for the sender; None ends it
        self._sender: threading.Thread | None = None

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
        self.engine = hello.frontend
        self._connect(hello.frontend, hello.num_pages)
        self._sender = threading.Thread(target=self._send_all, name="chunkwise-engine-core-sender", daemon=True)
        self._sender.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on `loop`, a running event loop (called on it), receives the engine's messages."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._receive)

    def detach(self) -> None:
        """The event loop receives no more (called on it, or once it no longer runs); stop() takes the rest."""
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

    # ---- the transport ---------------------------------------------------------------------------------
    def _send(self, message) -> bool:
        """Queues the message for the sender thread; False once the pipe has closed (the engine process gone: the
        receiving side reports it). Called on an event loop first, that loop receives from now on."""
        if not self._sender.is_alive():
            if self.failure is None:
                self.failure = "the engine process is gone"
            return False
        if self._loop is None and not self._stopping and not self._done:
            loop = running_loop()
            if loop is not None:
                self.attach(loop)
        self._outbox.put(message)
        return True

    def _send_all(self) -> None:
        """The sender thread: the queued messages in order, until stop() ends it or the pipe closes."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _receive(self) -> None:
        """Handles the pipe's next message (on the event loop, its reader; or in stop()). One per call: the event
        loop calls again while the pipe is readable, and asking the pipe whether more is there costs about as much
        as unpickling a step's outputs."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._done = True
            self.detach()
            if not self._stopping:
                self._process.join(EXIT_WAIT_S)
                self._fail(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")
            return
        self._handle(message)
        if self._done:   # the engine's last message
            self.detach()


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
class _PipeTransport:
    """The driver's side of the pipe."""

    def __init__(self, conn):
        self.conn = conn

    def recv(self, wait: bool) -> list | None:
        try:
            if wait:
                self.conn.poll(None)
            messages = []
            while self.conn.poll():
                messages.append(self.conn.recv())
        except (EOFError, OSError):   # the server is gone
            return None
        return messages

    def send(self, message) -> None:
        self.conn.send(message)


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
            EngineDriver(engine.core, _PipeTransport(conn)).run()
    finally:
        engine.close()
        conn.close()
