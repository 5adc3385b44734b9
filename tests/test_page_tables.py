"""PageTables (the runner's device page tables), fed only the PageChanges a PagePool reports: after any sequence
of page appends, frees, retakes (a preempted sequence readmitted), failed steps and releases, each sequence
holding pages has a row that starts, on host and device, with exactly its page table, and a sequence holding no
pages has no row; a mirror that applies the same changes (a tensor-parallel worker's tables) holds the same rows."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from chunkwise.engine.page_changes import PageChanges
from chunkwise.engine.page_pool import PagePool
from chunkwise.engine.page_tables import PageTables
from chunkwise.engine.sequence import Sequence

CPU = torch.device("cpu")


def take(pool, seq, n):
    """seq takes n more pages (one token each): as allocating a step's tokens."""
    seq.num_computed_tokens = len(seq.page_table)
    pool.allocate(seq, n)


def assert_rows_hold_page_tables(tables, seqs):
    holding = [s for s in seqs if s.page_table]
    assert tables.seq_ids == {s.seq_id for s in holding}, "a row for a sequence without pages, or none for one"
    rows = tables.rows(holding)
    assert len(set(rows.tolist())) == len(rows) and 0 not in rows, "rows shared, or row 0 (padding) given out"
    for seq, row in zip(holding, rows):
        pages = seq.page_table
        assert tables.host[row, :len(pages)].tolist() == pages, f"host row of sequence {seq.seq_id}"
        assert tables.table[row, :len(pages)].tolist() == pages, f"device row of sequence {seq.seq_id}"


@given(st.data())
def test_rows_hold_each_sequences_pages_after_appends_frees_retakes_and_failed_steps(data):
    width = data.draw(st.integers(1, 6), label="width")
    pool = PagePool(5 * width, 1, enable_prefix_caching=False)
    tables = PageTables(width, CPU, rows=2)   # tiny, so rows are also grown
    mirror = PageTables(width, CPU, rows=2)
    seqs = [Sequence(i, [1]) for i in range(5)]
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        op = data.draw(st.sampled_from(["take", "free", "retake", "step", "failed step"]))
        seq = seqs[data.draw(st.integers(0, 4))]
        if op in ("free", "retake"):   # finished, aborted or preempted; a retake is readmitted before a step
            pool.free(seq)
        if op in ("take", "retake") and len(seq.page_table) < width:
            take(pool, seq, data.draw(st.integers(1, width - len(seq.page_table))))
        if op == "failed step":   # as the engine: the changes may or may not have been applied, then their
            changes = pool.take_changes()   # releases go out again and the step's sequences are freed
            if data.draw(st.booleans(), label="applied before the failure"):
                tables.apply(changes)
                mirror.apply(changes)
            pool.release_again(changes)
            for s in seqs:
                if s.seq_id in changes.seq_ids.tolist():
                    pool.free(s)
        if op == "step":
            changes = pool.take_changes()
            tables.apply(changes)
            mirror.apply(changes)
            assert np.array_equal(mirror.host, tables.host) and torch.equal(mirror.table, tables.table), \
                "a worker applying the same changes holds other rows"
            assert_rows_hold_page_tables(tables, seqs)
    for s in seqs:
        pool.free(s)
    tables.apply(pool.take_changes())
    assert not tables.seq_ids, f"rows never released: {tables.seq_ids}"
    assert not tables.table[0].any() and not tables.host[0].any(), "the padding row was written"


def test_a_sequence_freed_and_retaken_starts_over_at_column_zero():
    pool = PagePool(16, 1)
    tables = PageTables(8, CPU)
    seq, other = Sequence(0, [1]), Sequence(1, [1])
    take(pool, seq, 3)
    tables.apply(pool.take_changes())
    pool.free(seq)            # preempted
    take(pool, other, 2)      # the freed pages go to another sequence
    tables.apply(pool.take_changes())
    take(pool, seq, 2)        # readmitted
    changes = pool.take_changes()
    assert changes.seq_ids.tolist() == [0] and changes.first_columns.tolist() == [0]
    tables.apply(changes)
    assert_rows_hold_page_tables(tables, [seq, other])
    assert tables.host[tables.rows([seq])[0], :2].tolist() == seq.page_table


def test_bad_changes_raise_value_error_naming_the_sequence_before_changing_anything():
    tables = PageTables(3, CPU)
    one = np.array([7], np.int64)

    def changes(first, n, released=()):
        return PageChanges(np.array(released, np.int64), one, np.array([first], np.int64), np.array([n], np.int64),
                           np.arange(n, dtype=np.int64) + 1)

    tables.apply(changes(0, 2))
    before = tables.host.copy()
    with pytest.raises(ValueError, match=r"sequence 7's new pages start at column 0, but its row holds 2 pages"):
        tables.apply(changes(0, 1))
    with pytest.raises(ValueError, match=r"sequence 7 holds 4 pages, more than max_pages_per_seq \(3\)"):
        tables.apply(changes(2, 2))
    with pytest.raises(ValueError, match=r"sequence 7's new pages start at column 2, but its row holds 0 pages"):
        tables.apply(changes(2, 1, released=[7]))
    with pytest.raises(ValueError, match="sequence 8 has no row"):
        tables.rows([Sequence(8, [1])])
    assert np.array_equal(tables.host, before) and tables.seq_ids == {7}
