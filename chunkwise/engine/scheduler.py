"""Continuous batching: each step mixes decodes with prefill chunks under a token budget and a page pool.

Order of a step: decodes of running sequences (oldest first), then prefill chunks of running sequences,
then admissions from the waiting queue (first come, first served). A step that decodes computes at most
`max_prefill_tokens_with_decodes` prefill tokens besides: every decoding user waits for the whole step, so its
prefill work bounds their inter-token gap (a step with no decode takes the full budget, for the first token's
sake). A caller's chunk_sizes are honoured exactly: a chunk that does not fit the remaining budget waits for a
later step, and a chunk larger than the whole budget runs alone in a step of its own; a caller's chunk is not
cut by the decode-step cap either, only by the budget. The budget counts computed rows: a blended prefill (its
caller chunk is its whole prompt) counts its rows computed per layer on average, and its placed rows take only the
step's rows at layer 0 (`max_blended_rows`), so several share a step as plain prompts of their work would. When
pages run out, the newest running sequences are preempted: their pages are freed and they recompute (split by the
budget) once readmitted.
A batch also carries its `PageChanges`: the pages its sequences took and the sequences whose pages were freed
since the last batch (here, or outside `schedule`: finishes in postprocess, aborts, failed steps), which is
all the runner's page tables learn of the pool. An empty batch runs nothing, so it leaves them for the next.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from typing import Protocol

from chunkwise.engine.page_changes import PageChanges
from chunkwise.engine.page_pool import PagePool
from chunkwise.engine.row_plan import RowPlan
from chunkwise.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The step record: who computes how many tokens and who samples. The runner, the sampler and
    postprocess all read it; nothing downstream decides these again."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # computed this step from seq.num_computed_tokens
    preempted: list[Sequence] = field(default_factory=list)
    page_changes: PageChanges = field(default_factory=PageChanges.none)   # to apply to page tables before it runs
    row_plans: dict[int, RowPlan] = field(default_factory=dict)   # seq id -> its prefill's row plan in this step
    # Per seq, fixed at scheduling time (`advance` moves num_computed_tokens on): the tokens it has computed
    # once this step is done, and whether this step computes its last token, so the engine samples its next.
    ends: list[int] = field(init=False)
    samples: list[bool] = field(init=False)

    def __post_init__(self):
        self.ends = [s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_new_tokens)]
        self.samples = [end == s.num_tokens and not s.prefill_only for s, end in zip(self.seqs, self.ends)]

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class _Plan:
    """A step under construction: tokens per sequence (insertion order), the budget left in computed rows, the rows
    left at layer 0 (a blended prefill's placed rows take these, not the budget), preemptions."""

    def __init__(self, budget: int, rows: int):
        self.budget = budget
        self.rows = self.max_rows = rows
        self.prefill_cap: int | None = None   # prefill tokens the step may hold once it decodes
        self.capped: dict[int, int] = {}      # seq id -> its rows counted since (prefill: they count against it)
        self.tokens: dict[int, tuple[Sequence, int, int]] = {}   # seq id -> (seq, tokens, rows counted)
        self.preempted: list[Sequence] = []

    @property
    def full(self) -> bool:
        return self.budget <= 0 or self.rows <= 0

    @property
    def prefill_budget(self) -> int:
        """Tokens a prefill split by the budget may take now."""
        if self.prefill_cap is None:
            return min(self.budget, self.rows)
        return min(self.budget, self.rows, self.prefill_cap - sum(self.capped.values()))

    def add(self, seq: Sequence, n: int, counted: int) -> None:
        self.tokens[seq.seq_id] = (seq, n, counted)
        self.budget -= counted
        self.rows -= n
        if self.prefill_cap is not None:   # set after the decodes: whatever comes now is prefill
            self.capped[seq.seq_id] = counted

    def drop(self, seq: Sequence) -> None:
        if seq.seq_id in self.tokens:
            _, n, counted = self.tokens.pop(seq.seq_id)
            self.budget += counted
            self.rows += n
            self.capped.pop(seq.seq_id, None)   # a preempted prefill gives its share of the cap back

    def batch(self, pool: PagePool) -> ScheduledBatch:
        """The step; a step that runs something takes the pool's page changes with it."""
        entries = list(self.tokens.values())
        changes = pool.take_changes() if entries else PageChanges.none()
        return ScheduledBatch([s for s, _, _ in entries], [n for _, n, _ in entries], self.preempted, changes)


class RowPlanner(Protocol):
    """What plans a step's prefills that compute only some rows (chunkwise/engine/row_plan.py)."""

    def plan(self, seq: Sequence, pool: PagePool) -> RowPlan | None:
        """The row plan of seq's prefill in the step being scheduled (after all its allocations), or None."""

    def approximate_from(self, seq: Sequence) -> int | None:
        """Where seq's K/V stop being exact (never cached past it), None when they are exact."""

    def counted_rows(self, seq: Sequence, computed: int, n: int, page_size: int) -> int:
        """The rows seq's prefill of n tokens from `computed` counts against a step's budget (n unless planned)."""


class Scheduler:
    def __init__(self, config, page_pool: PagePool, eos_token_ids=(), row_planner: RowPlanner | None = None):
        """`config`: the engine's EngineConfig (its max_num_batched_tokens and max_num_seqs are read)."""
        self.engine_config = config
        self.page_pool = page_pool
        self.row_planner = row_planner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # sorted by arrival: the newest is last
        self.seqs: dict[int, Sequence] = {}      # every unfinished sequence by id
        self._alone: Sequence | None = None      # its oversized chunk runs alone in the next step

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, which its caller checked to fit the pool (`check_fits`)."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.page_table:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name} with pages {seq.page_table}; "
                             f"only a new sequence can be added")
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence, name: str | None = None, pinning=()) -> None:
        """ValueError if seq at its longest could not fit the pool beside the pinned pages its prompt does not
        start with (those of `pinning` counted as pinned too); `name` says which request."""
        # The last sampled token is never computed, so the cache holds at most prompt + max_tokens - 1.
        most = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        bm = self.page_pool
        pinned = set(bm.pins).union(pinning)
        # Pinned pages it starts with are shared, not taken from the rest (the last token is never taken).
        shared = sum(1 for p in bm.seq_chain_pages(seq, len(seq.token_ids) - 1) if p in pinned) if pinned else 0
        if bm.pages_needed(most) > bm.num_pages - len(pinned) + shared:
            pins = f", {len(pinned) - shared} of them pinned by chunks it does not start with" if pinned else ""
            raise ValueError(f"{name or f'sequence {seq.seq_id}'}: {seq.num_prompt_tokens} prompt tokens + "
                             f"max_tokens {seq.sampling_params.max_tokens} need {bm.pages_needed(most)} pages of "
                             f"{bm.page_size} tokens, the pool has {bm.num_pages} (num_pages){pins}")

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def schedule(self) -> ScheduledBatch:
        config = self.engine_config
        plan = _Plan(config.max_num_batched_tokens,
                     config.max_blended_rows if self.row_planner is not None else config.max_num_batched_tokens)
        alone, self._alone = self._alone, None
        if alone is not None and not alone.is_finished and self._schedule_alone(alone, plan):
            return self._batch(plan)
        # A decode whose pending token is its max_tokens-th finishes when that token lands: not scheduled again.
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_is_last]:
            if plan.full:
                break
            if seq.status is SequenceStatus.RUNNING:   # not preempted earlier in this loop
                self._reserve(seq, 1, plan, 1)
        cap = self.engine_config.max_prefill_tokens_with_decodes
        if plan.tokens and cap is not None:
            plan.prefill_cap = cap
        # A running seq whose caller chunk waits for budget keeps newcomers out, or a stream of
        # arrivals turning into decodes could starve it.
        chunk_waits = False
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if plan.full or self._alone is not None:
                break
            if seq.status is SequenceStatus.RUNNING:
                n, counted = self._chunk(seq, plan)
                chunk_waits |= n == 0 and seq.follows_chunk_sizes(seq.num_computed_tokens)
                if n > 0:
                    self._reserve(seq, n, plan, counted)
        if self._alone is None and not chunk_waits:
            self._admit(plan)
        return self._batch(plan)

    def _batch(self, plan: _Plan) -> ScheduledBatch:
        """The plan's step, with its row plans made against the prefix cache after every allocation of the step
        (a blend's, chunkwise/engine/blend/): a cached page then is not overwritten before the step reads it."""
        batch = plan.batch(self.page_pool)
        if self.row_planner is not None:
            for s in batch.seqs:
                rows = self.row_planner.plan(s, self.page_pool)
                if rows is not None:
                    batch.row_plans[s.seq_id] = rows
        return batch

    def _chunk(self, seq: Sequence, plan: _Plan, computed: int | None = None) -> tuple[int, int]:
        """(tokens seq computes next, from `computed` tokens (default: its own count), the rows they count against
        the budget): up to its next caller boundary, else what the budget leaves. A caller chunk fits when its
        counted rows fit the budget left and its rows the rows left (a blended prefill counts fewer rows than it
        has: `RowPlanner.counted_rows`); a chunk split by the budget counts its tokens.

        0 tokens: waits for a later step; -1: its oversized chunk must run alone, nothing more is scheduled now.
        """
        computed = seq.num_computed_tokens if computed is None else computed
        if not seq.follows_chunk_sizes(computed):
            n = max(0, min(seq.num_tokens - computed, plan.prefill_budget))
            return n, n
        want = seq.next_chunk_end(computed) - computed
        counted = want if self.row_planner is None else \
            self.row_planner.counted_rows(seq, computed, want, self.page_pool.page_size)
        if counted <= plan.budget and want <= plan.rows:
            return want, counted
        if counted > self.engine_config.max_num_batched_tokens or want > plan.max_rows:
            if not plan.tokens:
                return want, counted
            self._alone = seq
            return -1, 0
        return 0, 0

    def _reserve(self, seq: Sequence, n: int, plan: _Plan, counted: int) -> bool:
        """Pages for n more tokens of running seq, `counted` rows of the budget (`_chunk`'s count; a decode's 1),
        preempting the newest running seqs; False if seq itself was."""
        bm = self.page_pool
        while not bm.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        bm.allocate(seq, n)
        plan.add(seq, n, counted)
        return True

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        self.running.remove(seq)
        plan.drop(seq)
        self.page_pool.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _admit(self, plan: _Plan) -> None:
        """Admit waiting seqs in order while budget, seq cap and pages allow; none in a step that preempted."""
        while self.waiting and not plan.preempted and not plan.full \
                and len(self.running) < self.engine_config.max_num_seqs:
            seq = self.waiting[0]
            if not self._try_admit(seq, plan):
                return

    def _try_admit(self, seq: Sequence, plan: _Plan) -> bool:
        pool = self.page_pool
        prefix = pool.probe_prefix(seq)
        n, counted = self._chunk(seq, plan, computed=len(prefix) * pool.page_size)
        if n <= 0 or not pool.can_admit(prefix, n):
            return False
        pool.take_prefix(seq, prefix)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        pool.allocate(seq, n)
        plan.add(seq, n, counted)
        return True

    def _schedule_alone(self, seq: Sequence, plan: _Plan) -> bool:
        """The step that runs seq's oversized chunk and nothing else."""
        if seq.status is SequenceStatus.RUNNING:
            n, counted = self._chunk(seq, plan)
            return n > 0 and self._reserve(seq, n, plan, counted)
        if len(self.running) >= self.engine_config.max_num_seqs:
            return False
        return self._try_admit(seq, plan)

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch's forward is launched: its tokens count as computed, and each sampling seq's next token is
        pending until `postprocess` gets it (the next step may be scheduled before that, feeding it on the device)."""
        for seq, end, samples in zip(batch.seqs, batch.ends, batch.samples):
            seq.num_computed_tokens = end
            seq.num_pending += samples

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """After an advanced batch's forward and sampling: cache its full pages, append the sampled tokens;
        returns newly finished seqs.

        Seqs that ended since (aborted, failed, or finished by an earlier step while this one ran) are skipped:
        their token was computed in vain. A seq preempted since keeps its token; it has no pages to cache.
        """
        live = [(seq, end, s) for seq, end, s in zip(batch.seqs, batch.ends, batch.samples) if not seq.is_finished]
        missing = [seq.seq_id for seq, _, s in live if s and seq.seq_id not in sampled]
        if missing:   # checked before changing anything
            raise ValueError(f"sequences {missing} computed all their tokens but no sampled token was given")
        finished = []
        for seq, end, samples in live:
            if seq.status is SequenceStatus.RUNNING:
                # K/V a row plan placed are approximate from where it starts: never shared as exact.
                approx = self.row_planner.approximate_from(seq) if self.row_planner is not None else None
                self.page_pool.commit(seq, end if approx is None else min(end, approx))
            if not samples:
                continue
            token = sampled[seq.seq_id]
            seq.num_pending -= 1
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_generated_tokens >= params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.page_pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        """Stop a sequence wherever it is and free its pages; None if no unfinished sequence has that id."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason)
        return seq
