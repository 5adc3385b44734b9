"""Scenarios for the deterministic-mode tests (CPU and GPU): one engine run under drawn paging and scheduling,
with what each prompt got, read back bitwise.

A scenario fixes the page size, the token budget (which chunks prompts that carry no chunk sizes), the running
cap, the page pool (a tight one preempts), prefix caching and which decodes take the decode path (in the default
mode split-KV, in deterministic mode paged_attention with one-token sequences), and for each prompt the step it arrives at and its
chunk sizes. `run_case` streams it through `add_request` / `step` and, after every step, reads each running
request's K/V from its pages: so the K/V a request wrote by prefill, by decode and by recompute after a
preemption are all compared, not only the ones a later prefill writes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from chunkwise.engine import Engine, SamplingParams


@dataclass(frozen=True)
class Arrival:
    prompt: int                            # index into the prompts
    step: int                              # engine step before which it is added
    chunk_sizes: tuple[int, ...] | None    # caller chunks, or None: the budget chunks it


@dataclass(frozen=True)
class Case:
    page_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_pages: int | None                  # None: room for every arrival at full length, and more
    prefix_caching: bool
    split_kv_threshold: int | None         # 0: decodes take the decode path; None: the device's default
    arrivals: tuple[Arrival, ...]
    readback_chunks: tuple[int, ...] | None  # chunking of the final prefill_kv of the first arrival


@dataclass
class Outcome:
    tokens: dict[int, list[int]]                          # prompt index -> generated tokens
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]      # prompt index -> K/V last read from its pages
    readback: tuple[torch.Tensor, torch.Tensor]           # prefill_kv(prompt + tokens[:-1]) of the first arrival
    preemptions: int


def cuts(draw, length: int) -> tuple[int, ...] | None:
    """None, or chunk sizes summing to length (cut points drawn, one-token chunks allowed)."""
    if draw(st.booleans()):
        return None
    points = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3))) if length > 1 else []
    return tuple(b - a for a, b in zip([0, *points], [*points, length]))


@st.composite
def cases(draw, prompt_lens: list[int], max_tokens: int, max_page_size: int = 9) -> Case:
    page_size = draw(st.integers(1, max_page_size))
    chosen = draw(st.permutations(range(len(prompt_lens))))
    chosen = chosen[:draw(st.integers(1, len(chosen)))]
    arrivals = tuple(Arrival(i, draw(st.integers(0, 3)), cuts(draw, prompt_lens[i])) for i in chosen)
    # The pool must hold the longest request alone; from there to roomy, tight pools preempt.
    need = [math.ceil((prompt_lens[i] + max_tokens - 1) / page_size) for i in chosen]
    num_pages = draw(st.one_of(st.none(), st.integers(max(need), sum(need) + 2)))
    return Case(page_size, draw(st.integers(3, 40)), draw(st.integers(1, 3)), num_pages, draw(st.booleans()),
                draw(st.sampled_from([0, None])), arrivals, cuts(draw, prompt_lens[chosen[0]] + max_tokens - 1))


def solo_run(model, prompts: list[list[int]], max_tokens: int, deterministic: bool = True, **engine_kwargs):
    """Each prompt alone and unchunked (page size 16): its greedy tokens, and the K/V of prompt + all generated
    tokens but the last computed by one prefill in a fresh engine without prefix caching (nothing reused)."""
    # An explicit pool: sizing one from free GPU memory would count the allocator's cache of earlier engines.
    pages = math.ceil((max(map(len, prompts)) + max_tokens) / 16) + 4

    def engine():
        return Engine(model, deterministic=deterministic, page_size=16, num_pages=pages, enable_prefix_caching=False,
                      **engine_kwargs)
    eng = engine()
    tokens = [eng.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids for p in prompts]
    del eng
    eng = engine()
    return tokens, [eng.prefill_kv(p + t[:-1]) for p, t in zip(prompts, tokens)]


def run_case(model, prompts: list[list[int]], case: Case, max_tokens: int, deterministic: bool = True,
             **engine_kwargs) -> Outcome:
    roomy = 2 * sum(math.ceil((len(prompts[a.prompt]) + max_tokens) / case.page_size) for a in case.arrivals) + 8
    eng = Engine(model, page_size=case.page_size, max_num_batched_tokens=case.max_num_batched_tokens,
                 max_num_seqs=case.max_num_seqs, num_pages=case.num_pages or roomy, enable_prefix_caching=case.prefix_caching,
                 split_kv_threshold=case.split_kv_threshold, deterministic=deterministic, **engine_kwargs)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending = sorted(case.arrivals, key=lambda a: a.step)
    prompt_of, tokens, kv, preemptions, step = {}, {}, {}, 0, 0
    while pending or eng.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            prompt_of[eng.add_request(prompts[a.prompt], greedy, chunk_sizes=a.chunk_sizes)] = a.prompt
        for out in eng.step():
            if out.finished:
                tokens[prompt_of[out.request_id]] = out.output.token_ids
        for seq in eng.scheduler.running:
            kv[prompt_of[seq.seq_id]] = eng.executor.gather_kv(seq, seq.num_computed_tokens)
            preemptions = max(preemptions, seq.num_preemptions)
        step += 1
    first = case.arrivals[0].prompt
    readback = eng.prefill_kv(prompts[first] + tokens[first][:-1], chunk_sizes=case.readback_chunks)
    return Outcome(tokens, kv, readback, preemptions)


def assert_bitwise(outcome: Outcome, case: Case, solo_tokens: list[list[int]],
                   solo_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every prompt's tokens, the K/V read from its pages during the run and the final prefill_kv readback equal
    the solo run's bitwise (solo_kv: K/V of prompt + all generated tokens but the last, by one prefill)."""
    for a in case.arrivals:
        i = a.prompt
        assert outcome.tokens[i] == solo_tokens[i], f"prompt {i}: tokens {outcome.tokens[i]} != solo {solo_tokens[i]}"
        k, v = outcome.kv[i]
        n = k.shape[1]
        for name, got, want in (("K", k, solo_kv[i][0][:, :n]), ("V", v, solo_kv[i][1][:, :n])):
            assert torch.equal(got, want), (f"prompt {i}: {name} of its first {n} tokens, as written in the run, "
                                            f"differs from one prefill at {_first_difference(got, want)}")
    first = case.arrivals[0].prompt
    for name, got, want in zip("KV", outcome.readback, solo_kv[first]):
        assert torch.equal(got, want), f"prompt {first}: prefill_kv {name} differs at {_first_difference(got, want)}"


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    layer, token = (got != want).nonzero()[0, :2].tolist()
    return f"layer {layer}, token {token} (max |diff| {(got.float() - want.float()).abs().max().item():.3g})"
