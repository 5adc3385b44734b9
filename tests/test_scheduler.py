"""The scheduler, driven by a fake model whose next token is a function of the sequence's tokens.

Because the fake model's output depends only on a sequence's own tokens, every request must produce
exactly what it produces alone, whatever the batching, chunking, preemption or prefix-cache hits. A
shadow "K/V" per page slot (the token prefix it was computed from) catches a step that reads or writes
the wrong page. Page tables fed only each batch's page changes (the runner's) hold every running sequence's
page table, and no row once the requests are done.
"""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, example, given, note, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chunkwise.sampling import SamplingParams
from chunkwise.engine.page_pool import PagePool
from chunkwise.engine.page_tables import PageTables
from chunkwise.engine.scheduler import ScheduledBatch, Scheduler
from chunkwise.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.correctness

VOCAB = 13


def fake_next_token(tokens):
    return (sum(t * (i + 3) for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


def alone(prompt, params, eos=()):
    """What a request produces on its own: (generated tokens, finish reason)."""
    tokens, out = list(prompt), []
    while True:
        t = fake_next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


class Driver:
    """Runs the fake model over a scheduler's steps and checks each step's batch.

    overlap=True drives it as the engine's overlap scheduling does: step k+1 is scheduled and "launched"
    before step k is postprocessed, the fake device knowing the tokens the host does not know yet.
    """

    def __init__(self, sched: Scheduler, overlap: bool = False):
        self.sched, self.bm = sched, sched.page_pool
        self.overlap = overlap
        self.kv = {p: [None] * self.bm.page_size for p in range(self.bm.num_pages)}
        self.tables = PageTables(self.bm.num_pages, torch.device("cpu"), rows=2)   # as the runner's, grown
        self.chunk_ends: dict[int, list[int]] = {}    # prefill step ends of seqs never preempted
        self.steps = 0
        self.preemptions = 0
        self.oversized = 0
        self.device_tokens: dict[int, list[int]] = {}   # seq id -> sampled tokens not yet postprocessed
        self.in_flight: tuple[ScheduledBatch, dict[int, int]] | None = None

    def tokens(self, seq) -> list[int]:
        """The sequence's tokens as the (fake) device knows them: pending ones included."""
        pending = self.device_tokens.get(seq.seq_id, [])[-seq.num_pending:] if seq.num_pending else []
        return seq.token_ids + pending

    def step(self) -> tuple[ScheduledBatch, list[Sequence]]:
        sched, cfg = self.sched, self.sched.engine_config
        assert sched.has_unfinished()
        was_running = {s.seq_id for s in sched.running}
        batch = sched.schedule()
        self.steps += 1
        prev, self.in_flight = self.in_flight, None
        if batch.is_empty:
            assert prev is not None, "an empty step with unfinished requests, none in flight: the scheduler is stuck"
            return batch, self._postprocess(*prev)
        assert len(batch.seqs) == len({s.seq_id for s in batch.seqs})
        assert len(batch.seqs) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        if batch.num_tokens > cfg.max_num_batched_tokens:
            (seq,), (n,) = batch.seqs, batch.num_new_tokens
            assert seq.follows_chunk_sizes() and n == seq.next_chunk_end() - seq.num_computed_tokens, \
                f"over budget: {batch.num_new_tokens} > {cfg.max_num_batched_tokens} without a caller chunk"
            self.oversized += 1
        cap = cfg.max_prefill_tokens_with_decodes
        decodes = [s for s in batch.seqs if s.seq_id in was_running and s.num_uncomputed_tokens == 1]
        split = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens)
                    if s not in decodes and not s.follows_chunk_sizes())
        if decodes and cap is not None:
            assert split <= cap, f"a step that decodes computed {split} prefill tokens, over the cap {cap}"
        for p in batch.preempted:
            assert p.status is SequenceStatus.WAITING and not p.page_table and p.num_computed_tokens == 0
            assert all(p.arrival > r.arrival for r in sched.running), "an older sequence was preempted"
        self.preemptions += len(batch.preempted)
        self.tables.apply(batch.page_changes)
        self._check_tables()
        sampled = {}
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            self._check_and_write(seq, n)
            if samples:
                sampled[seq.seq_id] = fake_next_token(self.tokens(seq))
        sched.advance(batch)
        for seq_id, token in sampled.items():
            self.device_tokens.setdefault(seq_id, []).append(token)
        if not self.overlap:
            return batch, self._postprocess(batch, sampled)
        self.in_flight = batch, sampled
        return batch, self._postprocess(*prev) if prev else []

    def _check_tables(self):
        """Every running sequence's row starts with its page table; no other sequence holds a row."""
        running = self.sched.running
        assert self.tables.seq_ids == {s.seq_id for s in running}, "a freed sequence kept its row, or one has none"
        for seq, row in zip(running, self.tables.rows(running)):
            assert self.tables.host[row, :len(seq.page_table)].tolist() == seq.page_table, f"row of {seq}"

    def _postprocess(self, batch, sampled) -> list[Sequence]:
        finished = self.sched.postprocess(batch, sampled)
        for page in self.bm.pages:   # a cached page holds the tokens its K/V was computed from, all of them
            if page.hash is not None:
                assert page.token_ids == tuple(kv[-1] for kv in self.kv[page.page_id]), f"page {page.page_id}"
        return finished

    def _check_and_write(self, seq, n):
        bm = self.bm
        assert seq.status is SequenceStatus.RUNNING and n >= 1
        assert seq.num_computed_tokens + n <= seq.num_tokens
        assert seq.num_computed_tokens + n < seq.num_prompt_tokens + seq.sampling_params.max_tokens, \
            "a token past the last one was computed: more pages than check_fits allows for"
        assert len(seq.page_table) >= bm.pages_needed(seq.num_computed_tokens + n)
        if seq.follows_chunk_sizes():
            assert seq.num_computed_tokens + n == seq.next_chunk_end(), "a caller chunk was split or merged"
        if seq.num_preemptions == 0 and seq.num_computed_tokens < seq.num_prompt_tokens:
            self.chunk_ends.setdefault(seq.seq_id, []).append(seq.num_computed_tokens + n)
        tokens = self.tokens(seq)
        for pos in range(seq.num_computed_tokens):
            got = self.kv[seq.page_table[pos // bm.page_size]][pos % bm.page_size]
            assert got == tuple(tokens[:pos + 1]), f"{seq} reads wrong K/V at position {pos}"
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            page = seq.page_table[pos // bm.page_size]
            assert bm.pages[page].ref_count == 1, f"{seq} writes into shared page {page}"
            self.kv[page][pos % bm.page_size] = tuple(tokens[:pos + 1])

    def run(self, max_steps=10_000):
        finished = []
        while self.sched.has_unfinished():
            assert self.steps < max_steps
            finished += self.step()[1]
        return finished

    def assert_pool_empty(self):
        assert self.bm.num_free_pages == self.bm.num_pages
        assert all(p.ref_count == 0 for p in self.bm.pages)
        assert not self.sched.running and not self.sched.waiting
        self.tables.apply(self.bm.take_changes())   # the frees since the last batch, which the next would carry
        assert not self.tables.seq_ids, f"rows never released: {self.tables.seq_ids}"


def make(num_pages=64, page_size=4, budget=512, max_seqs=64, eos=(), cap=None):
    bm = PagePool(num_pages, page_size)
    # The scheduler reads these fields of the engine's EngineConfig (validated there).
    limits = SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_prefill_tokens_with_decodes=cap)
    return Scheduler(limits, bm, eos_token_ids=eos)


def assert_alone(seq, eos=()):
    tokens, reason = alone(seq.prompt_token_ids, seq.sampling_params, eos)
    assert (seq.completion_token_ids, seq.finish_reason) == (tokens, reason), f"sequence {seq.seq_id}"


PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 7, 8, 9], [5] * 9)


