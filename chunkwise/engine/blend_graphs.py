"""Blended prefills as CUDA graphs (issue #49 §2): a step with a row plan replays one graph for its whole forward,
layer 0, the check layers with their deviation, selection and narrowing on the device, then the later layers and
the logits. Eagerly its check layers cost some 35 launches each, far more than their rows' work.

A graph's key is (prefill rows, decode rows, check layers, prefill rows kept after each): the rows of the layers up
to the last check layer padded to `head_bucket` (coarser above 2,048 rows: a few layers' work), the decodes to the
next power of two (and to DECODE_PAD_SHARE's share of the prefill rows), the rows kept after the last check layer
(every later layer's) to `tail_bucket`. The layout is a mixed graph's (chunkwise/engine/cuda_graphs.py): prefill
rows first (real, then padding that belongs to no sequence and stores nothing), then the decodes (real, then
padding: one token, row 0 of the tables), PREFILL_SEQS prefilling sequences. A check layer selects on the device
(`row_plan.select_padded`): rows grouped by segment and ranked by deviation with two stable sorts, each segment
keeping the count fixed on the host, padding rows in a segment of their own that keeps none; the real kept rows come
first, as the eager step orders them, then rows not kept fill the bucket as padding (slot -1, past every sequence's
query_start_loc). The host stages each step's rows, segments, keep counts and query_start_locs into the key's static
inputs (numpy, one copy per dtype) and never waits for the selection: only `kept`, the rows the last layer computed,
is read back, by the report, later.

The K/V placement (`Model.place`, one launch per RoPE config) runs before the replay, outside the graph: its source
and destination counts vary per step. A key's first step runs eagerly over the static inputs, and its graph is
captured right after (recorded, not run: the step is computed once). One device only (no tensor parallelism:
`tensor_parallel_size > 1` refuses blending by name, chunkwise/engine/frontend.py). Decodes beside the prefills read
their splits as split-KV does, whether or not the step has cascade groups (cascade's bits are split-KV's). In
deterministic mode a replay gives the eager step's bits: a row's result depends on the padding around it only
through torch's GEMM row counts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from chunkwise.engine.cuda_graphs import PREFILL_SEQS, head_bucket, tail_bucket
from chunkwise.engine.host_step import ALIGN, HostStep, fill_pending
from chunkwise.engine.kv_cache import KVCache
from chunkwise.engine.model import Model, StepInputs
from chunkwise.engine.row_plan import PaddedSelection, RowInputs, RowSelection

# Decodes beside a blend's prefill rows are padded to at least 1/DECODE_PAD_SHARE of those rows (then to a power of
# two, at most the runner's sequences'): a padding decode costs a GEMM row and a one-token read, so steps whose decode
# counts differ share a graph for under 1/32 more rows.
DECODE_PAD_SHARE = 64
SEGMENTS = PREFILL_SEQS + 2   # a check layer's segments: a prefill's each, one run of whole ones, the padding's
Key = tuple[int, int, tuple[int, ...], tuple[int, ...]]   # (prefill rows, decode rows, check layers, kept rows)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Buffers:
    """Named fields of one dtype in one device buffer and its host staging twin (each field 16-element aligned)."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device):
        self.at, end = {}, 0
        for name, n in sizes.items():
            self.at[name] = end, n
            end += -(-n // ALIGN) * ALIGN
        pin = device.type == "cuda"
        self.host = torch.zeros(max(end, 1), dtype=dtype, pin_memory=pin)
        self.device = torch.zeros(max(end, 1), dtype=dtype, device=device)

    def __getitem__(self, name: str) -> np.ndarray:
        at, n = self.at[name]
        return self.host.numpy()[at:at + n]

    def view(self, name: str) -> torch.Tensor:
        at, n = self.at[name]
        return self.device[at:at + n]

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)


@dataclass
class _Static:
    """One key's static inputs: the buffers, the StepInputs over them and, once captured, its graph and outputs."""
    b64: _Buffers
    b32: _Buffers
    tables: torch.Tensor             # int32 [PREFILL_SEQS + decode rows, max pages]
    placed: torch.Tensor             # bool [rows]: the "placed" field, as the selection reads it
    inp: StepInputs
    staged: torch.cuda.Event | None  # the last copy out of the staging twins
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    kept: torch.Tensor | None = None


