"""chunkwise.sampling against an independent oracle (HF transformers' logits warpers), its logprobs, and
SamplingParams' validation.

Both engines sample through chunkwise.sampling, so a bug there would hide from the parity suite: here
temperature, top-k and top-p (alone and combined) must give the distribution HF's TemperatureLogitsWarper,
TopKLogitsWarper and TopPLogitsWarper give, bit for bit, and the same token under the same seeded draw.
"""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from chunkwise.sampling import GREEDY_TEMPERATURE, SamplingParams, make_generator, sample, sampling_probs, token_logprobs

pytestmark = pytest.mark.correctness


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution HF `generate(do_sample=True)` draws from: its warpers in generate's order."""
    scores = logits.float()[None]
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, dim=-1)[0]


@st.composite
def logit_rows(draw):
    """A row of logits: flat, unit or peaked, often with ties (small integers repeat)."""
    vocab = draw(st.integers(1, 48))
    values = draw(st.lists(st.one_of(st.integers(-3, 3).map(float), st.floats(-4, 4, width=32)),
                           min_size=vocab, max_size=vocab))
    scale = draw(st.sampled_from([0.01, 1.0, 8.0]))    # flat, unit, peaked
    return torch.tensor(values, dtype=torch.float32) * scale


@st.composite
def cases(draw):
    """(logits, params): top_k drawn up to past the row's vocabulary."""
    logits = draw(logit_rows())
    return logits, SamplingParams(
        temperature=draw(st.sampled_from([0.05, 0.5, 1.0, 1.7, 4.0])),
        top_k=draw(st.one_of(st.just(0), st.integers(1, logits.numel() + 2))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))),
        seed=draw(st.integers(0, 2**31)))


TIED = torch.tensor([2.0, 1.0, 2.0, 1.0, 1.0, 0.0, 1.0])


@given(case=cases())
@settings(max_examples=20 * settings().max_examples)   # milliseconds each
# ties at the top-k cut (every token tied with the k-th stays) and at the top-p cut (HF drops tied tokens
# in ascending sort order); a flat row where top-p cuts between equal tokens; one token
@example(case=(TIED, SamplingParams(temperature=1.0, top_k=2, seed=0)))
@example(case=(TIED, SamplingParams(temperature=1.0, top_k=3, seed=0)))
@example(case=(TIED, SamplingParams(temperature=1.0, top_p=0.6, seed=0)))
@example(case=(TIED, SamplingParams(temperature=0.5, top_k=5, top_p=0.8, seed=1)))
@example(case=(torch.zeros(8), SamplingParams(temperature=1.0, top_p=0.3, seed=2)))
@example(case=(torch.tensor([0.5]), SamplingParams(temperature=1.0, top_k=3, top_p=0.1, seed=3)))
# the lower of two equal tokens' cumulative mass lands exactly on 1 - top_p (0.5 is exact in binary): HF drops it
@example(case=(torch.zeros(2), SamplingParams(temperature=1.0, top_p=0.5, seed=4)))
def test_distribution_and_seeded_token_equal_hf_warpers(case):
    logits, params = case
    ours, theirs = sampling_probs(logits, params), hf_probs(logits, params)
    assert torch.equal(ours > 0, theirs > 0), (ours, theirs)
    assert torch.equal(ours, theirs), (ours, theirs)
    drawn = int(torch.multinomial(theirs, 1, generator=torch.Generator().manual_seed(params.seed)))
    assert sample(logits, params, torch.Generator().manual_seed(params.seed)) == drawn


@given(seed=st.integers(0, 2**63 - 1))
@example(seed=0)   # a falsy seed is still a seed
def test_a_requests_generator_is_torchs_generator_seeded_with_its_seed(seed):
    """make_generator gives the stream of torch.Generator().manual_seed(seed) for any seed, 0 included, so the
    same seed repeats a request's draws across runs and engines."""
    ours = make_generator(SamplingParams(temperature=1.0, seed=seed), "cpu")
    assert torch.equal(torch.rand(8, generator=ours), torch.rand(8, generator=torch.Generator().manual_seed(seed)))


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    # probabilities 0.2, 0.5, 0.3: each top_p below sits well away from a cut
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    kept = lambda p: (sampling_probs(logits, SamplingParams(temperature=1.0, top_p=p)) > 0).tolist()
    assert kept(0.4) == [False, True, False]
    assert kept(0.6) == [False, True, True]
    assert kept(0.9) == [True, True, True]


