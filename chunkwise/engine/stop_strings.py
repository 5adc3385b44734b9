"""Stop strings on decoded text: the engine core stops on token ids only, so the output processor watches the text.

The output ends before the first stop string to complete (OpenAI and vLLM leave the stop string out). Text that
could be the beginning of a stop string is held back until the next piece says whether it is one, so no streamed
piece ever carries part of a stop string.
"""
from __future__ import annotations


class StopStrings:
    """One request's text, piece by piece: `push` returns what may be sent now and whether a stop string ended
    it; `flush` returns the held-back rest once the request ended without one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""          # text received but not sent: a suffix that begins some stop string
        self.stopped = False

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.held + piece
        # The stop string that completes first (the least end; at equal ends, the longer one) ends the text, as it
        # would have one token at a time, so where the text was cut into pieces does not matter.
        hits = [(i + len(s), i) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)[1]], True
        keep = max((self._partial(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """The length of the longest suffix of text that is a proper prefix of stop."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
