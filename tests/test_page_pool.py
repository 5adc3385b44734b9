"""The page pool and its prefix cache: exact reuse, reference counts, LRU eviction, no leaks; and the page
changes it reports (`take_changes`) rebuild every live sequence's page table.

A shadow "K/V" is kept per page slot: the whole token prefix up to and including that slot's token,
which is what a real token's K/V depends on. Reuse is exact iff a reused slot's shadow equals the
reusing sequence's own prefix at that position.
"""
import re

import numpy as np
import pytest
from hypothesis import event, given, note, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import chunkwise.engine.page_pool as page_pool_module
from chunkwise.engine.page_pool import PagePool, page_hash
from chunkwise.engine.sequence import Sequence

pytestmark = pytest.mark.correctness

BASES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [1, 2, 3, 0, 0, 1, 2, 3, 4, 4], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2])


def write_kv(bm, kv, seq, n):
    """Simulate a step computing n tokens of seq: fill their slots; returns the written page ids."""
    written = set()
    for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
        page_id = seq.page_table[pos // bm.page_size]
        kv[page_id][pos % bm.page_size] = tuple(seq.token_ids[:pos + 1])
        written.add(page_id)
    seq.num_computed_tokens += n
    return written


def assert_kv_matches(bm, kv, seq):
    for pos in range(seq.num_computed_tokens):
        got = kv[seq.page_table[pos // bm.page_size]][pos % bm.page_size]
        assert got == tuple(seq.token_ids[:pos + 1]), f"seq {seq.seq_id} position {pos} holds K/V of {got}"


class PagePoolMachine(RuleBasedStateMachine):
    """Sequences arrive (many sharing prefixes), take cached pages, compute chunks, generate, end or abort."""

    @initialize(page_size=st.integers(1, 5), num_pages=st.integers(1, 14))
    def setup(self, page_size, num_pages):
        self.bm = PagePool(num_pages, page_size)
        self.kv = {p: [None] * page_size for p in range(num_pages)}
        self.live: dict[int, Sequence] = {}
        self.pending: dict[int, int] = {}      # tokens allocated for a step not yet computed
        self.next_id = 0
        self.reported: dict[int, list[int]] = {}   # page tables as rebuilt from take_changes alone

    def _draw_prompt(self, data):
        base = data.draw(st.sampled_from(BASES))
        keep = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        return base[:keep] + data.draw(st.lists(st.integers(0, 4), min_size=0 if keep else 1, max_size=4))

    @rule(data=st.data())
    def admit(self, data):
        self._admit(data)

    def _admit(self, data):
        seq = Sequence(self.next_id, self._draw_prompt(data))
        self.next_id += 1
        reused = self.bm.match_prefix(seq)
        note(f"admit {seq.seq_id} {seq.token_ids}: reused {reused} tokens, pages {seq.page_table}")
        event("admission reused cached pages" if reused else "admission reused nothing")
        assert reused == seq.num_computed_tokens == seq.num_cached_tokens
        assert reused % self.bm.page_size == 0 and reused < seq.num_tokens
        assert len(seq.page_table) == reused // self.bm.page_size
        assert_kv_matches(self.bm, self.kv, seq)
        self.live[seq.seq_id] = seq
        self.pending[seq.seq_id] = 0
        return seq

    @rule(data=st.data())
    def admit_and_prefill(self, data):
        """The common case in one rule, so the cache fills: admit and compute the whole prompt."""
        seq = self._admit(data)
        n = seq.num_uncomputed_tokens
        if self.bm.can_allocate(seq, n):
            self._allocate(seq, n)
            self._compute(seq, data)

    def _idle(self):
        return sorted(i for i, n in self.pending.items() if n == 0)

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def allocate(self, data):
        seq = self.live[data.draw(st.sampled_from(self._idle()))]
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        if not self.bm.can_allocate(seq, n):
            event("allocation refused: pool exhausted")
            with pytest.raises(ValueError, match="pages"):
                self.bm.allocate(seq, n)
            return
        self._allocate(seq, n)

    def _allocate(self, seq, n):
        in_use = {p for s in self.live.values() for p in s.page_table}
        old = list(seq.page_table)
        self.bm.allocate(seq, n)
        new = seq.page_table[len(old):]
        assert seq.page_table[:len(old)] == old
        assert not set(new) & in_use, f"allocation handed out pages in use: {set(new) & in_use}"
        assert len(seq.page_table) == -(-(seq.num_computed_tokens + n) // self.bm.page_size)
        for p in new:
            self.kv[p] = [None] * self.bm.page_size   # a taken page's old K/V is garbage to its new owner
        self.pending[seq.seq_id] = n

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def compute(self, data):
        self._compute(self.live[data.draw(st.sampled_from(sorted(i for i, n in self.pending.items() if n)))], data)

    def _compute(self, seq, data):
        written = write_kv(self.bm, self.kv, seq, self.pending[seq.seq_id])
        for p in written:
            assert self.bm.pages[p].ref_count == 1, f"step wrote into page {p} shared by other sequences"
        self.pending[seq.seq_id] = 0
        self.bm.commit(seq)
        assert len(seq.page_hashes) == seq.num_computed_tokens // self.bm.page_size
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(data.draw(st.integers(0, 4)))   # the sampled token, computed by a later step

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data):
        """A sequence finishes or is aborted, possibly with an allocated step never computed."""
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        del self.pending[seq.seq_id]
        self.bm.free(seq)
        assert seq.page_table == [] and seq.num_computed_tokens == 0

    @rule()
    def end_all(self):
        for seq in self.live.values():
            self.bm.free(seq)
        self.live.clear()
        self.pending.clear()
        assert self.bm.num_free_pages == self.bm.num_pages
        assert all(p.ref_count == 0 for p in self.bm.pages)

    @rule()
    def take_changes(self):
        """What the pool reported since the last call, applied to page tables rebuilt from the reports alone,
        gives every live sequence's page table, and no table to a sequence that holds no pages."""
        changes = self.bm.take_changes()
        for seq_id in changes.released.tolist():
            self.reported.pop(seq_id, None)
        new = np.split(changes.page_ids, np.cumsum(changes.num_new_pages)[:-1]) if len(changes.seq_ids) else []
        for seq_id, first, pages in zip(changes.seq_ids.tolist(), changes.first_columns.tolist(), new):
            table = self.reported.setdefault(seq_id, [])
            assert first == len(table), f"sequence {seq_id}'s new pages start at column {first}, after {table}"
            table += pages.tolist()
        assert self.reported == {i: s.page_table for i, s in self.live.items() if s.page_table}

    @invariant()
    def page_states_partition_the_pool(self):
        bm = self.bm
        free, evictable = list(bm.free_page_ids), list(bm.evictable)
        refs = [0] * bm.num_pages
        for seq in self.live.values():
            assert len(set(seq.page_table)) == len(seq.page_table), f"page twice in {seq}"
            for p in seq.page_table:
                refs[p] += 1
        assert [p.ref_count for p in bm.pages] == refs, "ref counts differ from the page tables"
        in_use = {p for p, r in enumerate(refs) if r}
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert not (set(free) | set(evictable)) & in_use, "a page is both free and in use"
        assert len(free) + len(evictable) + len(in_use) == bm.num_pages, "a page leaked"
        assert all(bm.pages[p].hash is not None for p in evictable), "an uncached page is evictable"
        assert all(bm.pages[p].hash is None for p in free)

    @invariant()
    def cached_pages_hold_their_prefix(self):
        bm = self.bm
        for key, p in bm.cached.items():
            page = bm.pages[p]
            assert key == page.key and page.hash == page_hash(page.parent_hash, page.tokens)
            for off, tok in enumerate(page.token_ids):
                slot = self.kv[p][off]
                assert slot is not None and slot[-1] == tok, f"cached page {p} slot {off} holds K/V {slot}"

    def teardown(self):
        if hasattr(self, "bm"):
            self.end_all()


TestPagePool = PagePoolMachine.TestCase
# Each example is cheap (~0.1 s): run five times the profile's count.
TestPagePool.settings = settings(settings(), max_examples=5 * settings().max_examples, stateful_step_count=40)


def run_prompt(bm, seq_id, prompt):
    """Admit, allocate and compute a whole prompt; the sequence stays live."""
    seq = Sequence(seq_id, prompt)
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_identical_prompt_reuses_every_full_page_but_recomputes_the_last_token():
    bm = PagePool(8, 4)
    first = run_prompt(bm, 0, list(range(12)))
    bm.free(first)
    again = Sequence(1, list(range(12)))
    assert bm.match_prefix(again) == 8          # page 3 would cover the last token: not taken
    assert again.num_cached_tokens == 8 and again.num_uncomputed_tokens == 4


def test_a_page_is_reused_only_under_the_same_prefix():
    bm = PagePool(8, 2)
    run_prompt(bm, 0, [5, 6, 7, 8, 9])
    assert bm.match_prefix(Sequence(1, [0, 6, 7, 8, 9])) == 0      # same page (7, 8), other prefix
    assert bm.match_prefix(Sequence(2, [5, 6, 7, 0, 9])) == 2      # diverges in the second page


def test_live_sequences_share_cached_pages_with_reference_counts():
    bm = PagePool(8, 2)
    a = run_prompt(bm, 0, [1, 2, 3, 4, 5])
    b = Sequence(1, [1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4 and b.page_table == a.page_table[:2]
    assert [bm.pages[p].ref_count for p in a.page_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.pages[p].ref_count for p in b.page_table] == [1, 1]
    assert bm.num_free_pages == 8 - 2


def test_allocation_takes_free_pages_before_evicting_cached_ones():
    bm = PagePool(4, 1)
    bm.free(run_prompt(bm, 0, [1, 2]))
    bm.free(run_prompt(bm, 1, [7, 8]))           # fits in the two free pages: [1, 2] stays cached
    assert not bm.free_page_ids and len(bm.evictable) == 4
    assert bm.match_prefix(Sequence(2, [1, 2, 3])) == 2


def test_eviction_is_least_recently_used_and_tail_pages_go_first():
    bm = PagePool(4, 1)
    old = run_prompt(bm, 0, [1, 2])
    old_pages = list(old.page_table)
    bm.free(old)
    bm.free(run_prompt(bm, 1, [7, 8]))
    taker = Sequence(2, [9])
    bm.match_prefix(taker)
    bm.allocate(taker, 1)
    assert taker.page_table == [old_pages[1]], "the oldest sequence's tail page is evicted first"
    assert bm.match_prefix(Sequence(3, [1, 2, 3])) == 1
    assert bm.match_prefix(Sequence(4, [7, 8, 3])) == 2


def test_an_evicted_prefix_computed_again_is_cached_again():
    bm = PagePool(2, 1)
    bm.free(run_prompt(bm, 0, [1, 2]))
    bm.free(run_prompt(bm, 1, [7, 8]))           # evicts both pages of [1, 2]
    assert bm.match_prefix(Sequence(2, [1, 2, 3])) == 0
    bm.free(run_prompt(bm, 3, [1, 2]))           # evicts [7, 8]; [1, 2] is cached anew
    assert bm.match_prefix(Sequence(4, [1, 2, 3])) == 2
    assert len(bm.cached) == 2 and all(bm.pages[p].key == k for k, p in bm.cached.items()), \
        "the hash table still holds evicted pages"


def test_referenced_pages_are_never_evicted():
    bm = PagePool(3, 1)
    holder = run_prompt(bm, 0, [1, 2, 3])        # every page referenced
    assert bm.num_free_pages == 0 and not bm.can_allocate(Sequence(1, [4]), 1)
    with pytest.raises(ValueError, match="pages"):
        bm.allocate(Sequence(2, [4]), 1)
    assert [bm.pages[p].ref_count for p in holder.page_table] == [1, 1, 1]


def test_prefix_caching_off_never_reuses():
    bm = PagePool(8, 2, enable_prefix_caching=False)
    bm.free(run_prompt(bm, 0, [1, 2, 3, 4, 5]))
    assert bm.match_prefix(Sequence(1, [1, 2, 3, 4, 5])) == 0
    assert not bm.cached and bm.num_free_pages == 8


def test_a_hash_collision_cannot_hand_out_another_prefix_pages(monkeypatch):
    monkeypatch.setattr(page_pool_module, "page_hash", lambda parent, tokens: b"same")
    bm = PagePool(16, 2)
    run_prompt(bm, 0, [1, 2, 3, 4, 5])
    assert bm.match_prefix(Sequence(1, [3, 4, 1, 2, 5])) == 0
    assert bm.match_prefix(Sequence(2, [1, 2, 1, 2, 5])) == 2


@pytest.mark.parametrize("num_pages, page_size, message", [
    (0, 4, "num_pages must be an integer >= 1, got 0"),
    (-1, 4, "num_pages must be an integer >= 1, got -1"),
    (4, 0, "page_size must be an integer >= 1, got 0"),
    (4, -2, "page_size must be an integer >= 1, got -2"),
    (4, 1.5, "page_size must be an integer >= 1, got 1.5"),
])
def test_bad_pool_sizes_raise_value_error_naming_the_field_and_value(num_pages, page_size, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        PagePool(num_pages, page_size)


@given(st.integers(1, 6), st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_match_prefix_of_a_computed_prompt_takes_all_full_pages_before_the_last_token(page_size, prompt):
    bm = PagePool(64, page_size)
    bm.free(run_prompt(bm, 0, prompt))
    again = Sequence(1, prompt)
    assert bm.match_prefix(again) == (len(prompt) - 1) // page_size * page_size


def test_a_sequence_freed_and_retaken_between_two_reports_starts_over_at_column_zero():
    """Preempted after taking a page, readmitted before the next report: the report releases it and gives it
    only its new pages, from column 0 (not after its old ones)."""
    bm = PagePool(8, 1)
    seq = Sequence(0, [1, 2, 3, 4])
    bm.allocate(seq, 2)
    bm.take_changes()
    seq.num_computed_tokens = 2
    bm.allocate(seq, 1)           # a page the tables have not heard of
    bm.free(seq)                  # preempted
    bm.allocate(seq, 2)           # readmitted
    changes = bm.take_changes()
    assert changes.released.tolist() == [0]
    assert (changes.seq_ids.tolist(), changes.first_columns.tolist(), changes.page_ids.tolist()) == \
        ([0], [0], seq.page_table)
    assert bm.take_changes().released.size == 0, "a report was repeated"
