"""The messages between the server's side of an engine (serve/client.py) and its driver (serve/driver.py).

Dataclasses, each handled through a table by its type on the receiving side; the same messages cross a queue
(the engine on a thread: engine_loop.py) or a pipe (the engine in a process of its own: engine_core.py), so they
pickle: requests arrive validated, outputs leave as token ids (the server's output processor decodes them).
"""
from __future__ import annotations

from dataclasses import dataclass

from chunkwise.engine.core import CoreOutput, EngineStats, PrefixOutput
from chunkwise.engine.frontend import Frontend
from chunkwise.requests import Request


# ---- server -> engine --------------------------------------------------------------------------------------------
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


# ---- engine -> server --------------------------------------------------------------------------------------------
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


IDLE = EngineStats(0, 0, 0, 0, 0, 0)


def portable(exc: Exception) -> Exception:
    """The error as the server's side handles it (TypeError and ValueError: a bad request), with only its message,
    so that it pickles whatever it held."""
    kind = type(exc) if type(exc) in (TypeError, ValueError) else RuntimeError
    return kind(str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}")