@st.composite
def workloads(draw):
    # Under pressure every request arrives at once into a pool that holds only the longest one, so
    # running sequences outgrow it and the newest get preempted.
    pressure = draw(st.booleans())
    page_size = draw(st.integers(1, 6))
    max_tokens = draw(st.integers(6, 12) if pressure else st.integers(1, 12))
    requests = []
    for i in range(draw(st.integers(2 if pressure else 1, 6))):
        base = draw(st.sampled_from(PREFIXES))
        prompt = base[:draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1),
                                                                          min_size=1, max_size=8))
        chunks = None
        if draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, len(prompt) - 1), max_size=3))) if len(prompt) > 1 else []
            chunks = [b - a for a, b in zip([0] + cuts, cuts + [len(prompt)])]
        arrive_at = 0 if pressure else draw(st.integers(0, 6))
        requests.append((prompt, chunks, arrive_at, draw(st.booleans())))
    longest = max(len(p) for p, *_ in requests) + max_tokens - 1
    min_pages = -(-longest // page_size)
    num_pages = min_pages if pressure else draw(st.integers(min_pages, 2 * min_pages + 2))
    budget = draw(st.integers(1, 24))
    max_seqs = 4 if pressure else draw(st.integers(1, 4))
    eos = draw(st.sampled_from([(), (3,)]))
    abort = draw(st.none() | st.tuples(st.integers(0, len(requests) - 1), st.integers(0, 8)))
    cap = draw(st.none() | st.integers(1, 8))
    return page_size, max_tokens, requests, num_pages, budget, max_seqs, eos, abort, cap


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@settings(max_examples=10 * settings().max_examples)
@given(workloads())
@example((1, 3, [([1, 2, 3], [1, 1, 1], 0, False), ([1, 2, 3, 4], None, 1, False)], 6, 2, 2, (), None, None))
@example((4, 2, [([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5], 0, False), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 3], [9, 1], 3, True)],
          3, 3, 2, (3,), None, None))
