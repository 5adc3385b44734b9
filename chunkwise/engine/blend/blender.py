"""The blend package's per-request records: the scheduler's row planner for blended prefills, and the source of
their `chunk_reuse` reports. A sequence carries its request (whose `reuse` says whether it blends); what blending
learns about it lives here, from its plan until the engine finishes it (`pop_report`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunkwise.chunks import Blend, ChunkReuse
from chunkwise.engine.blend.planning import BlendJob, layer_rows, plan_blend
from chunkwise.engine.blend.report import blend_report
from chunkwise.engine.row_plan import HostRows, RowPlan

MAX_CHAINS = 4096   # chunks whose page chains are remembered


@dataclass
class _Record:
    job: BlendJob                               # its last planned prefill
    pieces: tuple                               # its request's pieces
    report: tuple[ChunkReuse, ...] | None = None   # once that prefill's step is sampled


class Blender:
    """Plans blended prefills (`plan`, a `RowPlanner`) and reports them (`report`, `pop_report`)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.records: dict[int, _Record] = {}   # seq id -> its record, from its first plan until it finishes
        # (chunk id, context) -> its variant's whole chain of cached pages (page ids, their generations), resolved
        # once and reused while no page of it has left the cache: a request's host work is then O(pieces), not
        # O(tokens) (its bytes) or O(pages) (a Python step per page)
        self.chains: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    @staticmethod
    def _blends(seq, computed: int) -> bool:
        """Whether `seq`'s prefill from `computed` tokens blends: not a request that does not, a prompt already
        computed, or a recompute after a preemption (exact)."""
        request = seq.request
        return not (request is None or not isinstance(request.reuse, Blend) or request.pieces is None
                    or seq.num_preemptions or computed >= seq.num_prompt_tokens)

    def counted_rows(self, seq, computed: int, n: int, page_size: int) -> int:
        """The rows `seq`'s prefill of n tokens from `computed` counts against a step's budget: n, or for a blended
        one its rows computed per layer on average (rounded up; `layer_rows`). Its placed rows cost a copy, not a
        layer's work."""
        if not self._blends(seq, computed):
            return n
        rows = layer_rows(seq.request.reuse, seq.request.pieces, computed, self.num_layers, page_size)
        return -(-sum(rows) // len(rows))

    def plan(self, seq, pool) -> RowPlan | None:
        """The row plan of `seq`'s prefill in the step being scheduled, or None where it does not blend."""
        if not self._blends(seq, seq.num_computed_tokens):
            return None
        request = seq.request
        job = plan_blend(request.reuse, request.pieces, seq.num_computed_tokens, pool, self.num_layers,
                         lambda piece: self._chain_pages(piece, pool))
        self.records[seq.seq_id] = _Record(job, request.pieces)
        return job.rows

    def _chain_pages(self, piece, pool) -> np.ndarray:
        """The cached pages (int64) of a chunk piece's variant (context then chunk): its remembered chain while
        still cached, else resolved (and remembered when whole: every full page of context + chunk cached)."""
        key = piece.chunk.chunk_id, piece.context
        chain = self.chains.get(key)
        if chain is not None and pool.still_cached(*chain):
            return chain[0]
        ids = piece.context.token_ids + piece.chunk.token_ids
        pages = np.array(pool.chain_pages(ids), np.int64)
        if len(pages) == len(ids) // pool.page_size:
            if len(self.chains) >= MAX_CHAINS:   # the oldest remembered goes (resolved again if it comes back)
                del self.chains[next(iter(self.chains))]
            self.chains[key] = pages, pool.stamp(pages)
        else:
            self.chains.pop(key, None)
        return pages

    def approximate_from(self, seq) -> int | None:
        """Where `seq`'s K/V stop being exact (its blend's c0) while it holds blended K/V; None when they are exact
        (never blended, or recomputed after a preemption)."""
        record = self.records.get(seq.seq_id)
        return None if record is None or seq.num_preemptions else record.job.start

    def report(self, rows: HostRows, kept: torch.Tensor) -> None:
        """Each blended prefill's ChunkReuse of a sampled step (`rows` its plan, `kept` the rows (layer-0 layout)
        its forward computed at the last layer, a host tensor the step's sampling has waited for)."""
        kept = kept.numpy()
        for seq_id, first in rows.first_rows.items():
            record = self.records.get(seq_id)
            if record is not None:   # else finished since
                record.report = blend_report(record.job, record.pieces, first, kept)

    def pop_report(self, seq_id: int) -> tuple[ChunkReuse, ...] | None:
        """A finished request's report (None if it blended no prefill that was sampled); forgets it."""
        record = self.records.pop(seq_id, None)
        return None if record is None else record.report
