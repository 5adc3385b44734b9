"""The engine on a thread of the server's process (`--no-engine-process`): the server's side (`EngineClient`) and
the engine's `EngineDriver` over in-thread queues.

The server's messages go into an inbox that wakes the engine thread, which the driver drains between steps; the
driver's messages are handled at once on the engine thread (the client decodes the outputs there and `Streams`
hands them to the event loop). Because the same thread adds a request and later routes its outputs, no output can
arrive before its queue is known. engine_core.py is the other transport: the same driver in a process of its own.

The engine thread is the engine's only stepper: another thread that called the Engine directly (`generate`,
`register_chunk`) while it runs would step the same core, and each would take the other's outputs, so such a call
is refused by name. `paused()` holds the engine thread, once idle, for such a caller.
"""
from __future__ import annotations

import cProfile
import queue
import threading
import time
from contextlib import contextmanager

from chunkwise.serve.client import EngineClient
from chunkwise.serve.driver import EngineDriver
from chunkwise.serve.messages import Stop


PAUSE_POLL_S = 0.0005   # how often a driver let go of the turn looks again while a pauser wants it


class _ThreadTransport:
    """The driver's side of an in-thread transport: the inbox the server fills, and the client's handler for what
    the driver sends."""

    def __init__(self, handle):
        self.send = handle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self.turn = threading.Lock()   # held by whoever steps the engine: the engine thread, or a pauser
        self.holder: int | None = None  # the thread holding the turn
        self.pausers = 0               # pausers waiting for or holding the turn
        self.count = threading.Lock()  # guards `pausers`

    def take(self) -> None:
        self.turn.acquire()
        self.holder = threading.get_ident()

    def give(self) -> None:
        self.holder = None
        self.turn.release()

    def check_turn(self, call: str) -> None:
        """The served Engine asks this before each call that steps or changes it: only the turn's holder may."""
        if self.holder != threading.get_ident():
            raise RuntimeError(f"Engine.{call}: this engine is served, its engine thread steps it; call it inside "
                               f"`with loop.paused():` (chunkwise/serve/engine_loop.py)")

    def put(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def recv(self, wait: bool) -> list:
        """What the server sent. A driver with nothing in flight (`wait`) lets go of the turn while it waits, so a
        pauser may take it, and takes it back before it handles what came."""
        if wait:
            self.give()
            try:
                self._wake.wait()
            finally:
                while self.pausers:   # a lock is not fair: a woken driver could take the turn before a pauser
                    time.sleep(PAUSE_POLL_S)
                self.take()
        self._wake.clear()
        return list(_drained(self._inbox))


class EngineLoop(EngineClient):
    """An Engine of this process, stepped on a thread of its own by the engine driver; the server's side of it."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine   # the app's validation surface; the client validates with its frontend
        self._connect(engine.frontend, engine.stats().num_pages)
        self._transport = _ThreadTransport(lambda message: self._handle(message))
        self._driver = EngineDriver(engine.core, self._transport)
        self._thread: threading.Thread | None = None

    def start(self, profile: cProfile.Profile | None = None) -> None:
        """Starts the engine thread (its driver run under `profile`, if given: cProfile follows one thread)."""
        drive = self._driver.run if profile is None else lambda: profile.runcall(self._driver.run)

        def run():
            self._transport.take()
            try:
                drive()
            finally:
                self._transport.give()

        self.engine.hand_over(self._transport.check_turn)
        self._thread = threading.Thread(target=run, name="chunkwise-engine", daemon=True)
        self._thread.start()

    @contextmanager
    def paused(self):
        """Holds the engine thread once it has no request in flight, so that this thread may use `self.engine`
        directly (its `generate`, `register_chunk`, ...): it would otherwise step the server's requests and take
        their outputs. Requests the server sends meanwhile wait until the block ends."""
        transport = self._transport
        with transport.count:
            transport.pausers += 1
        try:
            transport.take()
            try:
                yield self.engine
            finally:
                transport.give()
        finally:
            with transport.count:
                transport.pausers -= 1

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request gets its "abort" output) and end the thread."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._transport.put(Stop())
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.hand_over(None)

    def close(self) -> None:
        """stop(), then close the engine."""
        self.stop()
        self.engine.close()

    def _send(self, message) -> bool:
        if self._done:
            return False
        self._transport.put(message)
        return True


def _drained(q: queue.SimpleQueue):
    """What q holds now, taken without waiting."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
