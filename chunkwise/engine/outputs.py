"""The output processor: the caller's side of the engine core, where token ids become text.

The core reports token ids (`CoreOutput`, `PrefixOutput`). `OutputProcessor` runs wherever the caller is (the
library facade's thread, the server's process): it decodes each streamed request's text as its tokens arrive
(`TextStream`) and its whole text once it finishes, fills in the `chunk_reuse` report of a composite prompt, and
hands each output to whoever waits for it: the call that added it (`generate`, `register_chunk`, `prefill_kv`), or
the next `step()` for a request queued by `add_request`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from chunkwise.chunks import reuse_report
from chunkwise.sampling import RequestOutput
from chunkwise.tokenizer import TextStream, decode
from chunkwise.engine.core import CoreOutput, PrefixOutput


@dataclass
class StepOutput:
    """What one step did for one request: its new token (with logprobs if asked) and, once it finished,
    the reason and the whole output."""
    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None     # set once finished
    # A request queued by add_request, with a tokenizer: the text its tokens so far complete (TextStream); joined
    # over its steps, its output's text.
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Tracked:
    pieces: tuple | None          # a composite prompt's pieces, for its chunk_reuse report
    stream: TextStream | None     # its text so far, when streamed with a tokenizer
    sink: list | None             # where its outputs go; None: the next step()


class OutputProcessor:
    """Text, reports and routing for one caller's requests (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._tracked: dict[int, _Tracked] = {}
        self._unclaimed: list[StepOutput] = []   # outputs for the next step(), made while a call stepped the core

    def add(self, request_id: int, pieces=None, stream: bool = False, sink: list | None = None) -> None:
        """Track a request: `stream` decodes its text piece by piece; `sink` takes its outputs (else step() does)."""
        text = TextStream(self.tokenizer) if stream and self.tokenizer is not None else None
        self._tracked[request_id] = _Tracked(pieces, text, sink)

    def forget(self, request_id: int) -> None:
        self._tracked.pop(request_id, None)

    def process(self, outs: list[CoreOutput | PrefixOutput]) -> None:
        """Each output, with its text, to its request's sink."""
        for out in outs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            result = out if isinstance(out, PrefixOutput) else self.convert(out, tracked)
            if out.finished:
                del self._tracked[out.request_id]
            (self._unclaimed if tracked.sink is None else tracked.sink).append(result)

    def ended(self, out: CoreOutput | None, request_id: int) -> StepOutput | None:
        """An abort's output, with its text, to a claiming call's sink (a streamed request gets it returned only)."""
        tracked = self._tracked.pop(request_id, None)
        if out is None or tracked is None or isinstance(out, PrefixOutput):
            return None
        result = self.convert(out, tracked)
        if tracked.sink is not None:
            tracked.sink.append(result)
        return result

    def take_unclaimed(self) -> list[StepOutput]:
        outs, self._unclaimed = self._unclaimed, []
        return outs

    def convert(self, out: CoreOutput, tracked: _Tracked) -> StepOutput:
        """A core output with its text: the new piece of a streamed request, the whole text once finished."""
        text = ""
        if tracked.stream is not None:
            text = tracked.stream.push(out.new_token_ids)
            if out.finished:
                text += tracked.stream.finish()
        final = out.output
        if final is not None:
            final = replace(final, text=decode(self.tokenizer, final.token_ids),
                            chunk_reuse=final.chunk_reuse or reuse_report(tracked.pieces, final.num_cached_tokens))
        return StepOutput(out.request_id, out.new_token_ids, out.new_logprobs, out.finish_reason, final, text)
