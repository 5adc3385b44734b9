"""Runs one scheduled batch on one device (one rank's shard under tensor parallelism): builds the step's tensors
and launches its forward.

Step inputs are built on the host with numpy (no per-token Python), packed into one buffer per dtype and copied
once; page tables live on the device (`PageTables`). Decode-only batches, and mixed ones of up to `max_graph_tokens`,
replay CUDA graphs (`StepGraphs`); other steps run eagerly. The KV cache is `KVCache`'s; sampling is the `Sampler`'s,
on rank 0 only. On GPU, construction runs a forward per kernel specialisation class, so a user's first workload
compiles nothing.

Tensor parallel (`tp`): this runner is one rank's, over its shard; it knows of the other ranks only through the
`tp` handle whose collectives its forward calls. The executor (chunkwise/engine/executor/executor.py) sends each
step's HostStep (with the batch's page changes, which every rank's page tables apply alike) to the other ranks around
rank 0's forward (`run`'s `dispatch`); a worker's runner replays it (`run_host`). Every rank then runs the same
forward, eager or the same CUDA graph, so the collectives inside match.

Overlap scheduling: `run` launches a step and returns without waiting for the device; greedy tokens are
taken on the device and copied back asynchronously, read by the sampler later. A pending token (see `HostStep`) is
gathered on the device from the last launched step's tokens (`last_tokens`).
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from chunkwise.engine_config import EngineConfig
from chunkwise.kernels.cascade import CascadeGroups, cascade_groups, cascade_item_size
from chunkwise.kernels.tiling import cdiv
from chunkwise.engine.blend_graphs import BlendGraphs
from chunkwise.engine.cuda_graphs import StepGraphs
from chunkwise.engine.host_step import ALIGN, HostStep, Launched, fill_pending, synthetic_step
from chunkwise.engine.kv_cache import KVCache
from chunkwise.engine.model import PLANNED_SPLIT_ROWS, PREFILL_SPLIT_ROWS, Model, StepInputs
from chunkwise.engine.page_tables import PageTables
from chunkwise.engine.distributed.tensor_parallel import TensorParallel
from chunkwise.engine.row_plan import HostRows, RowInputs, RowSelection, step_rows


Forward = tuple[torch.Tensor | None, torch.Tensor]   # (logits or None, greedy tokens): see _logits_and_tokens


class ModelRunner:
    """One device's runner: prepares a ScheduledBatch's inputs and launches its forward, over its KV cache."""

    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None,
                 model_class: type = Model):
        """`model_class`: Model, or a stand-in with its constructor and forward (chunkwise/engine/stand_in_model.py)."""
        cfg = config.model_config
        self.engine_config, self.tp = config, tp
        self.num_heads = len(tp.q_heads) if tp else cfg.num_heads          # this rank's
        self.num_kv_heads = len(tp.kv_heads) if tp else cfg.num_kv_heads
        self.page_size = config.page_size
        self.device = tp.device if tp else config.device
        self.split_kv_threshold, self.split_size = config.split_kv_threshold, config.split_size
        self.model = model_class(cfg, weights, split_size=self.split_size, deterministic=config.deterministic, tp=tp,
                           fa3_prefill=config.attention_backend == "fa3")
        # Deterministic decodes take the single-pass kernel, so there are no splits to share.
        self.cascade = config.cascade_attention and not config.deterministic
        self.cascade_item_size = cascade_item_size(cfg.head_dim, self.num_heads // self.num_kv_heads)
        self.kv = KVCache(config, self.num_kv_heads, self.device, tp)
        self.tables = PageTables(config.max_pages_per_seq, self.device)
        # The last launched step's tokens on the device, and each sampling sequence's row in them. Under tensor
        # parallelism a graph step's live in the graphs' pool until the next replay, as Launched.logits do: every
        # read of them is queued before that replay.
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_rows: dict[int, int] = {}
        self.last_row_plan: RowInputs | None = None   # the last eager step's row plan, once run (its kept rows)
        self.graphs = StepGraphs(self.model, self.kv, tp, max_pages_per_seq=config.max_pages_per_seq,
                                 page_size=self.page_size, split_size=self.split_size,
                                 cascade_item_size=self.cascade_item_size, num_kv_heads=self.num_kv_heads,
                                 device=self.device, max_graph_tokens=config.max_graph_tokens)
        # Row-planned steps' whole forward (chunkwise/engine/blend_graphs.py); on where mixed graphs are.
        self.blend_graphs = BlendGraphs(self.model, self.kv, max_pages_per_seq=config.max_pages_per_seq,
                                        max_decodes=config.max_num_seqs, device=self.device)
        # Steps by kind ("decode", "cascade decode", "mixed": with prefill rows, "blend": with a row plan) and path
        # ("graph", "eager").
        self.launches: Counter[tuple[str, str]] = Counter()
        if self.device.type == "cuda":
            self._warm_up()
            if not config.enforce_eager and self.split_kv_threshold == 0:
                self.graphs.capture(config.max_num_seqs, self.cascade, config.max_num_batched_tokens)
                if config.max_graph_tokens > 0 and tp is None:   # blended prefills count their computed rows
                    self.blend_graphs.max_rows = config.max_blended_rows

    # ---- step inputs -------------------------------------------------------------------------------
    def prepare(self, batch) -> tuple[HostStep, list]:
        """Step inputs of a ScheduledBatch on the host, vectorised over tokens: paged_attention's rows first,
        then split-KV decodes.

        A decode goes through split-KV when its sequence holds more than split_kv_threshold tokens: a rule
        on the sequence alone, so a token's path (and its bits) never depends on what else is batched.
        Returns the sequences that sample this step (the batch's `samples`), in logits-row order.
        """
        self.tables.apply(batch.page_changes)   # first, so a step failing below has still applied them
        prefill, decode = [], []
        threshold = self.split_kv_threshold
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            start = seq.num_computed_tokens
            split = n == 1 and start >= seq.num_prompt_tokens and start + 1 > threshold
            (decode if split else prefill).append((seq, n, samples, start))
        entries = prefill + decode
        seqs, n, samples, start = zip(*entries) if entries else ((), (), (), ())
        n, start, samples = np.array(n, np.int64), np.array(start, np.int64), np.array(samples, bool)
        rows = self.tables.rows(seqs)
        ends = np.cumsum(n)
        owner = np.repeat(np.arange(len(entries)), n)   # row of the batch each token belongs to
        pos = start[owner] + np.arange(int(ends[-1]) if entries else 0) - (ends - n)[owner]
        slots = self.tables.host[rows[owner], pos // self.page_size].astype(np.int64) * self.page_size \
            + pos % self.page_size
        # A sequence's last token may still be pending (sampled by the last launched step, see `Sequence`):
        # then it is the last token this step computes for it, and its id is filled in on the device.
        pending = start + n > np.array([len(s.token_ids) for s in seqs], np.int64)
        if len(prefill):
            ids = np.full(len(pos), -1, np.int64)
            known = np.ones(len(pos), bool)
            known[(ends - 1)[pending]] = False
            ids[known] = self._known_ids(entries, len(pos) - int(pending.sum()))
        else:   # decodes only: each computes its last token
            ids = np.array([s.token_ids[-1] for s in seqs], np.int64)
            ids[pending] = -1
        plan, final = None, ends
        if batch.row_plans:   # prefills with row plans: some rows start late or stop early
            plans = [batch.row_plans.get(s.seq_id) for s in seqs[:len(prefill)]]
            keep0, final_n, plan = step_rows(plans, n, slots, len(prefill), [s.seq_id for s in seqs])
            ids, pos, slots = ids[keep0], pos[keep0], slots[keep0]
            ends, final = np.cumsum(np.add.reduceat(keep0.astype(np.int64), ends - n)), np.cumsum(final_n)
        try:
            src = np.array([self.last_rows[s.seq_id] for s, p in zip(seqs, pending) if p], np.int64)
        except KeyError as exc:
            raise RuntimeError(f"sequence {exc} has a pending token the last launched step did not sample") from None
        host = HostStep(ids=ids, positions=pos, slots=slots, logits_indices=(final - 1)[samples], rows=rows,
                        seq_lens=(start + n).astype(np.int32), query_start_loc=np.concatenate(
                            ([0], ends[:len(prefill)])).astype(np.int32), num_prefill=len(prefill),
                        cascade=self._cascade(rows[len(prefill):], start[len(prefill):] + 1),
                        pending=(ends - 1)[pending], pending_src=src, row_plan=plan,
                        needs_logits=any(s.sampling_params.needs_logits for s, _, keep, _ in entries if keep),
                        page_changes=batch.page_changes)
        return host, [e[0] for e in entries if e[2]]

    @staticmethod
    def _known_ids(entries, count: int) -> np.ndarray:
        """int64 [count]: the known ids the entries (seq, n, samples, start) compute, in order. Prompt tokens of a
        request with an id array (a composite prompt's, chunkwise/requests.py) are sliced from it, the others
        read from the token lists in one pass."""
        if all(s.request is None or s.request.prompt_array is None for s, _, _, _ in entries):   # one pass
            return np.fromiter(itertools.chain.from_iterable(s.token_ids[c:c + k] for s, k, _, c in entries),
                               np.int64, count)
        return np.concatenate([s.id_array(c, c + k) for s, k, _, c in entries])

    def _cascade(self, rows: np.ndarray, seq_lens: np.ndarray) -> CascadeGroups | None:
        """The split-KV decodes' shared splits (decodes in page-table `rows`, holding `seq_lens` tokens), when
        cascade attention is on and two of them share one.

        Decided from the page tables alone, and its result is bitwise split-KV's, so a token's bits do not
        depend on its batch-mates. Cheap test first: sharers hold a whole split and the same first page."""
        if not self.cascade or len(rows) < 2:
            return None
        firsts = self.tables.host[rows[seq_lens >= self.split_size], 0]
        if len(np.unique(firsts)) == len(firsts):
            return None
        groups = cascade_groups(self.tables.host, seq_lens, self.page_size, self.split_size,
                                item_size=self.cascade_item_size, rows=rows)
        return groups if groups.num_shared else None

    def _prefill_tables(self, seq_lens: np.ndarray) -> torch.Tensor:
        """The page-table columns an eager step's prefills can read: a split-context launch has a program per split
        of its tables' width, and those past every sequence's end return at once on a GPU but cost Python time each
        under the interpreter. Rounded up to 16 pages; the width is the launch's row stride, which the kernel does
        not specialise on."""
        table = self.tables.table
        need = cdiv(int(seq_lens.max(initial=1)), self.page_size)
        return table[:, :min(table.shape[1], cdiv(need, 16) * 16)]

    def _upload(self, host: HostStep) -> StepInputs:
        """Device StepInputs of a host step: one copy per dtype, page tables gathered on the device, pending
        ids filled in from the last step's tokens."""
        p = host.num_prefill
        (ids, pos, slots, logits, prows, drows, pending, src), d64 = self._packed(
            [host.ids, host.positions, host.slots, host.logits_indices, host.rows[:p], host.rows[p:], host.pending,
             host.pending_src], torch.int64)
        fill_pending(ids, pending, src, self.last_tokens)
        groups = host.cascade
        (lens, dlens, qsl, *group_tensors), _ = self._packed(
            [host.seq_lens[:p], host.seq_lens[p:], host.query_start_loc]
            + (groups.tensors() if groups is not None else []), torch.int32)
        return StepInputs(input_ids=ids, positions=pos, slot_mapping=slots,
                          page_tables=self._prefill_tables(host.seq_lens[:p]).index_select(0, prows), seq_lens=lens,
                          query_start_loc=qsl, decode_page_tables=self.tables.table.index_select(0, drows),
                          decode_seq_lens=dlens, logits_indices=logits,
                          cascade=groups.on(*group_tensors) if groups is not None else None,
                          row_plan=self._upload_rows(host.row_plan) if host.row_plan is not None else None,
                          explicit_positions=host.row_plan is not None)

    def _upload_rows(self, plan: HostRows) -> RowInputs:
        layers = sorted(plan.checks)
        grouped = plan.groups is not None
        (src, dst, deltas, placed, *groups), _ = self._packed(
            [plan.src_slots, plan.dst_slots, plan.deltas, plan.placed] + ([plan.groups] if grouped else []),
            torch.int64)
        qsls, _ = self._packed([plan.checks[i][1] for i in layers], torch.int32)
        return RowInputs(src, dst, deltas, placed.bool(),
                         {i: RowSelection(plan.checks[i][0], q) for i, q in zip(layers, qsls)},
                         groups=groups[0] if grouped else None)

    def _packed(self, arrays, dtype):
        """Device views of `arrays` packed into one buffer (one host-to-device copy); each view starts
        16-element aligned, so kernels see the same pointer alignment whatever the sizes."""
        starts, end = [], 0
        for a in arrays:
            starts.append(end)
            end += -(-len(a) // ALIGN) * ALIGN
        buf = torch.empty(max(end, 1), dtype=dtype, pin_memory=self.device.type == "cuda")
        flat = buf.numpy()
        for a, s in zip(arrays, starts):
            flat[s:s + len(a)] = a
        dev = buf.to(self.device, non_blocking=True)
        return [dev[s:s + len(a)] for a, s in zip(arrays, starts)], dev

    # ---- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch, dispatch: Callable[[HostStep, Callable[[], Forward]], Forward] | None = None) -> Launched:
        """Launch one step's forward and the copy to the host of its greedy tokens (and of a row-planned step's kept
        rows); waits for nothing on the device.
        `dispatch(host, forward)` runs the prepared step's forward (the executor's: under tensor parallelism it
        first sends the step to the other ranks)."""
        host, sampled = self.prepare(batch)
        logits, tokens = (self._logits_and_tokens(host) if dispatch is None
                          else dispatch(host, lambda: self._logits_and_tokens(host)))
        # The kept rows travel with the tokens: a blocking copy at postprocess would wait for the step launched
        # after this one too, and under overlap the device would idle while the host prepares the next.
        kept = None if host.row_plan is None else self.last_row_plan.kept
        ready = None
        if self.device.type == "cuda":
            host_tokens = self._to_host(tokens)
            if kept is not None:
                kept = self._to_host(kept)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_tokens = tokens
        # Only greedy tokens can feed the next step before sampling: a drawn token exists only after it.
        self.last_tokens = tokens
        self.last_rows = {s.seq_id: i for i, s in enumerate(sampled) if s.sampling_params.greedy}
        rows = None if kept is None else (host.row_plan, kept)
        return Launched(sampled, logits, host_tokens, ready, host.needs_logits, rows)

    @staticmethod
    def _to_host(t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of `t`, launched (complete once an event recorded after it has passed)."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    @torch.inference_mode()
    def run_host(self, host: HostStep) -> None:
        """A tensor-parallel worker's part of rank 0's step: its page changes, then the forward and its
        collectives. Every rank gets the same argmax tokens as rank 0, so under overlap a worker feeds pending
        tokens from its own device, bit for bit rank 0's."""
        self.tables.apply(host.page_changes)
        self.last_tokens = self._logits_and_tokens(host)[1]

    def _logits_and_tokens(self, host: HostStep) -> Forward:
        """(logits [N, vocab] or None, greedy tokens int64 [N]) of a prepared step. Under tensor parallelism the
        forward leaves each rank its vocabulary slice; the tokens come from the slices' maxima, and the logits
        are gathered whole only when the step samples from them (HostStep.needs_logits): gathering [N, vocab]
        to every rank is a measurable share of a decode step (docs/BENCHMARKS.md, "Behind the code")."""
        logits, tokens = self.forward(host)
        tp = self.tp
        if tp is None:
            return logits, torch.argmax(logits, dim=-1)
        if tokens is None:
            tokens = tp.argmax_logits(logits)
        return (tp.gather_logits(logits) if host.needs_logits else None), tokens

    def forward(self, host: HostStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, greedy tokens or None) of a prepared step: a CUDA graph replay for steps that fit one (cascade
        decode steps through their own graphs; under tensor parallelism the graph also took the tokens), else
        eager (no tokens). Logits are this rank's vocabulary slice under tensor parallelism. Counted in `launches`
        by (kind, path)."""
        kind = "mixed" if host.num_prefill else "cascade decode" if host.cascade is not None else "decode"
        if host.row_plan is not None:
            key = self.blend_graphs.key_for(host)
            if key is not None:
                self.launches["blend", "graph"] += 1
                rows = self._upload_rows(host.row_plan)
                logits, rows.kept = self.blend_graphs.replay(host, key, self.tables.table, self.last_tokens,
                                                             lambda: self.model.place(rows, self.kv.layers))
                self.last_row_plan = rows
                return logits, None
        key = self.graphs.captured_key(host)
        if key is not None:
            self.launches[kind, "graph"] += 1
            return self.graphs.replay(host, key, self.tables.table, self.last_tokens)
        self.launches[kind, "eager"] += 1
        inp = self._upload(host)
        logits = self.model.forward(inp, self.kv.layers)
        self.last_row_plan = inp.row_plan
        return logits, None

    def _warm_up(self):
        """Run one eager forward per specialisation class, so no Triton kernel compiles inside a user's step.

        Triton specialises a kernel on each integer argument being 1, a multiple of 16, or neither; the
        runtime sizes here are the step's tokens, prefill sequences, decodes and sampled rows. The batches
        below give every class of tokens and prefill sequences, each with every class of decodes. They
        store nothing (slot -1) and read row 0 of the tables.
        """
        prefills = [[], [1], [16], [17], [1] * 16, [1] * 15 + [2], [1] * 16 + [16], [1] * 17]
        if self.model.reduce_in_norm:
            prefills += self._above_custom_all_reduce()
        if self.device.type == "cuda":   # the interpreter compiles nothing: on CPU they would only cost time
            prefills += self._one_pass_prefills()
        with torch.inference_mode():
            for chunks in prefills:
                for d in (0, 1, 16, 17):
                    if chunks or d:
                        self.model.forward(self._upload(synthetic_step(chunks, d)), self.kv.layers)
                if chunks and self.tp is None:   # a row plan's prefills: explicit positions, K/V placed (in place)
                    self.model.forward(self._upload(replace(synthetic_step(chunks, 0), row_plan=HostRows.in_place(
                        sum(chunks)))), self.kv.layers)
            self.model.warm_up_deterministic(self.engine_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)

    def _one_pass_prefills(self) -> list[list[int]]:
        """Prefills of more rows than split their attention's context (PREFILL_SPLIT_ROWS, and PLANNED_SPLIT_ROWS
        for a row plan's), one per class of prefill sequences (1, a multiple of 16, neither) that the step budget
        and max_model_len allow: their one-pass attention launch specialises on the sequences' count, and the
        warm-up's small steps all split (a TP=1 bench compiled that launch inside its timed run)."""
        budget, longest = self.engine_config.max_num_batched_tokens, self.engine_config.max_model_len
        out = []
        for split_rows in (PREFILL_SPLIT_ROWS, PLANNED_SPLIT_ROWS):
            need = -(-(split_rows + 1) // longest)   # the fewest sequences holding that many rows
            other = max(need, 2) + (max(need, 2) % 16 == 0)
            for n in ([1] if need == 1 else []) + [-(-need // 16) * 16, other]:
                t = max(split_rows + 1, n)
                if t <= budget:
                    out.append([t // n + (i < t % n) for i in range(n)])
        return out

    def _above_custom_all_reduce(self) -> list[list[int]]:
        """Prefills of more rows than the custom all-reduce holds, one per token class (a multiple of 16 or not)
        that the step budget allows: their sublayer sums go through NCCL and the unfused norm, which the warm-up's
        small steps never reach."""
        above = self.model.tp.custom.max_rows + 1
        piece = self.engine_config.max_model_len   # no synthetic sequence is longer than a real one
        out = []
        for t in (-(-above // 16) * 16, above if above % 16 else above + 1):
            if t <= self.engine_config.max_num_batched_tokens:
                out.append([piece] * (t // piece) + ([t % piece] if t % piece else []))
        return out

    # ---- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Frees the KV cache, the CUDA graphs and the weights; the runner runs nothing after this."""
        self.kv.close()
        self.graphs.close()
        self.blend_graphs.close()
        self.model = None
