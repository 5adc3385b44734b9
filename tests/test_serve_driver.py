"""The engine driver (chunkwise/serve/driver.py), the one loop both server transports run, over a scripted transport:
an abort taken between two steps ends its request with the tokens of the steps before it; between two steps the
driver takes aborts first, then chunk calls, then submissions; a stop ends every request in flight and nothing after
it is taken; and each transport (in-thread queue, pipe) hands over every message sent between two takes, in order.
"""
from __future__ import annotations

import multiprocessing

import pytest

from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.serve.driver import EngineDriver
from chunkwise.serve.engine_core import _PipeTransport
from chunkwise.serve.engine_loop import EngineLoop, _ThreadTransport
from chunkwise.serve.messages import Abort, Added, CallDone, ComputeChunk, Outputs, Stop, Stopped, Submit


class Scripted:
    """A transport whose server sends one batch per take (a batch may be a function of what the driver has sent so
    far), then nothing until the driver is idle, then is gone; it records what the driver sends."""

    def __init__(self, *batches):
        self.batches, self.sent = list(batches), []

    def recv(self, wait: bool):
        if not self.batches:
            return None if wait else []
        batch = self.batches.pop(0)
        return batch(self.sent) if callable(batch) else batch

    def send(self, message) -> None:
        self.sent.append(message)


@pytest.fixture(scope="module")
def engine(tiny_ckpt_with_byte_tokenizer):
    with Engine(tiny_ckpt_with_byte_tokenizer, dtype="float32", device="cpu", page_size=4, num_pages=64,
                max_model_len=128, async_scheduling=False) as engine:
        yield engine


def request(engine, prompt, max_tokens: int = 8):
    return engine.frontend.requests([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def added(sent, sid: int) -> int:
    return next(m.request_ids[0] for m in sent if isinstance(m, Added) and m.sid == sid)


def tokens_of(messages, rid: int) -> list[int]:
    return [t for m in messages if isinstance(m, Outputs) for o in m.outputs if o.request_id == rid
            for t in o.new_token_ids]


def run(engine, *batches) -> list:
    transport = Scripted(*batches)
    EngineDriver(engine.core, transport).run()
    assert not engine.core.has_unfinished()
    return transport.sent


def test_an_abort_taken_between_steps_ends_its_request_with_the_tokens_of_the_steps_before_it(engine):
    sent = run(engine, [Submit(0, [request(engine, [5, 6, 7])])], [], lambda s: [Abort([added(s, 0)])])
    rid = added(sent, 0)
    ended = [o for m in sent if isinstance(m, Outputs) for o in m.outputs if o.request_id == rid and o.finished]
    assert len(ended) == 1 and ended[0].finish_reason == "abort"
    # two steps ran before the abort's batch was taken: one token each (the prompt's prefill gives the first)
    assert tokens_of(sent, rid) == ended[0].output.token_ids and len(ended[0].output.token_ids) == 2


def test_running_requests_are_stepped_without_waiting_for_the_servers_next_message(engine):
    # the scripted server sends one submission and then nothing: the request still runs to its length (a driver
    # that waited for a message would find the server gone and abort it)
    sent = run(engine, [Submit(0, [request(engine, [5, 6, 7], max_tokens=4)])])
    rid = added(sent, 0)
    ended = [o for m in sent if isinstance(m, Outputs) for o in m.outputs if o.request_id == rid and o.finished]
    assert [o.finish_reason for o in ended] == ["length"] and len(tokens_of(sent, rid)) == 4


def test_between_two_steps_aborts_go_first_then_chunk_calls_then_submissions(engine):
    chunk = request(engine, list(range(100, 112)), max_tokens=1)
    sent = run(engine, [Submit(0, [request(engine, [5, 6, 7])])],
               lambda s: [Submit(1, [request(engine, [8, 9])]), ComputeChunk(7, chunk, False), Abort([added(s, 0)])])
    first, second = added(sent, 0), added(sent, 1)
    aborted = next(i for i, m in enumerate(sent) if isinstance(m, Outputs)
                   and any(o.request_id == first and o.finish_reason == "abort" for o in m.outputs))
    assert aborted < sent.index(next(m for m in sent if isinstance(m, Added) and m.sid == 1))
    done = next(m for m in sent if isinstance(m, CallDone))
    assert done.cid == 7 and done.error is None and done.prefix.request_id < second   # queued before submission 1


def test_a_stop_ends_every_request_in_flight_and_takes_nothing_after_it(engine):
    sent = run(engine, [Submit(0, [request(engine, [5, 6])]), Submit(1, [request(engine, [7, 8])])],
               [Submit(2, [request(engine, [9])]), Stop()], [Submit(3, [request(engine, [10])])])
    assert isinstance(sent[-1], Stopped)
    assert sorted(m.sid for m in sent if isinstance(m, Added)) == [0, 1]
    ends = {o.request_id: o.finish_reason for m in sent if isinstance(m, Outputs) for o in m.outputs if o.finished}
    assert ends == {added(sent, 0): "abort", added(sent, 1): "abort"}


def test_the_in_thread_transport_hands_over_every_message_put_between_two_takes_in_order():
    transport = _ThreadTransport(handle=None)
    messages = [Abort([1]), Submit(0, []), Abort(None)]
    for m in messages:
        transport.put(m)
    with transport.turn:   # the engine thread's, as EngineLoop.start takes it
        assert transport.recv(wait=True) == messages and transport.recv(wait=False) == []
        transport.put(Stop())
        assert transport.recv(wait=True) == [Stop()]


def test_the_pipe_transport_hands_over_every_message_sent_between_two_takes_in_order_and_none_once_closed():
    server, engine_side = multiprocessing.Pipe()
    transport = _PipeTransport(engine_side)
    messages = [Abort([1]), Submit(0, []), Abort(None)]
    for m in messages:
        server.send(m)
    assert transport.recv(wait=True) == messages and transport.recv(wait=False) == []
    server.close()
    assert transport.recv(wait=True) is None


def test_a_loops_engine_refuses_direct_calls_while_its_thread_runs_and_is_the_callers_again_once_stopped(engine):
    """EngineLoop.start hands the engine to its thread: a direct call from elsewhere is refused by name (inside
    `paused()` it runs); once the loop has stopped, the engine is the caller's again."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    loop = EngineLoop(engine)
    loop.start()
    try:
        with pytest.raises(RuntimeError, match=r"Engine\.generate: this engine is served"):
            engine.generate([[5, 6, 7]], params)
        with loop.paused() as eng:
            assert len(eng.generate([[5, 6, 7]], params)[0].token_ids) == 2
    finally:
        loop.stop()
    assert len(engine.generate([[5, 6, 7]], params)[0].token_ids) == 2
