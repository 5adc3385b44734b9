"""The output processor: the caller's side of the engine core, where token ids become text.

The core reports token ids (`CoreOutput`, `PrefixOutput`). `OutputProcessor` runs wherever the caller is (the
library facade's thread, the server's process): it decodes each streamed request's text as its tokens arrive
(`TextStream`) and its whole text once it finishes, fills in the `chunk_reuse` report of a composite prompt, and
hands each output to whoever waits for it: the call that added it (`generate`, `register_chunk`, `prefill_kv`), or
the next `step()` for a request queued by `add_request`.

Stop strings (`SamplingParams.stop`) are matched here, as vLLM v1's output processor does: the core never sees
text. The output whose text completes one carries the text before it; its request is then listed by
`take_stopped` for the caller to abort in the core, and the abort's output (its chunk_reuse, its cached tokens)
finishes it with finish_reason "stop", its tokens and logprobs cut after the one that completed the stop string.
The matching output and that last one are handed over as one: a stream sees the stop string's piece together with
its finish. Tokens the core made in between are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from chunkwise.chunks import reuse_report
from chunkwise.sampling import RequestOutput
from chunkwise.tokenizer import TextStream, decode
from chunkwise.engine.core import CoreOutput, PrefixOutput
from chunkwise.engine.frontend import Frontend
from chunkwise.engine.stop_strings import StopStrings


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
    stream: TextStream | None     # its text so far, when streamed (or watched for stop strings) with a tokenizer
    sink: list | None             # where its outputs go; None: the next step()
    stops: StopStrings | None = None
    text: str = ""                # the text handed over so far, when watched for stop strings
    num_tokens: int = 0           # tokens handed over so far, likewise
    stopped: StepOutput | None = None   # a stop string completed: that output, until the core's last one comes


class OutputProcessor:
    """Text, stop strings, reports and routing for one caller's requests (see the module docstring)."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend   # its tokenizer decodes: the one requests are validated and encoded with
        self._tracked: dict[int, _Tracked] = {}
        self._unclaimed: list[StepOutput] = []   # outputs for the next step(), made while a call stepped the core
        self._stopped: list[int] = []            # requests a stop string ended, for the caller to abort

    def add(self, request_id: int, pieces=None, stream: bool = False, sink: list | None = None,
            stop: tuple[str, ...] = ()) -> None:
        """Track a request: `stream` decodes its text piece by piece; `sink` takes its outputs (else step() does);
        `stop`: its stop strings (they need a tokenizer: the frontend refuses them without one)."""
        watch = (stream or stop) and self.tokenizer is not None
        stops = StopStrings(list(stop)) if stop and self.tokenizer is not None else None
        self._tracked[request_id] = _Tracked(pieces, TextStream(self.tokenizer) if watch else None, sink, stops)

    def forget(self, request_id: int) -> None:
        self._tracked.pop(request_id, None)

    def process(self, outs: list[CoreOutput | PrefixOutput]) -> None:
        """Each output, with its text, to its request's sink."""
        for out in outs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            result = out if isinstance(out, PrefixOutput) else self.convert(out, tracked)
            if result is None:   # after a stop string: dropped, or held for the core's last output
                continue
            if result.finished:
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

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    def take_unclaimed(self) -> list[StepOutput]:
        outs, self._unclaimed = self._unclaimed, []
        return outs

    def take_stopped(self) -> list[int]:
        """The requests a stop string ended since the last call, still running in the core: abort each there (its
        abort's output, processed, finishes it)."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def convert(self, out: CoreOutput, tracked: _Tracked) -> StepOutput | None:
        """A core output with its text: the new piece of a streamed request, the whole text once finished. None
        while a request a stop string ended waits for its last output."""
        if tracked.stopped is not None:
            if not out.finished:
                return None
            held = tracked.stopped
            return replace(held, finish_reason="stop", output=self._final(out.output, tracked, "stop"))
        text = ""
        if tracked.stream is not None:
            text = tracked.stream.push(out.new_token_ids)
            if out.finished:
                text += tracked.stream.finish()
        if tracked.stops is None:
            final = None if out.output is None else self._final(out.output, tracked, out.finish_reason)
            return StepOutput(out.request_id, out.new_token_ids, out.new_logprobs, out.finish_reason, final, text)
        text, stopped = tracked.stops.push(text)
        if not stopped and out.finished:
            text += tracked.stops.flush()
        tracked.text += text
        tracked.num_tokens += len(out.new_token_ids)
        result = StepOutput(out.request_id, out.new_token_ids, out.new_logprobs, out.finish_reason, None, text)
        if stopped and not out.finished:
            tracked.stopped = result
            self._stopped.append(out.request_id)
            return None
        reason = "stop" if stopped else out.finish_reason
        if out.finished:
            result.finish_reason, result.output = reason, self._final(out.output, tracked, reason)
        return result

    def _final(self, final: RequestOutput, tracked: _Tracked, reason: str) -> RequestOutput:
        """The finished request's output: its text (up to a stop string), its chunk_reuse report."""
        report = final.chunk_reuse or reuse_report(tracked.pieces, final.num_cached_tokens)
        if tracked.stops is None:
            return replace(final, text=decode(self.tokenizer, final.token_ids), chunk_reuse=report)
        n = tracked.num_tokens   # tokens past the one that completed a stop string were never handed over
        return replace(final, text=tracked.text, token_ids=final.token_ids[:n], finish_reason=reason,
                       logprobs=None if final.logprobs is None else final.logprobs[:n], chunk_reuse=report)
