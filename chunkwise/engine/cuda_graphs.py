"""The decode steps' CUDA graphs: captured per batch-size bucket over static input buffers, staged and replayed.

A decode-only step of d rows replays the graph of the smallest bucket that holds it; rows past the real batch are
padding (slot -1, so nothing is stored; one token; row 0 of the tables) and their logits are dropped. With cascade
attention each bucket has a second graph whose decodes read the shared splits once, its groups in static buffers
sized for the worst case. Under tensor parallelism every rank replays the same graph, so the collectives inside
match; the graph then also takes the greedy tokens, leaving the host no collective to issue after a greedy step.

Static buffers (shared by every bucket's graphs), each with a staging twin on the host that a step is written into
and copied from at once: int64, NUM_SEGMENTS segments of `seg` elements (max_num_seqs rounded up to ALIGN), in
the order of the segment names below; int32, seq lens [seg] then the cascade groups' tensors (`group_at`).
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from chunkwise.kernels.cascade import CascadeGroups
from chunkwise.engine.host_step import ALIGN, HostStep, fill_pending
from chunkwise.engine.kv_cache import KVCache
from chunkwise.engine.model import Model, StepInputs
from chunkwise.engine.parallel.tensor_parallel import TensorParallel

# The int64 segments: what the graph reads (a step's token ids, positions, cache slots, logits rows and page-table
# rows), then what is read before the replay, not by the graph (the pending tokens' rows in the batch and their
# rows in the last step's tokens; see HostStep).
IDS, POSITIONS, SLOTS, LOGITS_ROWS, TABLE_ROWS, PENDING, PENDING_SRC = range(7)
NUM_SEGMENTS = 7


class DecodeGraphs:
    """The decode graphs of one runner's model over its KV cache (the logits a rank's vocabulary slice under tensor
    parallelism). Empty until `capture` (or, for running the static inputs eagerly, `allocate`)."""

    def __init__(self, model: Model, kv: KVCache, tp: TensorParallel | None, *, max_pages_per_seq: int,
                 page_size: int, split_size: int, cascade_item_size: int, num_kv_heads: int, device: torch.device):
        self.model, self.kv, self.tp, self.device = model, kv, tp, device
        self.max_pages_per_seq, self.page_size, self.split_size = max_pages_per_seq, page_size, split_size
        self.cascade_item_size, self.num_kv_heads = cascade_item_size, num_kv_heads
        # (cascade attention?, decode bucket) -> the graph, the logits its replays write and, under tensor
        # parallelism, their greedy tokens (None otherwise)
        self.graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.rows = 0   # the largest bucket

    def __len__(self) -> int:
        return len(self.graphs)

    def _segment(self, buf, segment: int, n: int):
        """The first n elements of an int64 segment of `buf` (the static buffer or its staging twin)."""
        at = segment * self.seg
        return buf[at:at + n]

    def allocate(self, max_num_seqs: int) -> None:
        """The static inputs and their staging twins, sized for max_num_seqs decodes.

        Each cascade group field sits at `group_at[name]` (offset, capacity) of the int32 buffer, sized for the
        worst step: a sequence shares each split it holds whole with one group at most, so members (and items, of
        one member or more) number at most rows * whole splits per row, and shared splits (two members or
        more) half that.
        """
        n = self.rows = max_num_seqs
        seg = self.seg = -(-n // ALIGN) * ALIGN
        dev, pin = self.device, self.device.type == "cuda"
        members = n * max(1, self.max_pages_per_seq * self.page_size // self.split_size)
        caps = dict(split=members // 2, starts=members // 2 + 1, members=members, shared_splits=seg,
                    item_shared=members, item_first=members, num_items=1)
        self.group_at, end = {}, seg
        for name in CascadeGroups.TENSORS:
            self.group_at[name] = end, caps[name]
            end += -(-caps[name] // ALIGN) * ALIGN
        self.static64 = torch.zeros(NUM_SEGMENTS * seg, dtype=torch.int64, device=dev)
        self.static32 = torch.zeros(end, dtype=torch.int32, device=dev)
        self.stage64 = torch.zeros(NUM_SEGMENTS * seg, dtype=torch.int64, pin_memory=pin)
        self.stage32 = torch.zeros(end, dtype=torch.int32, pin_memory=pin)
        self.stage32.numpy()[:seg] = 1
        self._segment(self.stage64.numpy(), LOGITS_ROWS, seg)[:] = np.arange(seg)
        self._segment(self.stage64.numpy(), SLOTS, seg)[:] = -1
        self.staged = torch.cuda.Event() if pin else None
        self.static64.copy_(self.stage64)
        self.static32.copy_(self.stage32)
        self.static_tables = torch.zeros(n, self.max_pages_per_seq, dtype=torch.int32, device=dev)
        self.buckets = sorted({b for b in [1, 2, 4, 8, *range(16, n + 1, 16), n] if b <= n}, reverse=True)
        # Persistent shared-split programs per KV head in a cascade graph: about as many programs in all as the
        # GPU runs at once (2-4 per SM at split-KV's tile), each looping over its share of the items; more
        # would only add programs that find no item. The interpreter runs programs one after another: there
        # one program takes every item.
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if pin else 0
        self.cascade_programs = max(1, min(members, -(-4 * sms // self.num_kv_heads)))

    def static_inputs(self, bs: int, cascade: bool) -> StepInputs:
        """StepInputs of a decode step of bs rows over the static buffers (with the static groups if cascade)."""
        s64, s32, dev = self.static64, self.static32, self.device
        groups = None
        if cascade:
            views = {name: s32[at:at + cap] for name, (at, cap) in self.group_at.items()}
            views["shared_splits"] = views["shared_splits"][:bs]
            groups = CascadeGroups(**views, item_size=self.cascade_item_size, programs=self.cascade_programs,
                                   split_size=self.split_size)
        return StepInputs(
            input_ids=self._segment(s64, IDS, bs), positions=self._segment(s64, POSITIONS, bs),
            slot_mapping=self._segment(s64, SLOTS, bs),
            page_tables=self.static_tables[:0], seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
            decode_page_tables=self.static_tables[:bs], decode_seq_lens=s32[:bs],
            logits_indices=self._segment(s64, LOGITS_ROWS, bs), cascade=groups)

    def capture(self, max_num_seqs: int, cascade: bool) -> None:
        """One graph per decode batch-size bucket over the static inputs (largest first, one pool), and with
        cascade attention on a second one per bucket whose decodes go through cascade_decode."""
        self.allocate(max_num_seqs)
        dev = self.device
        pool = None
        with torch.inference_mode():
            for bs in self.buckets:
                for cascade_graph in (False, True) if cascade else (False,):
                    inp = self.static_inputs(bs, cascade_graph)
                    self._capturable(inp)   # warm-up: compiles the kernels outside capture
                    torch.cuda.synchronize(dev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits, tokens = self._capturable(inp)
                    pool = graph.pool()
                    self.graphs[cascade_graph, bs] = graph, logits, tokens
        torch.cuda.synchronize(dev)

    def _capturable(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode graph captures: the logits (a rank's vocabulary slice under tensor parallelism) and, under
        tensor parallelism, their greedy tokens, so that a greedy step's replay leaves the host no collective to
        issue after it (only a step that samples gathers its logits eagerly, through CollectiveGuard)."""
        logits = self.model.forward(inp, self.kv.layers)
        return logits, (self.tp.argmax_logits(logits) if self.tp is not None else None)

    def fits(self, host: HostStep) -> bool:
        """Whether a graph replays the step: decode-only, each decode sampled, within the largest bucket."""
        d = len(host.rows)
        return (host.num_prefill == 0 and d <= self.rows and len(host.logits_indices) == d
                and (host.cascade is not None, self.rows) in self.graphs)   # the largest bucket holds `rows`

    def stage(self, host: HostStep, d: int, table: torch.Tensor, last_tokens: torch.Tensor) -> int:
        """Copies a decode-only step of d rows into the static inputs of the smallest bucket that holds it (its
        page-table rows gathered from `table`, its pending ids from `last_tokens`), and returns that bucket.
        Padding rows store nothing (slot -1), read row 0 of the tables, hold one token and share no split
        (shared_splits 0; groups name only real rows)."""
        bs = min(b for b in self.buckets if b >= d)
        if self.staged is not None:
            self.staged.synchronize()   # the last step's copy out of the staging buffers is done
        s64, s32 = self.stage64.numpy(), self.stage32.numpy()
        for segment, a, pad in ((IDS, host.ids, 0), (POSITIONS, host.positions, 0), (SLOTS, host.slots, -1),
                                (TABLE_ROWS, host.rows, 0)):
            rows = self._segment(s64, segment, bs)
            rows[:d] = a
            rows[d:] = pad
        m = len(host.pending)
        self._segment(s64, PENDING, m)[:] = host.pending
        self._segment(s64, PENDING_SRC, m)[:] = host.pending_src
        s32[:d] = host.seq_lens
        s32[d:bs] = 1
        staged = self.seg
        if host.cascade is not None:
            for name, t in zip(CascadeGroups.TENSORS, host.cascade.tensors()):
                at, cap = self.group_at[name]
                if len(t) > cap:   # impossible by the bound in `allocate`: a grouping bug, not a fallback
                    raise RuntimeError(f"cascade groups of {d} decodes hold {len(t)} {name} entries, more than the "
                                       f"{cap} their static buffer was sized for")
                s32[at:at + len(t)] = t.numpy()
            at = self.group_at["shared_splits"][0]
            s32[at + d:at + bs] = 0
            staged = len(s32)
        self.static64.copy_(self.stage64, non_blocking=True)
        self.static32[:staged].copy_(self.stage32[:staged], non_blocking=True)
        if self.staged is not None:
            self.staged.record()
        fill_pending(self._segment(self.static64, IDS, bs), self._segment(self.static64, PENDING, m),
                     self._segment(self.static64, PENDING_SRC, m), last_tokens)
        torch.index_select(table, 0, self._segment(self.static64, TABLE_ROWS, bs), out=self.static_tables[:bs])
        return bs

    def replay(self, host: HostStep, table: torch.Tensor,
               last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode-only step that `fits`, through its bucket's graph (the cascade one for a cascade step): its
        logits and, under tensor parallelism, tokens; the padding rows' are dropped."""
        d = len(host.rows)
        graph, logits, tokens = self.graphs[host.cascade is not None, self.stage(host, d, table, last_tokens)]
        with self.tp.issuing() if self.tp is not None else nullcontext():   # its NCCL kernels
            graph.replay()
        return logits[:d], None if tokens is None else tokens[:d]

    def static_forward(self, host: HostStep, table: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
        """The logits `replay` computes, run eagerly over the same static inputs: a decode-only step padded to its
        bucket (tests the staging where no graph can be captured, e.g. on CPU; needs `allocate`)."""
        d = len(host.rows)
        if host.num_prefill or len(host.logits_indices) != d or d > self.rows:
            raise ValueError(f"a static step is decode-only, each decode sampled, at most {self.rows} rows; "
                             f"got {host.num_prefill} prefills, {len(host.logits_indices)} of {d} rows sampled")
        bs = self.stage(host, d, table, last_tokens)
        return self.model.forward(self.static_inputs(bs, host.cascade is not None), self.kv.layers)[:d]

    def close(self) -> None:
        """Frees the graphs (and their memory pool); they hold the model no more."""
        self.graphs, self.model = {}, None