def test_every_request_produces_what_it_produces_alone(overlap, workload):
    """Budget, the prefill cap of steps that decode, seq cap, caller chunks, preemption, prefix reuse, aborts and
    overlap scheduling never change a request's output."""
    page_size, max_tokens, requests, num_pages, budget, max_seqs, eos, abort, cap = workload
    sched = make(num_pages, page_size, budget, max_seqs, eos, cap)
    driver = Driver(sched, overlap)
    seqs = [Sequence(i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), chunks)
            for i, (prompt, chunks, _, ignore_eos) in enumerate(requests)]
    arrivals = sorted(range(len(seqs)), key=lambda i: requests[i][2])
    aborted = None
    while arrivals or sched.has_unfinished():
        while arrivals and (requests[arrivals[0]][2] <= driver.steps or not sched.has_unfinished()):
            sched.add(seqs[arrivals.pop(0)])
        if abort is not None and abort[1] == driver.steps and aborted is None and abort[0] in sched.seqs:
            aborted = sched.abort(abort[0])
            assert aborted.finish_reason == "abort" and not aborted.page_table
            if not sched.has_unfinished():
                continue
        assert driver.steps < 5000
        driver.step()
    driver.assert_pool_empty()
    event(f"preempted: {driver.preemptions > 0}")
    event(f"prefix cache hit: {any(s.num_cached_tokens for s in seqs)}")
    event(f"caller chunk over the budget ran alone: {driver.oversized > 0}")
    for seq in seqs:
        note(f"{seq.seq_id}: prompt {seq.prompt_token_ids} chunks {seq.chunk_sizes} cached {seq.num_cached_tokens}")
        assert seq.num_cached_tokens < seq.num_prompt_tokens and seq.num_cached_tokens % page_size == 0
        if seq is aborted:
            continue
        assert_alone(seq, eos)
        if seq.chunk_sizes is not None and seq.seq_id in driver.chunk_ends:
            boundaries = [sum(seq.chunk_sizes[:k + 1]) for k in range(len(seq.chunk_sizes))]
            ends = driver.chunk_ends[seq.seq_id]
            if seq.num_preemptions == 0:
                assert ends == [b for b in boundaries if b > seq.num_cached_tokens]
            else:
                assert set(ends) <= set(boundaries)


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, steps run, requests are aborted at any point; the rest still produce their own output."""

    @initialize(page_size=st.integers(1, 4), extra_pages=st.integers(0, 6), budget=st.integers(1, 12),
                max_seqs=st.integers(1, 4), overlap=st.booleans())
    def setup(self, page_size, extra_pages, budget, max_seqs, overlap):
        # Room for the longest request (9 + 4 prompt tokens, max_tokens 6) and a few pages more.
        self.sched = make(-(-18 // page_size) + extra_pages, page_size, budget, max_seqs, eos=(3,))
        self.driver = Driver(self.sched, overlap)
        self.all: list[Sequence] = []

    @rule(data=st.data())
    def arrive(self, data):
        base = data.draw(st.sampled_from(PREFIXES))
        prompt = base[:data.draw(st.integers(0, 9))] + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                         max_size=4))
        chunks = data.draw(st.sampled_from([None, [len(prompt)], [1] * len(prompt)]))
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 6)), ignore_eos=data.draw(st.booleans()))
        seq = Sequence(len(self.all), prompt, params, chunks)
        self.all.append(seq)
        self.sched.add(seq)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self):
        self.driver.step()

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        seq = self.sched.abort(data.draw(st.sampled_from(sorted(self.sched.seqs))))
        assert seq.finish_reason == "abort" and not seq.page_table and seq.seq_id not in self.sched.seqs

    @invariant()
    def pages_belong_to_running_sequences_only(self):
        bm = self.sched.page_pool
        refs = [0] * bm.num_pages
        for seq in self.sched.running:
            for p in seq.page_table:
                refs[p] += 1
        assert [p.ref_count for p in bm.pages] == refs
        assert all(not s.page_table and s.num_computed_tokens == 0 for s in self.sched.waiting)
        assert len(self.sched.running) <= self.sched.engine_config.max_num_seqs
        assert bm.num_free_pages == sum(r == 0 for r in refs)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.driver.run()
        self.driver.assert_pool_empty()
        for seq in self.all:
            if seq.finish_reason != "abort":
                assert_alone(seq, eos=(3,))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(settings(), max_examples=5 * settings().max_examples, stateful_step_count=30)


def test_decodes_and_prefill_chunks_are_mixed_in_one_step():
    sched = make(budget=6)
    a, b = Sequence(0, [1, 2, 3]), Sequence(1, list(range(10)))
    sched.add(a)
    driver = Driver(sched)
    driver.step()                                       # a's prompt
    sched.add(b)
    batch, _ = driver.step()
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [(0, 1), (1, 5)]
    batch, _ = driver.step()
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [(0, 1), (1, 5)]
    assert batch.samples == [True, True]


def test_a_long_prompt_is_split_by_the_budget():
    sched = make(budget=4)
    sched.add(Sequence(0, list(range(10)), SamplingParams(max_tokens=2)))
    driver = Driver(sched)
    assert [driver.step()[0].num_new_tokens for _ in range(4)] == [[4], [4], [2], [1]]
    assert not sched.has_unfinished()


def test_a_caller_chunk_that_does_not_fit_the_remaining_budget_waits():
    sched = make(budget=8)
    sched.add(Sequence(0, [1, 2, 3]))
    sched.add(Sequence(1, list(range(8)), chunk_sizes=[7, 1]))
    driver = Driver(sched)
    steps = [[(s.seq_id, n) for s, n in zip(b.seqs, b.num_new_tokens)] for b in (driver.step()[0] for _ in range(3))]
    assert steps == [[(0, 3)], [(0, 1), (1, 7)], [(0, 1), (1, 1)]]


def test_a_caller_chunk_larger_than_the_budget_runs_alone():
    sched = make(budget=4)
    sched.add(Sequence(0, [1, 2]))
    driver = Driver(sched)
    driver.step()
    sched.add(Sequence(1, list(range(10)), chunk_sizes=[10]))
    steps = [[(s.seq_id, n) for s, n in zip(b.seqs, b.num_new_tokens)] for b in (driver.step()[0] for _ in range(3))]
    assert steps == [[(0, 1)], [(1, 10)], [(0, 1), (1, 1)]]


class CountingPlanner:
    """A row planner that makes no plans and counts each sequence's caller chunk as `counted[seq_id]` rows."""

    def __init__(self, counted: dict[int, int]):
        self.counted = counted

    def plan(self, seq, pool):
        return None

    def approximate_from(self, seq):
        return None

    def counted_rows(self, seq, computed, n, page_size):
        return self.counted[seq.seq_id]


