"""PageTables (the runner's device page tables): after any sequence of page appends, frees, retakes and
releases, each sequence's row on host and device starts with exactly its page table; and a mirror that only
applies each step's recorded writes (a tensor-parallel worker's tables) holds the same device table."""
import torch
from hypothesis import given, strategies as st

from chunkwise.engine.page_tables import PageTables


class Seq:
    def __init__(self, seq_id):
        self.seq_id, self.page_table = seq_id, []


@given(st.data())
def test_rows_hold_each_sequences_pages_after_appends_frees_and_releases(data):
    width = data.draw(st.integers(1, 6), label="width")
    tables = PageTables(width, torch.device("cpu"), rows=2)   # tiny, so rows are also grown
    mirror = PageTables(width, torch.device("cpu"), rows=2)
    seqs = {i: Seq(i) for i in range(5)}
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["append", "free", "release"]))
        seq = seqs[data.draw(st.integers(0, 4))]
        if op == "append" and len(seq.page_table) < width:
            seq.page_table.append(data.draw(st.integers(0, 999)))
        elif op == "free":   # as PagePool.free: a new list, possibly refilled before the next step
            seq.page_table = [data.draw(st.integers(0, 999)) for _ in range(data.draw(st.integers(0, width)))]
        elif op == "release":
            tables.release(seq.seq_id)
        batch = data.draw(st.lists(st.sampled_from(sorted(seqs)), min_size=1, max_size=5, unique=True))
        rows = tables.rows([seqs[i] for i in batch])
        mirror.apply(tables.updates, tables.table.shape[0])
        assert torch.equal(mirror.table, tables.table), "a worker applying the recorded writes holds other rows"
        assert len(set(rows.tolist())) == len(rows) and 0 not in rows, "rows shared, or row 0 (padding) given out"
        for i, row in zip(batch, rows):
            pages = seqs[i].page_table
            assert tables.host[row, :len(pages)].tolist() == pages
            assert tables.table[row, :len(pages)].tolist() == pages
    assert not tables.table[0].any() and not tables.host[0].any(), "the padding row was written"
