"""Page tables of the sequences in steps, kept on the device and updated per new page.

One row per sequence (row 0 stays zeros: padding rows of a CUDA graph point at it), all of the full width
max_pages_per_seq, so every step's tables have one stride, and so one kernel specialisation, whatever the
batch. A host copy of the same rows gives the slots of a step's tokens without asking the device.
A row is synced by writing the pages appended since the sequence's last step; the page pool gives a
sequence a new list when it frees its pages (preemption), and a new list is synced from its start.
Those writes are also kept as `updates` (rows, columns, pages), so a tensor-parallel worker, which has no
sequences, `apply`s them to its own device table and holds the same rows.
"""
from __future__ import annotations

import numpy as np
import torch

_NO_UPDATES = np.zeros((3, 0), np.int64)


class PageTables:
    def __init__(self, width: int, device: torch.device, rows: int = 64):
        self.width = width
        self.device = device
        self.host = np.zeros((rows, width), np.int32)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)   # int32 [rows, width]
        self._state: dict[int, list] = {}                 # seq_id -> [row, the page_table list synced, entries]
        self._free = list(range(rows - 1, 0, -1))
        self.updates = _NO_UPDATES                        # the last `rows` call's writes: rows, columns, pages

    @torch.inference_mode()   # the table may be regrown inside a step, which makes it an inference tensor
    def rows(self, seqs) -> np.ndarray:
        """int64 [len(seqs)]: each sequence's row, after writing its new pages on host and device."""
        out = []
        upd_rows, upd_cols, upd_pages = [], [], []
        for seq in seqs:
            state = self._state.get(seq.seq_id)   # [row, the page_table list synced, entries synced]
            if state is None:
                state = self._state[seq.seq_id] = [self._take_row(), None, 0]
            pages = seq.page_table
            if state[1] is not pages or state[2] != len(pages):
                n = state[2] if state[1] is pages and state[2] < len(pages) else 0
                if len(pages) > self.width:
                    raise ValueError(f"sequence {seq.seq_id} holds {len(pages)} pages, more than max_pages_per_seq "
                                     f"({self.width})")
                row, new = state[0], pages[n:]
                self.host[row, n:len(pages)] = new
                upd_rows += [row] * len(new)
                upd_cols += range(n, len(pages))
                upd_pages += new
                state[1], state[2] = pages, len(pages)
            out.append(state[0])
        self.updates = np.array([upd_rows, upd_cols, upd_pages], np.int64) if upd_pages else _NO_UPDATES
        if upd_pages:
            self._write(self.updates)
        return np.array(out, np.int64)

    @torch.inference_mode()
    def apply(self, updates: np.ndarray, num_rows: int) -> None:
        """Another PageTables' `updates` (int64 [3, U]) written into this device table, grown to num_rows rows."""
        if self.table.shape[0] < num_rows:
            self.table = torch.cat([self.table, self.table.new_zeros(num_rows - self.table.shape[0], self.width)])
        if updates.shape[1]:
            self._write(updates)

    def _write(self, updates: np.ndarray) -> None:
        upd = torch.from_numpy(updates)
        if self.device.type == "cuda":
            upd = upd.pin_memory().to(self.device, non_blocking=True)
        self.table[upd[0], upd[1]] = upd[2].to(torch.int32)

    def release(self, seq_id: int) -> None:
        state = self._state.pop(seq_id, None)
        if state is not None:
            self._free.append(state[0])

    def _take_row(self) -> int:
        if not self._free:   # grow: twice the rows, old rows kept
            old = self.host.shape[0]
            self.host = np.concatenate([self.host, np.zeros_like(self.host)])
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
