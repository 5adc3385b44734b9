"""The engine on a thread of the server's process (`--no-engine-process`): the server's side (`EngineClient`) and
the engine's `EngineDriver` over in-thread queues.

The server's messages go into an inbox that wakes the engine thread, which the driver drains between steps; the
driver's messages are handled at once on the engine thread (the client decodes the outputs there and `Streams`
hands them to the event loop). Because the same thread adds a request and later routes its outputs, no output can
arrive before its queue is known. engine_core.py is the other transport: the same driver in a process of its own.
"""
from __future__ import annotations

import cProfile
import queue
import threading

from chunkwise.serve.client import EngineClient
from chunkwise.serve.driver import EngineDriver
from chunkwise.serve.messages import Stop


class _ThreadTransport:
    """The driver's side of an in-thread transport: the inbox the server fills, and the client's handler for what
    the driver sends."""

    def __init__(self, handle):
        self.send = handle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()

    def put(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def recv(self, wait: bool) -> list:
        if wait:
            self._wake.wait()
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
        run = self._driver.run if profile is None else lambda: profile.runcall(self._driver.run)
        self._thread = threading.Thread(target=run, name="chunkwise-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request gets its "abort" output) and end the thread."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._transport.put(Stop())
            self._thread.join(timeout)

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