def test_top_k_keeps_k_tokens_without_ties():
    logits = torch.tensor([0.1, 0.9, 0.4, 0.7, 0.2])
    kept = (sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist()
    assert kept == [False, True, False, True, False]


def test_greedy_takes_the_first_maximum():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample(logits, SamplingParams(temperature=0.0), None) == 1


@pytest.mark.parametrize("t, greedy", [(0.0, True), (5e-324, True), (1e-6, True), (GREEDY_TEMPERATURE, False),
                                       (0.5, False)])
def test_a_temperature_below_the_greedy_threshold_is_greedy_on_both_sides(t, greedy):
    """As in vLLM: a tiny positive temperature (5e-324 is 0.0 once in float32) is greedy, never a division by it."""
    params = SamplingParams(temperature=t)
    assert params.greedy is greedy
    logits = torch.tensor([0.0, 30.0, 1.0, 29.9])
    if greedy:
        assert sample(logits, params, None) == 1
    else:
        assert torch.isfinite(sampling_probs(logits, params)).all()


# --- logprobs -------------------------------------------------------------------------------------------

def test_logprobs_hold_the_sampled_token_with_its_log_softmax():
    """Temperature 1, no top-k or top-p: every draw's dict holds the sampled token (not just the top-1)
    with logit - logsumexp(logits) there, and the top-k logprobs in order."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=gen) * 0.5     # flat enough that most draws are not the argmax
    exact = logits.double() - torch.logsumexp(logits.double(), 0)
    params = SamplingParams(temperature=1.0, logprobs=3, seed=0)
    draws = [sample(logits, params, gen) for _ in range(20)]
    assert sum(t != int(logits.argmax()) for t in draws) >= 10     # the property is exercised
    for token in draws:
        lp = token_logprobs(logits, token, 3)
        assert token in lp and lp[token] == pytest.approx(float(exact[token]), abs=1e-6)
        top3 = exact.topk(3).indices.tolist()
        assert set(lp) == set(top3) | {token}
        assert all(lp[t] == pytest.approx(float(exact[t]), abs=1e-6) for t in top3)


# --- SamplingParams validation --------------------------------------------------------------------------

@pytest.mark.parametrize("kw,error,named", [
    ({"max_tokens": True}, TypeError, "max_tokens .* True"),
    ({"max_tokens": 0}, ValueError, "max_tokens .* 0"),
    ({"max_tokens": 4.0}, TypeError, "max_tokens .* 4.0"),
    ({"temperature": "0.5"}, TypeError, "temperature .* '0.5'"),
    ({"temperature": float("nan")}, ValueError, "temperature .* nan"),
    ({"temperature": float("inf")}, ValueError, "temperature .* inf"),
    ({"temperature": -0.1}, ValueError, "temperature .* -0.1"),
    ({"temperature": True}, TypeError, "temperature .* True"),
    ({"top_k": 2.5}, TypeError, "top_k .* 2.5"),
    ({"top_k": -1}, ValueError, "top_k .* -1"),
    ({"top_p": 0.0}, ValueError, "top_p .* 0.0"),
    ({"top_p": 1.5}, ValueError, "top_p .* 1.5"),
    ({"top_p": float("nan")}, ValueError, "top_p .* nan"),
    ({"top_p": "0.9"}, TypeError, "top_p .* '0.9'"),
    ({"logprobs": 2.5}, TypeError, "logprobs .* 2.5"),
    ({"logprobs": -1}, ValueError, "logprobs .* -1"),
    ({"seed": "abc"}, TypeError, "seed .* 'abc'"),
    ({"seed": 1.0}, TypeError, "seed .* 1.0"),
    ({"stop_token_ids": 7}, TypeError, r"stop_token_ids .* \[id\].* 7"),
    ({"stop_token_ids": "7"}, TypeError, "stop_token_ids .* '7'"),
    ({"stop_token_ids": [3, 2.5]}, TypeError, r"stop_token_ids .* \(3, 2.5\)"),
    ({"stop_token_ids": [-1]}, ValueError, r"stop_token_ids .* \(-1,\)"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos .* 1"),
])
def test_bad_sampling_params_are_refused_naming_the_value(kw, error, named):
    with pytest.raises(error, match=named):
        SamplingParams(**kw)


def test_sampling_params_are_normalised():
    import numpy as np

    p = SamplingParams(max_tokens=np.int64(4), temperature=1, top_p=np.float32(0.5), seed=np.int32(7),
                       stop_token_ids=[5, np.int64(6)])
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop_token_ids) == (4, 1.0, 0.5, 7, (5, 6))
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[1]) is int
    assert SamplingParams().greedy and not SamplingParams(temperature=math.ulp(0.0)).greedy
