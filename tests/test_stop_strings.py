"""Stop strings in the output processor (chunkwise/engine/outputs.py), shared by `Engine.generate`, `add_request` /
`step` and the server: the text ends before the first stop string to complete, finish_reason "stop"; the tokens and
logprobs end with the one that completed it; the request is aborted in the core at once (nothing is left running);
a streamed request's pieces join to that text and the stop's piece arrives with its finish; a stop string the very
last token completes still says "stop"; and SamplingParams.stop refuses what is not a list of non-empty strings,
by name. The matching itself, piece by piece, is tests/test_serve.py's Hypothesis test of StopStrings.
"""
from __future__ import annotations

import pytest

from chunkwise.engine import Engine
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import decode

PROMPT = [21, 22, 23]


@pytest.fixture(scope="module")
def engine(tiny_ckpt_with_byte_tokenizer):
    with Engine(tiny_ckpt_with_byte_tokenizer, dtype="float32", device="cpu", page_size=4, num_pages=64,
                max_model_len=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def free(engine):
    """The prompt's greedy output without a stop string, and a two-character stop string first found at k >= 2."""
    want = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))[0]
    k = next(k for k in range(2, len(want.text) - 1) if want.text.find(want.text[k:k + 2]) == k)
    return want, k, want.text[k:k + 2]


def completing(engine, token_ids: list[int], stop: str) -> int:
    """How many tokens it takes for the text to contain `stop`."""
    return next(n for n in range(1, len(token_ids) + 1) if stop in decode(engine.tokenizer, token_ids[:n]))


def test_generate_ends_the_text_before_the_stop_string_and_the_tokens_with_the_one_completing_it(engine, free,
                                                                                                 monkeypatch):
    want, k, stop = free
    aborts = []   # what the core had generated when the stop string's abort reached it
    abort = engine.core.abort
    monkeypatch.setattr(engine.core, "abort", lambda rid: aborts.append(abort(rid)) or aborts[-1])
    got = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1,
                                                   stop=[stop, "\x00never"]))[0]
    n = completing(engine, want.token_ids, stop)
    assert (got.text, got.finish_reason) == (want.text[:k], "stop")
    assert got.token_ids == want.token_ids[:n] and got.logprobs == want.logprobs[:n]
    assert not engine.has_unfinished() and engine.stats().pages_used == 0
    assert [len(a.output.token_ids) for a in aborts] == [n]   # aborted in the core at once, not run on


def test_a_streamed_request_gets_the_cut_text_and_the_stops_piece_with_its_finish(engine, free):
    want, k, stop = free
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=stop))
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == rid]
    n = completing(engine, want.token_ids, stop)
    assert "".join(o.new_text for o in outs) == outs[-1].output.text == want.text[:k]
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].output.token_ids == want.token_ids[:n]
    assert outs[-1].finish_reason == outs[-1].output.finish_reason == "stop" and outs[-1].new_token_ids
    assert not engine.has_unfinished()


def test_a_stop_string_the_last_token_completes_still_says_stop(engine, free):
    want, k, stop = free
    n = completing(engine, want.token_ids, stop)
    got = engine.generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True, stop=stop))[0]
    assert (got.text, got.finish_reason, got.token_ids) == (want.text[:k], "stop", want.token_ids[:n])


def test_a_stop_string_never_completed_leaves_the_output_whole(engine, free):
    want, _, _ = free
    got = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, stop=["\x00never"]))[0]
    assert (got.text, got.finish_reason) == (decode(engine.tokenizer, want.token_ids[:4]), "length")
    assert got.token_ids == want.token_ids[:4]


@pytest.mark.parametrize("stop, error, named", [("", ValueError, "''"), ([""], ValueError, "['']"),
                                                ([1], TypeError, "[1]"), (b"x", TypeError, "b'x'")])
def test_sampling_params_refuse_stop_strings_that_are_not_non_empty_strings_by_name(stop, error, named):
    with pytest.raises(error, match=r"SamplingParams\.stop") as e:
        SamplingParams(stop=stop)
    assert named in str(e.value)


def test_sampling_params_take_one_stop_string_or_several():
    assert SamplingParams(stop="ab").stop == ("ab",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
