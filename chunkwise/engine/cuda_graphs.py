"""The steps' CUDA graphs: captured per bucket over static input buffers, staged and replayed.

Decode-only steps: a step of d rows replays the graph of the smallest decode bucket that holds it; rows past the
real batch are padding (slot -1, so nothing is stored; one token; row 0 of the tables) and their logits are
dropped. With cascade attention each decode bucket has a second graph whose decodes read the shared splits once,
its groups in static buffers sized for the worst case. Under tensor parallelism every rank replays the same graph,
so the collectives inside match; the graph then also takes the greedy tokens, leaving the host no collective to
issue after a greedy step.

Mixed and prefill-only steps (one device, `max_graph_tokens` > 0): an eager step of a few hundred tokens spends
most of its time launching some 300 kernels from Python, far more than the kernels take, and every decoding user
waits for it. A step of R prefill rows and d decodes (R + d <= max_graph_tokens, at most PREFILL_SEQS prefilling
sequences, no row plan, no cascade groups) replays the graph of key (rows, decodes): the decodes padded to the
next power of two D, the prefill rows to `rows` - D, `rows` the smallest multiple of ROWS_STEP (or 16, 32) that
holds both. Layout: prefill rows first (real, then padding that belongs to no sequence: paged_attention skips
it), then the decodes (real, then padding); PREFILL_SEQS prefill sequences, those past the real ones holding no
query row. A row's result does not depend on the padding around it except through the row count of torch's
GEMMs, as for decode graphs; in deterministic mode (batch-invariant GEMMs) a replay gives the eager step's bits.

Static buffers (shared by every graph), each with a staging twin on the host that a step is written into and
copied from at once: int64, NUM_SEGMENTS segments of `seg` elements, in the order of the segment names below;
int32, the fields of `at32` (decode seq lens, prefill seq lens, query_start_loc, the cascade groups' tensors).
Page tables: `static_tables`, PREFILL_SEQS prefill rows then the decodes'.

Steps with a row plan (a blend's) replay graphs of their own, chunkwise/engine/blend_graphs.py; their rows are
bucketed by `head_bucket` up to their last check layer and by `tail_bucket` after it.
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from chunkwise.kernels.cascade import CascadeGroups
from chunkwise.engine.host_step import ALIGN, HostStep, fill_pending
from chunkwise.engine.kv_cache import KVCache
from chunkwise.engine.model import Model, StepInputs
from chunkwise.engine.distributed.tensor_parallel import TensorParallel

# The int64 segments: what the graph reads (a step's token ids, positions, cache slots, logits rows and page-table
# rows), then what is read before the replay, not by the graph (the pending tokens' rows in the batch and their
# rows in the last step's tokens; see HostStep).
IDS, POSITIONS, SLOTS, LOGITS_ROWS, TABLE_ROWS, PENDING, PENDING_SRC = range(7)
NUM_SEGMENTS = 7
PREFILL_SEQS = 8   # prefilling sequences a mixed graph holds; a step with more runs eagerly
ROWS_STEP = 64     # mixed graphs' row counts: 16, 32, then multiples of this


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_bucket(n: int) -> int:
    """A mixed graph's rows for n: 16, 32, or the next multiple of ROWS_STEP."""
    return 16 if n <= 16 else 32 if n <= 32 else -(-n // ROWS_STEP) * ROWS_STEP


# Blend graphs' row counts: row_bucket's up to TAIL_FINE_ROWS (a blend's later layers compute a few hundred rows,
# and padding them by up to 255 cost a fifth of their products), then multiples of TAIL_ROWS_STEP (fewer captures).
TAIL_FINE_ROWS = 2048
TAIL_ROWS_STEP = 256


def tail_bucket(n: int) -> int:
    """A blend graph's rows for n: row_bucket up to TAIL_FINE_ROWS, then the next multiple of TAIL_ROWS_STEP."""
    return row_bucket(n) if n <= TAIL_FINE_ROWS else -(-n // TAIL_ROWS_STEP) * TAIL_ROWS_STEP


# A blend graph's rows before its last check layer (layer 0, the check layers) run a few of the model's layers: above
# TAIL_FINE_ROWS they take STEPS_PER_OCTAVE buckets between powers of two (at most 1/8 padding there), so steps of
# several blended prefills, whose rows vary with each one's exact prefix, meet fewer keys to capture.
STEPS_PER_OCTAVE = 8


def head_bucket(n: int) -> int:
    """A blend graph's rows for n rows before its last check layer: tail_bucket's, or above TAIL_FINE_ROWS the next
    multiple of the larger of TAIL_ROWS_STEP and 1/STEPS_PER_OCTAVE of the power of two at or below n."""
    if n <= TAIL_FINE_ROWS:
        return tail_bucket(n)
    step = max(TAIL_ROWS_STEP, (1 << (n.bit_length() - 1)) // STEPS_PER_OCTAVE)
    return -(-n // step) * step


class StepGraphs:
    """The CUDA graphs of one runner's model over its KV cache (the logits a rank's vocabulary slice under tensor
    parallelism). Empty until `capture` (or, for running the static inputs eagerly, `allocate`)."""

    def __init__(self, model: Model, kv: KVCache, tp: TensorParallel | None, *, max_pages_per_seq: int,
                 page_size: int, split_size: int, cascade_item_size: int, num_kv_heads: int, device: torch.device,
                 max_graph_tokens: int = 0):
        self.model, self.kv, self.tp, self.device = model, kv, tp, device
        self.max_pages_per_seq, self.page_size, self.split_size = max_pages_per_seq, page_size, split_size
        self.cascade_item_size, self.num_kv_heads = cascade_item_size, num_kv_heads
        # Mixed graphs run on one device only: a rank's custom all-reduce picks its path by row count, and the
        # executor's workers would need the same padded step.
        self.max_graph_tokens = max_graph_tokens if tp is None else 0
        # (cascade attention?, prefill rows, decode rows) -> the graph, the logits its replays write and, under
        # tensor parallelism, their greedy tokens (None otherwise). Decode-only graphs have 0 prefill rows.
        self.graphs: dict[tuple[bool, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.rows = 0   # the largest decode bucket
        self.mixed_keys: set[tuple[int, int]] = set()   # (prefill rows, decode rows) of the mixed graphs
        self.budget = 0   # the most tokens of a step that a mixed graph holds

    def __len__(self) -> int:
        return len(self.graphs)

    def _segment(self, buf, segment: int, n: int):
        """The first n elements of an int64 segment of `buf` (the static buffer or its staging twin)."""
        at = segment * self.seg
        return buf[at:at + n]

    def _int32(self, buf, name: str, n: int):
        at, cap = self.at32[name]
        assert n <= cap, (name, n, cap)
        return buf[at:at + n]

    def allocate(self, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> None:
        """The static inputs and their staging twins, sized for max_num_seqs decodes and, with mixed graphs, steps
        of up to min(max_graph_tokens, max_num_batched_tokens) tokens.

        Each cascade group field sits at `at32[name]` (offset, capacity) of the int32 buffer, sized for the
        worst step: a sequence shares each split it holds whole with one group at most, so members (and items, of
        one member or more) number at most rows * whole splits per row, and shared splits (two members or
        more) half that.
        """
        n = self.rows = max_num_seqs
        self.buckets = sorted({b for b in [1, 2, 4, 8, *range(16, n + 1, 16), n] if b <= n}, reverse=True)
        budget = self.budget = min(self.max_graph_tokens, max_num_batched_tokens or self.max_graph_tokens)
        self.mixed_keys = self._mixed_keys(budget, n) if budget > 0 else set()
        self.prefill_seqs = min(PREFILL_SEQS, n) if self.mixed_keys else 0
        most_rows = max([n] + [r + d for r, d in self.mixed_keys])
        seg = self.seg = _align(max(most_rows, self.prefill_seqs + n))
        dev, pin = self.device, self.device.type == "cuda"
        members = n * max(1, self.max_pages_per_seq * self.page_size // self.split_size)
        caps = dict(decode_lens=n, prefill_lens=self.prefill_seqs, query_start_loc=self.prefill_seqs + 1,
                    split=members // 2, starts=members // 2 + 1, members=members, shared_splits=seg,
                    item_shared=members, item_first=members, num_items=1)
        self.at32, end = {}, 0
        for name in ("decode_lens", "prefill_lens", "query_start_loc", *CascadeGroups.TENSORS):
            self.at32[name] = end, caps[name]
            end += _align(caps[name])
            if name == "query_start_loc":
                self.plain32 = end   # what a step without cascade groups stages
        self.static64 = torch.zeros(NUM_SEGMENTS * seg, dtype=torch.int64, device=dev)
        self.static32 = torch.zeros(end, dtype=torch.int32, device=dev)
        self.stage64 = torch.zeros(NUM_SEGMENTS * seg, dtype=torch.int64, pin_memory=pin)
        self.stage32 = torch.zeros(end, dtype=torch.int32, pin_memory=pin)
        self._int32(self.stage32.numpy(), "decode_lens", n)[:] = 1
        self._int32(self.stage32.numpy(), "prefill_lens", self.prefill_seqs)[:] = 1
        self._segment(self.stage64.numpy(), SLOTS, seg)[:] = -1
        self.staged = torch.cuda.Event() if pin else None
        self.static64.copy_(self.stage64)
        self.static32.copy_(self.stage32)
        self.static_tables = torch.zeros(self.prefill_seqs + n, self.max_pages_per_seq, dtype=torch.int32,
                                         device=dev)
        # Persistent shared-split programs per KV head in a cascade graph: about as many programs in all as the
        # GPU runs at once (2-4 per SM at split-KV's tile), each looping over its share of the items; more
        # would only add programs that find no item. The interpreter runs programs one after another: there
        # one program takes every item.
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if pin else 0
        self.cascade_programs = max(1, min(members, -(-4 * sms // self.num_kv_heads)))

    @staticmethod
    def _mixed_keys(budget: int, n: int) -> set[tuple[int, int]]:
        """Every (prefill rows, decode rows) a step of at most `budget` tokens and n decodes can pad to: decodes D
        a power of two (or n), rows the smallest multiple of ROWS_STEP (or 16 or 32) above D that holds the real
        prefill rows beside them."""
        ladder = sorted({0, *(1 << k for k in range(n.bit_length()) if 1 << k < n), n})
        keys = set()
        for prev, dp in zip([-1] + ladder, ladder):
            fewest = prev + 1   # the fewest real decodes that pad to dp
            if fewest >= budget:
                break
            most = budget - fewest + dp   # the real prefill rows beside them, plus the decode rows
            buckets = [16, 32, *range(ROWS_STEP, row_bucket(most) + 1, ROWS_STEP)]
            keys.update((rows - dp, dp) for rows in buckets if dp < rows <= row_bucket(most))
        return keys

    def static_inputs(self, bs: int, cascade: bool, prefill_rows: int = 0) -> StepInputs:
        """StepInputs of a step of bs decode rows (with the static groups if cascade) after prefill_rows rows of
        PREFILL_SEQS prefilling sequences (none if 0), over the static buffers."""
        s64, s32, dev = self.static64, self.static32, self.device
        groups = None
        if cascade:
            views = {name: self._int32(s32, name, self.at32[name][1]) for name in CascadeGroups.TENSORS}
            views["shared_splits"] = views["shared_splits"][:bs]
            groups = CascadeGroups(**views, item_size=self.cascade_item_size, programs=self.cascade_programs,
                                   split_size=self.split_size)
        t, p = prefill_rows + bs, self.prefill_seqs if prefill_rows else 0
        tables = self.static_tables
        return StepInputs(
            input_ids=self._segment(s64, IDS, t), positions=self._segment(s64, POSITIONS, t),
            slot_mapping=self._segment(s64, SLOTS, t), page_tables=tables[:p],
            seq_lens=self._int32(s32, "prefill_lens", p),
            query_start_loc=(self._int32(s32, "query_start_loc", p + 1) if p
                             else torch.zeros(1, dtype=torch.int32, device=dev)),
            decode_page_tables=tables[self.prefill_seqs:self.prefill_seqs + bs],
            decode_seq_lens=self._int32(s32, "decode_lens", bs),
            logits_indices=self._segment(s64, LOGITS_ROWS, p + bs), cascade=groups)

    def capture(self, max_num_seqs: int, cascade: bool, max_num_batched_tokens: int | None = None) -> None:
        """One graph per decode batch-size bucket over the static inputs (with cascade attention on, a second one
        per bucket whose decodes go through cascade_decode), and one per mixed key; largest first, one pool."""
        self.allocate(max_num_seqs, max_num_batched_tokens)
        keys = [(c, 0, bs) for bs in self.buckets for c in ((False, True) if cascade else (False,))]
        keys += [(False, r, d) for r, d in sorted(self.mixed_keys)]
        pool = None
        with torch.inference_mode():
            for key in sorted(keys, key=lambda k: k[1] + k[2], reverse=True):
                cascade_graph, prefill_rows, bs = key
                inp = self.static_inputs(bs, cascade_graph, prefill_rows)
                self._capturable(inp)   # warm-up: compiles the kernels outside capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, tokens = self._capturable(inp)
                pool = graph.pool()
                self.graphs[key] = graph, logits, tokens
        torch.cuda.synchronize(self.device)

    def _capturable(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph captures: the logits (a rank's vocabulary slice under tensor parallelism) and, under
        tensor parallelism, their greedy tokens, so that a greedy step's replay leaves the host no collective to
        issue after it (only a step that samples gathers its logits eagerly, through CollectiveGuard)."""
        logits = self.model.forward(inp, self.kv.layers)
        return logits, (self.tp.argmax_logits(logits) if self.tp is not None else None)

    def key_for(self, host: HostStep) -> tuple[bool, int, int] | None:
        """The key of the graph whose static inputs hold the step, or None: decode-only steps with each decode
        sampled, within the largest bucket; mixed steps as the module docstring says."""
        d = len(host.rows) - host.num_prefill
        if host.num_prefill == 0:
            if d > self.rows or len(host.logits_indices) != d:
                return None
            return host.cascade is not None, 0, min(b for b in self.buckets if b >= d)
        if (not self.mixed_keys or host.row_plan is not None or host.cascade is not None
                or host.num_prefill > self.prefill_seqs):
            return None
        prefill_rows = int(host.query_start_loc[-1])
        if prefill_rows + d > self.budget or d > self.rows:   # more decodes than a graph's sequences: eager
            return None
        dp = min(self.rows, _pow2_at_least(d)) if d else 0
        rows = row_bucket(prefill_rows + dp)
        return (False, rows - dp, dp) if (rows - dp, dp) in self.mixed_keys else None

    def captured_key(self, host: HostStep) -> tuple[bool, int, int] | None:
        """The key of the captured graph that replays the step, or None."""
        key = self.key_for(host) if self.graphs else None
        return key if key in self.graphs else None

    def stage(self, host: HostStep, key: tuple[bool, int, int], table: torch.Tensor,
              last_tokens: torch.Tensor) -> None:
        """Copies a step into the static inputs of the graph `key` (its page-table rows gathered from `table`, its
        pending ids from `last_tokens`). Padding rows store nothing (slot -1), read row 0 of the tables, belong
        to no prefilling sequence or hold one decode token, and share no split (shared_splits 0; groups name
        only real rows)."""
        _, prefill_rows, bs = key
        p = host.num_prefill
        pseqs = self.prefill_seqs if prefill_rows else 0
        real = int(host.query_start_loc[-1]) if p else 0   # real prefill rows
        d = len(host.rows) - p
        if self.staged is not None:
            self.staged.synchronize()   # the last step's copy out of the staging buffers is done
        s64, s32 = self.stage64.numpy(), self.stage32.numpy()

        def moved(rows: np.ndarray) -> np.ndarray:   # a flat-batch row in the padded layout
            return np.where(rows < real, rows, rows + (prefill_rows - real))

        for segment, a, pad in ((IDS, host.ids, 0), (POSITIONS, host.positions, 0), (SLOTS, host.slots, -1)):
            rows = self._segment(s64, segment, prefill_rows + bs)
            rows[:real], rows[real:prefill_rows] = a[:real], pad
            rows[prefill_rows:prefill_rows + d], rows[prefill_rows + d:] = a[real:], pad
        ps = self.prefill_seqs   # the tables' layout is the same in every graph
        tables = self._segment(s64, TABLE_ROWS, ps + bs)
        tables[:p], tables[p:ps] = host.rows[:p], 0
        tables[ps:ps + d], tables[ps + d:] = host.rows[p:], 0
        logits = self._segment(s64, LOGITS_ROWS, pseqs + bs)
        n = len(host.logits_indices)
        logits[:n], logits[n:] = moved(host.logits_indices), 0
        m = len(host.pending)
        self._segment(s64, PENDING, m)[:] = moved(host.pending)
        self._segment(s64, PENDING_SRC, m)[:] = host.pending_src
        lens = self._int32(s32, "decode_lens", bs)
        lens[:d], lens[d:] = host.seq_lens[p:], 1
        if pseqs:
            lens = self._int32(s32, "prefill_lens", pseqs)
            lens[:p], lens[p:] = host.seq_lens[:p], 1
            qsl = self._int32(s32, "query_start_loc", pseqs + 1)
            qsl[:p + 1], qsl[p + 1:] = host.query_start_loc, real
        staged = self.plain32
        if host.cascade is not None:
            for name, t in zip(CascadeGroups.TENSORS, host.cascade.tensors()):
                at, cap = self.at32[name]
                if len(t) > cap:   # impossible by the bound in `allocate`: a grouping bug, not a fallback
                    raise RuntimeError(f"cascade groups of {d} decodes hold {len(t)} {name} entries, more than the "
                                       f"{cap} their static buffer was sized for")
                s32[at:at + len(t)] = t.numpy()
            at = self.at32["shared_splits"][0]
            s32[at + d:at + bs] = 0
            staged = len(s32)
        self.static64.copy_(self.stage64, non_blocking=True)
        self.static32[:staged].copy_(self.stage32[:staged], non_blocking=True)
        if self.staged is not None:
            self.staged.record()
        fill_pending(self._segment(self.static64, IDS, prefill_rows + bs), self._segment(self.static64, PENDING, m),
                     self._segment(self.static64, PENDING_SRC, m), last_tokens)
        torch.index_select(table, 0, self._segment(self.static64, TABLE_ROWS, self.prefill_seqs + bs),
                           out=self.static_tables[:self.prefill_seqs + bs])

    def replay(self, host: HostStep, key: tuple[bool, int, int], table: torch.Tensor,
               last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step through the graph of its `captured_key`: its logits and, under tensor parallelism, tokens; the
        padding rows' are dropped."""
        graph, logits, tokens = self.graphs[key]
        self.stage(host, key, table, last_tokens)
        with self.tp.issuing() if self.tp is not None else nullcontext():   # its NCCL kernels
            graph.replay()
        n = len(host.logits_indices)
        return logits[:n], None if tokens is None else tokens[:n]

    def static_forward(self, host: HostStep, table: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
        """The logits `replay` computes, run eagerly over the same static inputs: a step padded to its graph's
        key (tests the staging where no graph can be captured, e.g. on CPU; needs `allocate`)."""
        key = self.key_for(host)
        if key is None:
            raise ValueError(f"no graph holds a step of {host.num_prefill} prefills "
                             f"({int(host.query_start_loc[-1])} rows) and {len(host.rows) - host.num_prefill} "
                             f"decodes with {len(host.logits_indices)} rows sampled")
        self.stage(host, key, table, last_tokens)
        cascade, prefill_rows, bs = key
        logits = self.model.forward(self.static_inputs(bs, cascade, prefill_rows), self.kv.layers)
        return logits[:len(host.logits_indices)]

    def close(self) -> None:
        """Frees the graphs (and their memory pools); they hold the model no more."""
        self.graphs, self.model = {}, None