@pytest.mark.parametrize("rows, counted, admitted", [
    ((20, 20), (4, 4), [0, 1]),   # 40 rows: the step's rows exactly
    ((20, 21), (4, 4), [0]),      # 41 rows: one past
    ((20, 20), (6, 4), [0, 1]),   # 10 counted: the budget exactly
    ((20, 20), (6, 5), [0]),      # 11 counted: one past
])
def test_planned_chunks_share_a_step_while_their_counted_rows_fit_the_budget_and_their_rows_the_steps(
        rows, counted, admitted):
    """A caller chunk counts the rows its row planner says against the budget (`RowPlanner.counted_rows`, a
    blend's computed ones) and all its rows against the step's `max_blended_rows`: each limit admits a chunk that
    reaches it exactly and refuses one past it."""
    limits = SimpleNamespace(max_num_batched_tokens=10, max_blended_rows=40, max_num_seqs=8,
                             max_prefill_tokens_with_decodes=None)
    sched = Scheduler(limits, PagePool(64, 4), row_planner=CountingPlanner(dict(enumerate(counted))))
    for i, n in enumerate(rows):
        sched.add(Sequence(i, list(range(1, n + 1)), chunk_sizes=[n]))
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == admitted
    assert batch.num_new_tokens == [rows[i] for i in admitted]


