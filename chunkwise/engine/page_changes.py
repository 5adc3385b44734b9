"""PageChanges: what the page pool changed in sequences' page tables, as the scheduler hands it to the runner.

The contract between the two sides: `PagePool.take_changes` (scheduler side) makes one, `PageTables.apply`
(runner side, on every rank) applies it. It lives below both so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PageChanges:
    """What changed in page tables between two `PagePool.take_changes` calls; applied in this order.

    First the released sequences give their rows back; then each listed sequence's new pages are written
    from its first column on. A sequence whose pages were freed and retaken since (preempted, then readmitted)
    is released and then starts over at column 0.
    """
    released: np.ndarray        # int64 [R]: sequences whose pages were freed
    seq_ids: np.ndarray         # int64 [S]: sequences that took pages, each once
    first_columns: np.ndarray   # int64 [S]: the column of each one's first new page in its page table
    num_new_pages: np.ndarray   # int64 [S]: how many new pages each took (>= 1)
    page_ids: np.ndarray        # int64 [sum(num_new_pages)]: the new pages, sequence after sequence, in order

    @classmethod
    def none(cls) -> PageChanges:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty, empty, empty)
