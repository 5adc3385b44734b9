"""Page tables of the sequences in steps, kept on the device and updated per new page.

One row per sequence (row 0 stays zeros: padding rows of a CUDA graph point at it), all of the full width
max_pages_per_seq, so every step's tables have one stride, and so one kernel specialisation, whatever the
batch. A host copy of the same rows gives the slots of a step's tokens without asking the device.
`apply` is the only way the tables change: it takes the `PageChanges` a scheduled batch carries (what the page
pool handed out and took back since the last batch), releases the freed sequences' rows, and writes each
sequence's new pages from the column the pool reported, taking a row for a sequence that has none. Rows are
taken and grown (by doubling) in the order of the changes alone, so a tensor-parallel worker, which has no
sequences, applies the same changes and holds the same rows as rank 0. `rows` only looks rows up.
"""
from __future__ import annotations

import numpy as np
import torch

from chunkwise.engine.page_changes import PageChanges


class PageTables:
    def __init__(self, width: int, device: torch.device, rows: int = 64):
        self.width = width
        self.device = device
        self.host = np.zeros((rows, width), np.int32)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)   # int32 [rows, width]
        self._held: dict[int, tuple[int, int]] = {}       # seq id -> (its row, the pages written in it)
        self._free = list(range(rows - 1, 0, -1))

    @property
    def seq_ids(self) -> set[int]:
        """The sequences holding a row."""
        return set(self._held)

    def rows(self, seqs) -> np.ndarray:
        """int64 [len(seqs)]: each sequence's row (its pages reached the tables through `apply`)."""
        try:
            return np.array([self._held[s.seq_id][0] for s in seqs], np.int64)
        except KeyError as exc:
            raise ValueError(f"sequence {exc} has no row in the page tables: no applied PageChanges gave it "
                             f"pages") from None

    @torch.inference_mode()   # the table may be regrown inside a step, which makes it an inference tensor
    def apply(self, changes: PageChanges) -> None:
        """Release the freed sequences' rows, then write each sequence's new pages from its first column, on
        host and device. Checked in full before anything changes."""
        released = changes.released.tolist()
        gone = set(released)
        ends = changes.first_columns + changes.num_new_pages
        for seq_id, first, end in zip(changes.seq_ids.tolist(), changes.first_columns.tolist(), ends.tolist()):
            have = self._held[seq_id][1] if seq_id in self._held and seq_id not in gone else 0
            if first != have:
                raise ValueError(f"sequence {seq_id}'s new pages start at column {first}, but its row holds "
                                 f"{have} pages")
            if end > self.width:
                raise ValueError(f"sequence {seq_id} holds {end} pages, more than max_pages_per_seq ({self.width})")
        for seq_id in released:
            held_row = self._held.pop(seq_id, None)
            if held_row is not None:   # none when it took its pages and lost them between two changes
                self._free.append(held_row[0])
        rows = []
        for seq_id, end in zip(changes.seq_ids.tolist(), ends.tolist()):
            row = self._held[seq_id][0] if seq_id in self._held else self._take_row()
            self._held[seq_id] = (row, end)
            rows.append(row)
        if len(changes.page_ids):
            n = changes.num_new_pages
            row_of_page = np.repeat(np.array(rows, np.int64), n)
            col_of_page = np.arange(len(changes.page_ids)) - np.repeat(np.cumsum(n) - n - changes.first_columns, n)
            self.host[row_of_page, col_of_page] = changes.page_ids
            self._write(np.stack([row_of_page, col_of_page, changes.page_ids]))

    def _write(self, updates: np.ndarray) -> None:
        """updates: int64 [3, U] (rows, columns, pages) written into the device table."""
        upd = torch.from_numpy(updates)
        if self.device.type == "cuda":
            upd = upd.pin_memory().to(self.device, non_blocking=True)
        self.table[upd[0], upd[1]] = upd[2].to(torch.int32)

    def _take_row(self) -> int:
        if not self._free:   # grow: twice the rows, old rows kept
            old = self.host.shape[0]
            self.host = np.concatenate([self.host, np.zeros_like(self.host)])
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
