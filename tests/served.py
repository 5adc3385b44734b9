"""The Engine behind a test server on a thread of this process, for tests to compare the server with: its calls
that step or change the engine run with the server's engine thread paused (`EngineLoop.paused`), so the two never
step the same core at once (each would take the other's outputs)."""
from __future__ import annotations

CALLS = frozenset({"generate", "add_request", "step", "register_chunk", "unpin", "prefill_kv"})


class DirectEngine:
    """`loop.engine`, its stepping calls made with the loop paused; every other attribute the engine's own."""

    def __init__(self, loop):
        self._loop = loop

    @property
    def served(self):
        """The Engine itself (to patch its attributes: monkeypatch sets them on the object it is given)."""
        return self._loop.engine

    def __getattr__(self, name):
        attr = getattr(self._loop.engine, name)
        if name not in CALLS:
            return attr

        def paused(*args, **kwargs):
            with self._loop.paused():
                return attr(*args, **kwargs)
        return paused