def test_a_waiting_caller_chunk_keeps_newcomers_out_so_it_is_not_starved():
    sched = make(budget=4)
    a = Sequence(0, [1, 2, 3, 4], chunk_sizes=[1, 3])
    decoders = [Sequence(i, [i], SamplingParams(max_tokens=3, ignore_eos=True)) for i in (1, 2, 3)]
    late = Sequence(4, [9], SamplingParams(max_tokens=3, ignore_eos=True))
    for s in [a, *decoders, late]:
        sched.add(s)
    driver = Driver(sched)
    while a.num_computed_tokens < a.num_prompt_tokens:
        assert late.status is SequenceStatus.WAITING, "a newcomer was admitted while a's chunk waited"
        driver.step()
    driver.run()
    for s in [a, *decoders, late]:
        assert_alone(s)


def test_a_step_that_decodes_computes_at_most_the_cap_of_prefill_tokens_and_one_without_the_whole_budget():
    sched = make(budget=8, cap=3)
    a = Sequence(0, [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Sequence(1, list(range(20)), SamplingParams(max_tokens=1))
    sched.add(a)
    driver = Driver(sched)
    driver.step()                                       # a's prompt
    sched.add(b)
    steps = [[(s.seq_id, n) for s, n in zip(x.seqs, x.num_new_tokens)] for x in (driver.step()[0] for _ in range(5))]
    # a decodes for three steps (its 4th token ends it): b gets 3 tokens beside each, then the whole budget.
    assert steps == [[(0, 1), (1, 3)], [(0, 1), (1, 3)], [(0, 1), (1, 3)], [(1, 8)], [(1, 3)]]
    driver.run()
    assert_alone(a) and assert_alone(b)


def test_the_prefill_cap_is_shared_by_a_steps_prefills_and_admissions_and_does_not_cut_a_caller_chunk():
    sched = make(budget=12, cap=4)
    a = Sequence(0, [1], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(a)
    driver = Driver(sched)
    driver.step()
    sched.add(Sequence(1, list(range(3))))
    sched.add(Sequence(2, list(range(9))))
    sched.add(Sequence(3, list(range(6)), chunk_sizes=[6]))
    steps = [[(s.seq_id, n) for s, n in zip(x.seqs, x.num_new_tokens)] for x in (driver.step()[0] for _ in range(3))]
    # 1's prompt (3) and 1 token of 2's fill the cap; 3's caller chunk (6) still fits the budget (12 - 5), so it
    # runs whole. Then 2 takes the cap's 4 beside three decodes, and its last 4 beside four.
    assert steps == [[(0, 1), (1, 3), (2, 1), (3, 6)], [(0, 1), (1, 1), (3, 1), (2, 4)],
                     [(0, 1), (1, 1), (3, 1), (2, 4)]]
    driver.run()
    for seq in sched.seqs.values():
        assert_alone(seq)


def test_a_prefill_dropped_from_a_step_gives_its_share_of_the_cap_back():
    from chunkwise.engine.scheduler import _Plan

    plan = _Plan(budget=10, rows=20)
    decode, a, b = Sequence(0, [1]), Sequence(1, list(range(6))), Sequence(2, list(range(6)))
    plan.add(decode, 1, 1)
    plan.prefill_cap = 4
    plan.add(a, 6, 3)   # a planned prefill: 6 rows at layer 0, 3 counted
    assert (plan.budget, plan.rows, plan.prefill_budget) == (6, 13, 1)
    plan.add(b, 1, 1)
    assert plan.prefill_budget == 0
    plan.drop(a)   # preempted: its rows leave the step, its 3 counted ones the budget and the cap
    assert (plan.budget, plan.rows, plan.prefill_budget) == (8, 18, 3)
    plan.drop(decode)   # a decode never counted against the cap
    assert (plan.budget, plan.rows, plan.prefill_budget) == (9, 19, 3)


def test_max_num_seqs_caps_the_running_sequences():
    sched = make(max_seqs=2)
    seqs = [Sequence(i, [i + 1] * 3, SamplingParams(max_tokens=3)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    driver = Driver(sched)
    batch, _ = driver.step()
    assert [s.seq_id for s in batch.seqs] == [0, 1] and len(sched.waiting) == 3
    driver.run()
    for s in seqs:
        assert_alone(s)


def test_newest_sequence_is_preempted_when_pages_run_out_and_recomputes_to_the_same_output():
    # 4 pages of 2 tokens: two 3-token prompts fit, but both cannot grow to 3 + 4 tokens.
    sched = make(num_pages=4, page_size=2)
    old, new = (Sequence(i, [i + 1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(2))
    sched.add(old)
    sched.add(new)
    driver = Driver(sched)
    preempted_at = None
    while preempted_at is None:
        batch, _ = driver.step()
        if batch.preempted:
            assert batch.preempted == [new] and [s.seq_id for s in batch.seqs] == [0]
            assert sched.waiting[0] is new and new.num_computed_tokens == 0 and not new.page_table
            assert new.seq_id in batch.page_changes.released.tolist(), "the preempted sequence's row was kept"
            preempted_at = list(new.token_ids)
    while new.status is SequenceStatus.WAITING:
        batch, _ = driver.step()
    # Readmitted: its page table starts over, and so does its row (Driver checked the row holds it).
    changes = batch.page_changes
    assert new in batch.seqs and changes.first_columns[changes.seq_ids.tolist().index(new.seq_id)] == 0
    # While it recomputes, no token is appended.
    while new.num_computed_tokens < len(preempted_at):
        assert new.token_ids == preempted_at
        driver.step()
    driver.run()
    assert_alone(old)
    assert_alone(new)
    driver.assert_pool_empty()


def test_abort_frees_pages_and_leaves_other_requests_untouched():
    sched = make(num_pages=16, page_size=2)
    seqs = [Sequence(i, [i + 1, 5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    driver = Driver(sched)
    driver.step()
    driver.step()
    used = sched.page_pool.num_pages - sched.page_pool.num_free_pages
    aborted = sched.abort(1)
    assert aborted is seqs[1] and aborted.finish_reason == "abort" and aborted.is_finished
    assert sched.page_pool.num_pages - sched.page_pool.num_free_pages == used - 3
    assert sched.abort(1) is None and sched.abort(99) is None
    driver.run()
    assert_alone(seqs[0])
    assert_alone(seqs[2])
    driver.assert_pool_empty()


def test_abort_between_schedule_and_postprocess_skips_the_aborted_sequence():
    sched = make()
    a, b = Sequence(0, [1, 2, 3]), Sequence(1, [4, 5, 6])
    sched.add(a)
    sched.add(b)
    driver = Driver(sched)
    batch = sched.schedule()
    driver.tables.apply(batch.page_changes)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        driver._check_and_write(seq, n)
    sched.advance(batch)
    sched.abort(0)
    finished = sched.postprocess(batch, {1: fake_next_token(b.token_ids)})
    assert finished == [] and a.completion_token_ids == [] and b.num_computed_tokens == 3
    driver.run()
    assert_alone(b)


def test_finish_reasons_follow_eos_ignore_eos_stop_tokens_and_max_tokens():
    prompt = [1, 2, 3]
    first = fake_next_token(prompt)
    cases = [(SamplingParams(max_tokens=4), (first,), "stop", 1),
             (SamplingParams(max_tokens=4, ignore_eos=True), (first,), "length", 4),
             (SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(first,)), (), "stop", 1),
             (SamplingParams(max_tokens=2), (), "length", 2)]
    for params, eos, reason, n in cases:
        sched = make(eos=eos)
        seq = Sequence(0, prompt, params)
        sched.add(seq)
        Driver(sched).run()
        assert (seq.finish_reason, seq.num_generated_tokens) == (reason, n), params


def test_prefix_cache_hits_are_counted_per_request():
    sched = make(page_size=4)
    first = Sequence(0, list(range(10)), SamplingParams(max_tokens=1))
    sched.add(first)
    driver = Driver(sched)
    driver.run()
    again = Sequence(1, list(range(10)) + [1, 2], SamplingParams(max_tokens=1))
    other = Sequence(2, [9] + list(range(1, 10)), SamplingParams(max_tokens=1))
    sched.add(again)
    sched.add(other)
    driver.run()
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 8, 0)
    assert_alone(again)


def test_bad_inputs_raise_value_error_naming_the_value():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence(0, [])
    with pytest.raises(ValueError, match="prompt token 1 is -5, not a token id"):
        Sequence(0, [1, -5])
    with pytest.raises(ValueError, match="chunk size 0"):
        Sequence(0, [1, 2], chunk_sizes=[2, 0])
    with pytest.raises(ValueError, match="sum to 3"):
        Sequence(0, [1, 2], chunk_sizes=[1, 2])
    sched = make(num_pages=2, page_size=4)
    with pytest.raises(ValueError, match="need 3 pages"):   # the engine core checks once, before add
        sched.check_fits(Sequence(0, list(range(8)), SamplingParams(max_tokens=2)))
    sched.add(Sequence(1, [1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="id 1"):
        sched.add(Sequence(1, [3], SamplingParams(max_tokens=1)))
    batch = sched.schedule()
    sched.advance(batch)
    with pytest.raises(ValueError, match=r"sequences \[1\]"):
        sched.postprocess(batch, {})
    seq = sched.seqs[1]
    assert (seq.token_ids, seq.num_pending) == ([1, 2], 1), "a rejected postprocess changed state"