class BlendGraphs:
    """The blend graphs of one runner's model over its KV cache; off until `max_rows` > 0 (set where the step
    graphs are captured, or by tests running the static inputs eagerly)."""

    def __init__(self, model: Model, kv: KVCache, *, max_pages_per_seq: int, max_decodes: int,
                 device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.max_pages_per_seq, self.max_decodes = max_pages_per_seq, max_decodes
        self.max_rows = 0   # the most rows (prefill and decode) of a step a blend graph holds; 0: off
        self.statics: dict[Key, _Static] = {}
        self.pool = None

    def key_for(self, host: HostStep) -> Key | None:
        """The key of the graph that holds a row-planned step, or None: off, more prefills than PREFILL_SEQS, more
        rows than `max_rows`, more decodes than the runner's sequences, or places shared among groups (the
        "adaptive" policy selects eagerly: `select_padded` has no groups). A step's cascade groups do not stop it:
        the graph's decodes read their shared splits as split-KV does, which gives cascade's bits."""
        plan = host.row_plan
        if plan is None or not self.max_rows or host.num_prefill > PREFILL_SEQS or plan.groups is not None:
            return None
        real = int(host.query_start_loc[-1])
        d = len(host.rows) - host.num_prefill
        if real + d > self.max_rows or d > self.max_decodes:
            return None
        layers = tuple(sorted(plan.checks))
        kept = [int(plan.checks[i][1][-1]) for i in layers]
        decodes = min(_pow2_at_least(max(d, real // DECODE_PAD_SHARE)), _pow2_at_least(self.max_decodes)) if d else 0
        return (head_bucket(real), decodes, layers,
                tuple(head_bucket(k) for k in kept[:-1]) + tuple(tail_bucket(k) for k in kept[-1:]))

    def _static(self, key: Key) -> _Static:
        if key in self.statics:
            return self.statics[key]
        rows, decodes, layers, kept = key
        p, t, dev = PREFILL_SEQS, rows + decodes, self.device
        sizes64 = dict(ids=t, positions=t, slots=t, placed=t, logits=p + decodes, table_rows=p + decodes,
                       pending=p + decodes, pending_src=p + decodes)
        sizes32 = dict(seq_lens=p, qsl=p + 1, decode_lens=decodes)
        ins = (rows,) + kept[:-1]
        for c, n in enumerate(ins):
            sizes64.update({f"segment{c}": n, f"start{c}": SEGMENTS, f"keep{c}": SEGMENTS, f"count{c}": 1})
            sizes32[f"qsl{c}"] = p + 1
        b64, b32 = _Buffers(sizes64, torch.int64, dev), _Buffers(sizes32, torch.int32, dev)
        tables = torch.zeros(p + decodes, self.max_pages_per_seq, dtype=torch.int32, device=dev)
        checks = {layer: RowSelection([], b32.view(f"qsl{c}"), PaddedSelection(
            b64.view(f"segment{c}"), b64.view(f"start{c}"), b64.view(f"keep{c}"), b64.view(f"count{c}"), kept[c]))
            for c, layer in enumerate(layers)}
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        placed = torch.zeros(t, dtype=torch.bool, device=dev)
        plan = RowInputs(none, none, none, placed, checks)
        inp = StepInputs(input_ids=b64.view("ids"), positions=b64.view("positions"), slot_mapping=b64.view("slots"),
                         page_tables=tables[:p], seq_lens=b32.view("seq_lens"), query_start_loc=b32.view("qsl"),
                         decode_page_tables=tables[p:], decode_seq_lens=b32.view("decode_lens"),
                         logits_indices=b64.view("logits"), row_plan=plan, explicit_positions=True)
        static = self.statics[key] = _Static(b64, b32, tables, placed, inp, torch.cuda.Event() if dev.type == "cuda" else None)
        return static

    def stage(self, host: HostStep, key: Key, table: torch.Tensor, last_tokens: torch.Tensor) -> _Static:
        """Copies a row-planned step into its key's static inputs (the page-table rows gathered from `table`, the
        pending ids from `last_tokens`), padding as the module docstring says."""
        static = self._static(key)
        rows, decodes, layers, kept = key
        if static.staged is not None:
            static.staged.synchronize()   # the last step's copy out of the staging twins is done
        b64, b32, plan = static.b64, static.b32, host.row_plan
        p, ps = host.num_prefill, PREFILL_SEQS
        real = int(host.query_start_loc[-1])
        d = len(host.rows) - p
        for name, a, pad in (("ids", host.ids, 0), ("positions", host.positions, 0), ("slots", host.slots, -1),
                             ("placed", plan.placed, 0)):
            out = b64[name]
            out[:real], out[real:rows] = a[:real], pad
            out[rows:rows + d], out[rows + d:] = a[real:real + d], pad
        final = int(plan.checks[layers[-1]][1][-1]) if layers else real   # real prefill rows at the last layer
        last = kept[-1] if layers else rows
        logits = host.logits_indices
        out = b64["logits"]
        out[:len(logits)], out[len(logits):] = np.where(logits < final, logits, logits + (last - final)), 0
        out = b64["table_rows"]
        out[:p], out[p:ps], out[ps:ps + d], out[ps + d:] = host.rows[:p], 0, host.rows[p:], 0
        m = len(host.pending)
        b64["pending"][:m] = np.where(host.pending < real, host.pending, host.pending + (rows - real))
        b64["pending_src"][:m] = host.pending_src
        out = b32["seq_lens"]
        out[:p], out[p:] = host.seq_lens[:p], 1
        out = b32["qsl"]
        out[:p + 1], out[p + 1:] = host.query_start_loc, real
        out = b32["decode_lens"]
        out[:d], out[d:] = host.seq_lens[p:], 1
        before = real
        for c, layer in enumerate(layers):
            segments, qsl = plan.checks[layer]
            sizes = np.array([n for _, n, _ in segments], np.int64)
            if len(segments) > SEGMENTS - 1:   # impossible: segments are a step's prefills plus one run of whole ones
                raise RuntimeError(f"check layer {layer} has {len(segments)} segments, more than a blend graph's "
                                   f"{SEGMENTS - 1}")
            out = b64[f"segment{c}"]
            out[:before], out[before:] = np.repeat(np.arange(len(segments)), sizes)[:before], SEGMENTS - 1
            starts = np.minimum(np.cumsum(sizes) - sizes, before)   # a decode run's past the prefill rows
            out = b64[f"start{c}"]
            out[:len(segments)], out[len(segments):] = starts, before   # the padding's segment starts after them
            out = b64[f"keep{c}"]
            out[:len(segments)] = [n if k < 0 else k for _, n, k in segments]
            out[len(segments):] = 0
            before = int(qsl[-1])
            b64[f"count{c}"][0] = before
            out = b32[f"qsl{c}"]
            out[:p + 1], out[p + 1:] = qsl, before
        b64.upload()
        b32.upload()
        if static.staged is not None:
            static.staged.record()
        torch.ne(b64.view("placed"), 0, out=static.placed)
        fill_pending(static.inp.input_ids, b64.view("pending")[:m], b64.view("pending_src")[:m], last_tokens)
        torch.index_select(table, 0, b64.view("table_rows"), out=static.tables)
        return static

    def replay(self, host: HostStep, key: Key, table: torch.Tensor, last_tokens: torch.Tensor,
               place: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """A row-planned step through its key's graph: its logits and the rows (layer-0 layout) its last layer
        computed, the real prefill rows' only. `place` places the plan's K/V before the step. A key's first step
        runs eagerly over the static inputs (which also compiles what the capture records), then its graph is
        captured for the key's later steps: the capture records without running, so the step is computed once."""
        static = self.stage(host, key, table, last_tokens)
        place()
        if static.graph is None:
            logits = self.model.forward(static.inp, self.kv.layers, place=False)
            kept = static.inp.row_plan.kept   # this step's: the capture below rebinds the plan's to the graph's
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                static.logits = self.model.forward(static.inp, self.kv.layers, place=False)
            self.pool = graph.pool()
            static.graph, static.kept = graph, static.inp.row_plan.kept
        else:
            static.graph.replay()
            logits, kept = static.logits, static.kept
        # kept copied: a replay overwrites the graph's
        return logits[:len(host.logits_indices)], kept[:self._final(host, key)].clone()

    def static_forward(self, host: HostStep, table: torch.Tensor, last_tokens: torch.Tensor,
                       place: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """What `replay` computes, run eagerly over the same static inputs (tests the staging where no graph can be
        captured, e.g. on CPU)."""
        key = self.key_for(host)
        if key is None:
            raise ValueError(f"no blend graph holds a step of {host.num_prefill} prefills "
                             f"({int(host.query_start_loc[-1])} rows) and {len(host.rows) - host.num_prefill} decodes")
        static = self.stage(host, key, table, last_tokens)
        place()
        logits = self.model.forward(static.inp, self.kv.layers, place=False)
        return logits[:len(host.logits_indices)], static.inp.row_plan.kept[:self._final(host, key)]

    @staticmethod
    def _final(host: HostStep, key: Key) -> int:
        """The real prefill rows of the step's last layer."""
        layers = key[2]
        return int(host.row_plan.checks[layers[-1]][1][-1]) if layers else int(host.query_start_loc[-1])

    def close(self) -> None:
        """Frees the graphs and their static inputs."""
        self.statics, self.model, self.pool = {}, None, None
