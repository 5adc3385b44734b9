"""Runs one scheduled batch: owns the paged KV cache, builds the step's tensors, the forward, sampling.

KV cache per layer: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim] in the model's dtype;
slot = page_id * page_size + offset. Step inputs are built on the host with numpy (no per-token Python),
packed into one buffer per dtype and copied once; page tables live on the device (`PageTables`).
Decode-only batches replay CUDA graphs captured per batch-size bucket (rows past the real batch are
padding: slot -1, so nothing is stored, and their logits are dropped); with cascade attention, each bucket
has a second graph whose decodes read the shared splits once, its groups in static buffers sized for the
worst case. On GPU, construction runs a forward per kernel specialisation class, so a user's first workload
compiles nothing.

Tensor parallel (`tp`): this runner is one rank's, over its shard; its KV cache holds the rank's KV heads, and
every rank agrees on the pool size (the smallest any rank can hold). Rank 0's runner (the engine's) has the
`workers` and sends them each step's HostStep (with the batch's page changes, which every rank's page tables
apply alike) before its own forward; a worker's runner replays it (`run_host`). Every rank then runs the same
forward, eager or the same CUDA graph, so the collectives inside match.

Overlap scheduling: `run` launches a step and returns without waiting for the device; greedy tokens are
taken on the device and copied back asynchronously, read by `sample` later. A token sampled by the last
launched step but not yet known on the host (a sequence's pending token) is fed to the next step on the
device: its input id is gathered from that step's tokens, so launching step k+1 never waits for step k.
"""
from __future__ import annotations

import itertools
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from chunkwise.model_config import ModelConfig
from chunkwise.engine_config import EngineConfig
from chunkwise.sampling import make_generator, sample, token_logprobs
from chunkwise.kernels.cascade import CascadeGroups, cascade_groups, cascade_item_size
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE, split_tile_config
from chunkwise.engine.page_pool import PageChanges
from chunkwise.engine.page_tables import PageTables
from chunkwise.engine.model import Model, StepInputs
from chunkwise.engine.tensor_parallel import TensorParallel
from chunkwise.engine.workers import COLLECTIVE_TIMEOUT

if TYPE_CHECKING:
    from chunkwise.engine.workers import Workers

# The Triton interpreter runs a split-KV decode (split + merge programs) slower than a one-pass decode
# for short contexts; on CPU only long sequences take it by default. On GPU every decode does, which is
# also what the decode CUDA graphs capture.
CPU_SPLIT_KV_THRESHOLD = 256
CPU_KV_CACHE_CAP = 512 << 20   # bytes of KV cache a CPU engine takes by default
ALIGN = 16   # elements: each packed input starts 16-element aligned


@dataclass
class HostStep:
    """A step's inputs on the host (numpy), rows in flat-batch order: B = prefill rows then decode rows."""
    ids: np.ndarray              # int64 [T]
    positions: np.ndarray        # int64 [T]
    slots: np.ndarray            # int64 [T]
    logits_indices: np.ndarray   # int64 [N]
    rows: np.ndarray             # int64 [B], each sequence's row of PageTables
    seq_lens: np.ndarray         # int32 [B], tokens in the cache after this step
    query_start_loc: np.ndarray  # int32 [P + 1], prefill rows only
    num_prefill: int             # P
    cascade: CascadeGroups | None = None   # the decodes' shared splits (host tensors)
    page_changes: PageChanges = field(default_factory=PageChanges.none)   # the batch's, applied to PageTables
    # Whether a row samples from the logits or asks for logprobs (SamplingParams.needs_logits): only then does
    # the host read the logits (so the step cannot overlap the next), and under tensor parallelism only then are
    # they gathered whole (each rank's argmax is enough for greedy tokens).
    needs_logits: bool = False
    # Tokens still pending (ids -1 here): their rows in the flat batch, and the rows of the last launched
    # step's sampled tokens that hold them.
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # int64 [M]
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # int64 [M]


@dataclass
class Launched:
    """A step whose forward is launched: the sequences that sample (in logits-row order), their logits, and
    the copy to the host of their greedy tokens (complete once `ready` has passed)."""
    seqs: list
    logits: torch.Tensor | None   # [N, vocab] as Model.forward gives them; a graph step's last until the next replay;
                                  # None under tensor parallelism when no row samples from them (see HostStep)
    host_tokens: torch.Tensor     # int64 [N], argmax of each row (pinned on GPU)
    ready: torch.cuda.Event | None
    needs_logits: bool            # HostStep's: a row's token or logprobs come from the logits on the host


def _synthetic_step(chunks: list[int], num_decodes: int) -> HostStep:
    """A step of fresh prefills (chunk lengths) and decodes at position 0 that stores nothing (slot -1)."""
    lens = np.array(chunks + [1] * num_decodes, np.int64)
    ends = np.cumsum(lens)
    pos = np.arange(int(ends[-1])) - np.repeat(ends - lens, lens)
    return HostStep(ids=np.ones(len(pos), np.int64), positions=pos, slots=np.full(len(pos), -1, np.int64),
                    logits_indices=ends - 1, rows=np.zeros(len(lens), np.int64), seq_lens=lens.astype(np.int32),
                    query_start_loc=np.concatenate(([0], ends[:len(chunks)])).astype(np.int32),
                    num_prefill=len(chunks))


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """Bytes one page takes over all layers, K and V (of `kv_heads` heads: a tensor-parallel rank's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * (kv_heads or cfg.num_kv_heads) * cfg.head_dim * elem


def activation_reserve(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                       dtype: torch.dtype) -> int:
    """A generous bound on one step's activations, kept free beside the KV cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (4 * cfg.intermediate_size + 6 * cfg.hidden_size + 3 * qkv) * elem + 64
    return max_num_batched_tokens * per_token + 3 * max_num_seqs * cfg.vocab_size * 4 + (256 << 20)


class ModelRunner:
    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None,
                 workers: Workers | None = None):
        cfg = config.model_config
        self.engine_config, self.cfg = config, cfg
        if tp is not None and config.custom_all_reduce:   # before the KV cache takes the free memory
            tp = tp.with_custom_all_reduce(config.dtype, COLLECTIVE_TIMEOUT)
            if workers is not None:
                workers.tp = tp
        self.tp, self.workers = tp, workers
        self.num_heads = len(tp.q_heads) if tp else cfg.num_heads          # this rank's
        self.num_kv_heads = len(tp.kv_heads) if tp else cfg.num_kv_heads
        self.dtype, self.page_size = config.dtype, config.page_size
        self.device = tp.device if tp else config.device
        threshold = config.split_kv_threshold
        self.split_kv_threshold = threshold if threshold is not None else (
            0 if self.device.type == "cuda" else CPU_SPLIT_KV_THRESHOLD)
        self.split_size = DEFAULT_SPLIT_SIZE if config.split_size is None else config.split_size
        block_n = split_tile_config(cfg.head_dim, self.num_heads // self.num_kv_heads)[1]
        if self.split_size % block_n:
            raise ValueError(f"split_size must be a multiple of {block_n} (the split-KV tile for head_dim "
                             f"{cfg.head_dim}), got {self.split_size}")
        self.model = Model(cfg, weights, split_size=self.split_size, deterministic=config.deterministic, tp=tp)
        # Deterministic decodes take the single-pass kernel, so there are no splits to share.
        self.cascade = config.cascade_attention and not config.deterministic
        self.cascade_item_size = cascade_item_size(cfg.head_dim, self.num_heads // self.num_kv_heads)
        self.max_pages_per_seq = config.max_pages_per_seq
        self.num_pages = self._pool_size() if tp is None else tp.min(self._pool_size())
        shape = (self.num_pages, self.page_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]
        self.tables = PageTables(self.max_pages_per_seq, self.device)
        self.generators: dict[int, torch.Generator | None] = {}
        # The last launched step's tokens on the device, and each sampling sequence's row in them. Under tensor
        # parallelism a graph step's live in the graphs' pool until the next replay, as Launched.logits do: every
        # read of them is queued before that replay.
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_rows: dict[int, int] = {}
        # (cascade attention?, decode bucket) -> the graph, the logits its replays write and, under tensor
        # parallelism, their greedy tokens (None otherwise)
        self.graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.graph_rows = 0
        # Steps by kind ("decode", "cascade decode", "mixed": with prefill rows) and path ("graph", "eager").
        self.launches: Counter[tuple[str, str]] = Counter()
        if self.device.type == "cuda":
            self._warm_up()
            if not config.enforce_eager and self.split_kv_threshold == 0:
                self._capture_graphs(config.max_num_seqs)

    def _pool_size(self) -> int:
        """Pages the pool gets: as asked (if memory holds them) or what the memory budget allows."""
        config = self.engine_config
        per_page = page_bytes(self.cfg, self.page_size, self.dtype, self.num_kv_heads)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(free, total * config.gpu_memory_utilization - (total - free))
            budget -= activation_reserve(self.cfg, config.max_num_batched_tokens, config.max_num_seqs, self.dtype)
            default = int(budget // per_page)
        else:
            budget = psutil.virtual_memory().available
            # Room for every running sequence at full length, capped: the pool is zeroed, so it is all
            # resident, and a CPU engine serves a few short requests.
            cap = min(CPU_KV_CACHE_CAP, budget // 4)
            default = min(config.max_num_seqs * self.max_pages_per_seq, int(cap // per_page))
        num_pages = default if config.num_pages is None else config.num_pages
        if num_pages * per_page > budget:
            raise ValueError(f"num_pages={num_pages} of page_size={self.page_size} needs "
                             f"{num_pages * per_page / 2**30:.2f} GiB of KV cache; only "
                             f"{max(budget, 0) / 2**30:.2f} GiB are available")
        if num_pages < 1:
            raise ValueError(f"page_size={self.page_size}: one page of KV cache takes {per_page / 2**30:.2f} GiB, "
                             f"more than the {max(budget, 0) / 2**30:.2f} GiB available for the cache")
        return num_pages

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
            ids[known] = np.fromiter(itertools.chain.from_iterable(s.token_ids[c:c + k] for s, k, _, c in entries),
                                     np.int64, len(pos) - int(pending.sum()))
        else:   # decodes only: each computes its last token
            ids = np.array([s.token_ids[-1] for s in seqs], np.int64)
            ids[pending] = -1
        try:
            src = np.array([self.last_rows[s.seq_id] for s, p in zip(seqs, pending) if p], np.int64)
        except KeyError as exc:
            raise RuntimeError(f"sequence {exc} has a pending token the last launched step did not sample") from None
        host = HostStep(ids=ids, positions=pos, slots=slots, logits_indices=(ends - 1)[samples], rows=rows,
                        seq_lens=(start + n).astype(np.int32), query_start_loc=np.concatenate(
                            ([0], ends[:len(prefill)])).astype(np.int32), num_prefill=len(prefill),
                        cascade=self._cascade(rows[len(prefill):], start[len(prefill):] + 1),
                        pending=(ends - 1)[pending], pending_src=src,
                        needs_logits=any(s.sampling_params.needs_logits for s, _, keep, _ in entries if keep),
                        page_changes=batch.page_changes)
        return host, [e[0] for e in entries if e[2]]

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

    def _upload(self, host: HostStep) -> StepInputs:
        """Device StepInputs of a host step: one copy per dtype, page tables gathered on the device, pending
        ids filled in from the last step's tokens."""
        p = host.num_prefill
        (ids, pos, slots, logits, prows, drows, pending, src), d64 = self._packed(
            [host.ids, host.positions, host.slots, host.logits_indices, host.rows[:p], host.rows[p:], host.pending,
             host.pending_src], torch.int64)
        self._fill_pending(ids, pending, src)
        groups = host.cascade
        (lens, dlens, qsl, *group_tensors), _ = self._packed(
            [host.seq_lens[:p], host.seq_lens[p:], host.query_start_loc]
            + (groups.tensors() if groups is not None else []), torch.int32)
        return StepInputs(input_ids=ids, positions=pos, slot_mapping=slots,
                          page_tables=self.tables.table.index_select(0, prows), seq_lens=lens,
                          query_start_loc=qsl, decode_page_tables=self.tables.table.index_select(0, drows),
                          decode_seq_lens=dlens, logits_indices=logits,
                          cascade=groups.on(*group_tensors) if groups is not None else None)

    def _fill_pending(self, ids: torch.Tensor, pending: torch.Tensor, src: torch.Tensor) -> None:
        """ids[pending] = the last step's tokens[src], on the device (no wait for that step)."""
        if len(pending):
            ids.index_copy_(0, pending, self.last_tokens.index_select(0, src))

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
    def run(self, batch) -> Launched:
        """Launch one step's forward and its greedy tokens' copy to the host; waits for nothing on the device."""
        host, sampled = self.prepare(batch)
        if self.workers is not None:
            logits, tokens = self.workers.together(("step", host), lambda: self._logits_and_tokens(host))
        else:
            logits, tokens = self._logits_and_tokens(host)
        ready = None
        if self.device.type == "cuda":
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host_tokens.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_tokens = tokens
        # Only greedy tokens can feed the next step before `sample`: a drawn token exists only after it.
        self.last_tokens = tokens
        self.last_rows = {s.seq_id: i for i, s in enumerate(sampled) if s.sampling_params.greedy}
        return Launched(sampled, logits, host_tokens, ready, host.needs_logits)

    @torch.inference_mode()
    def run_host(self, host: HostStep) -> None:
        """A tensor-parallel worker's part of rank 0's step: its page changes, then the forward and its
        collectives. Every rank gets the same argmax tokens as rank 0, so under overlap a worker feeds pending
        tokens from its own device, bit for bit rank 0's."""
        self.tables.apply(host.page_changes)
        self.last_tokens = self._logits_and_tokens(host)[1]

    def _logits_and_tokens(self, host: HostStep) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits [N, vocab] or None, greedy tokens int64 [N]) of a prepared step. Under tensor parallelism the
        forward leaves each rank its vocabulary slice; the tokens come from the slices' maxima, and the logits
        are gathered whole only when the step samples from them (HostStep.needs_logits): gathering [N, vocab]
        to every rank took about 3% of a 256-row decode step of a 128k vocabulary on two H200s."""
        logits, tokens = self.forward(host)
        tp = self.tp
        if tp is None:
            return logits, torch.argmax(logits, dim=-1)
        if tokens is None:
            tokens = tp.argmax_logits(logits)
        return (tp.gather_logits(logits) if host.needs_logits else None), tokens

    def forward(self, host: HostStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, greedy tokens or None) of a prepared step: a CUDA graph replay for decode-only steps that fit
        one (cascade steps through their own graphs; under tensor parallelism the graph also took the tokens), else
        eager (no tokens). Logits are this rank's vocabulary slice under tensor parallelism. Counted in `launches`
        by (kind, path)."""
        d = len(host.rows) - host.num_prefill
        cascade = host.cascade is not None
        kind = "mixed" if host.num_prefill else "cascade decode" if cascade else "decode"
        if (host.num_prefill == 0 and d <= self.graph_rows and len(host.logits_indices) == d
                and (cascade, self.graph_rows) in self.graphs):   # the largest bucket holds graph_rows
            self.launches[kind, "graph"] += 1
            return self._replay(host, d)
        self.launches[kind, "eager"] += 1
        return self.model.forward(self._upload(host), self.kv_caches), None

    def _static_buffers(self, max_num_seqs: int):
        """The decode graphs' static inputs (shared by every bucket's graphs) and their staging twins on the host.

        int64 [7 * seg]: ids, positions, slots, logits rows, page-table rows, then (read before the replay, not
        by the graph) pending rows and their rows in the last step's tokens. int32: seq lens [seg], then the
        cascade graphs' CascadeGroups, each field at `group_at[name]` (offset, capacity), sized for the worst
        step: a sequence shares each split it holds whole with one group at most, so members (and items, of
        one member or more) number at most rows * whole splits per row, and shared splits (two members or
        more) half that.
        """
        n = self.graph_rows = max_num_seqs
        seg = self.seg = -(-n // ALIGN) * ALIGN
        dev, pin = self.device, self.device.type == "cuda"
        members = n * max(1, self.max_pages_per_seq * self.page_size // self.split_size)
        caps = dict(split=members // 2, starts=members // 2 + 1, members=members, shared_splits=seg,
                    item_shared=members, item_first=members, num_items=1)
        self.group_at, end = {}, seg
        for name in CascadeGroups.TENSORS:
            self.group_at[name] = end, caps[name]
            end += -(-caps[name] // ALIGN) * ALIGN
        self.static64 = torch.zeros(7 * seg, dtype=torch.int64, device=dev)
        self.static32 = torch.zeros(end, dtype=torch.int32, device=dev)
        self.stage64 = torch.zeros(7 * seg, dtype=torch.int64, pin_memory=pin)
        self.stage32 = torch.zeros(end, dtype=torch.int32, pin_memory=pin)
        self.stage32.numpy()[:seg] = 1
        self.stage64.numpy()[3 * seg:4 * seg] = np.arange(seg)
        self.stage64.numpy()[2 * seg:3 * seg] = -1
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

    def _static_inputs(self, bs: int, cascade: bool) -> StepInputs:
        """StepInputs of a decode step of bs rows over the static buffers (with the static groups if cascade)."""
        seg, s64, s32, dev = self.seg, self.static64, self.static32, self.device
        groups = None
        if cascade:
            views = {name: s32[at:at + cap] for name, (at, cap) in self.group_at.items()}
            views["shared_splits"] = views["shared_splits"][:bs]
            groups = CascadeGroups(**views, item_size=self.cascade_item_size, programs=self.cascade_programs,
                                   split_size=self.split_size)
        return StepInputs(
            input_ids=s64[:bs], positions=s64[seg:seg + bs], slot_mapping=s64[2 * seg:2 * seg + bs],
            page_tables=self.static_tables[:0], seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
            decode_page_tables=self.static_tables[:bs], decode_seq_lens=s32[:bs],
            logits_indices=s64[3 * seg:3 * seg + bs], cascade=groups)

    def _capture_graphs(self, max_num_seqs: int):
        """One graph per decode batch-size bucket over the static inputs (largest first, one pool), and with
        cascade attention on a second one per bucket whose decodes go through cascade_decode."""
        self._static_buffers(max_num_seqs)
        dev = self.device
        pool = None
        with torch.inference_mode():
            for bs in self.buckets:
                for cascade in (False, True) if self.cascade else (False,):
                    inp = self._static_inputs(bs, cascade)
                    self._capturable(inp)   # warm-up: compiles the kernels outside capture
                    torch.cuda.synchronize(dev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits, tokens = self._capturable(inp)
                    pool = graph.pool()
                    self.graphs[cascade, bs] = graph, logits, tokens
        torch.cuda.synchronize(dev)

    def _capturable(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode graph captures: the logits (a rank's vocabulary slice under tensor parallelism) and, under
        tensor parallelism, their greedy tokens, so that a greedy step's replay leaves the host no collective to
        issue after it (only a step that samples gathers its logits eagerly, through CollectiveGuard)."""
        logits = self.model.forward(inp, self.kv_caches)
        return logits, (self.tp.argmax_logits(logits) if self.tp is not None else None)

    def _stage(self, host: HostStep, d: int) -> int:
        """Copies a decode-only step of d rows into the static inputs of the smallest bucket that holds it, and
        returns that bucket. Padding rows store nothing (slot -1), read row 0 of the tables, hold one token and
        share no split (shared_splits 0; groups name only real rows)."""
        bs = min(b for b in self.buckets if b >= d)
        seg = self.seg
        if self.staged is not None:
            self.staged.synchronize()   # the last step's copy out of the staging buffers is done
        s64, s32 = self.stage64.numpy(), self.stage32.numpy()
        for k, (a, pad) in enumerate(((host.ids, 0), (host.positions, 0), (host.slots, -1))):
            s64[k * seg:k * seg + d] = a
            s64[k * seg + d:k * seg + bs] = pad
        s64[4 * seg:4 * seg + d] = host.rows
        s64[4 * seg + d:4 * seg + bs] = 0
        m = len(host.pending)
        s64[5 * seg:5 * seg + m] = host.pending
        s64[6 * seg:6 * seg + m] = host.pending_src
        s32[:d] = host.seq_lens
        s32[d:bs] = 1
        staged = seg
        if host.cascade is not None:
            for name, t in zip(CascadeGroups.TENSORS, host.cascade.tensors()):
                at, cap = self.group_at[name]
                if len(t) > cap:   # impossible by the bound in _static_buffers: a grouping bug, not a fallback
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
        self._fill_pending(self.static64[:bs], self.static64[5 * seg:5 * seg + m], self.static64[6 * seg:6 * seg + m])
        torch.index_select(self.tables.table, 0, self.static64[4 * seg:4 * seg + bs], out=self.static_tables[:bs])
        return bs

    def _replay(self, host: HostStep, d: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode-only step through its bucket's graph (the cascade one for a cascade step): its logits and, under
        tensor parallelism, tokens; the padding rows' are dropped."""
        graph, logits, tokens = self.graphs[host.cascade is not None, self._stage(host, d)]
        with self.tp.issuing() if self.tp is not None else nullcontext():   # its NCCL kernels
            graph.replay()
        return logits[:d], None if tokens is None else tokens[:d]

    def _static_forward(self, host: HostStep) -> torch.Tensor:
        """The logits `_replay` computes, run eagerly over the same static inputs: a decode-only step padded to its
        bucket (tests the staging where no graph can be captured, e.g. on CPU; needs `_static_buffers`)."""
        d = len(host.rows)
        if host.num_prefill or len(host.logits_indices) != d or d > self.graph_rows:
            raise ValueError(f"a static step is decode-only, each decode sampled, at most {self.graph_rows} rows; "
                             f"got {host.num_prefill} prefills, {len(host.logits_indices)} of {d} rows sampled")
        bs = self._stage(host, d)
        return self.model.forward(self._static_inputs(bs, host.cascade is not None), self.kv_caches)[:d]

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
        with torch.inference_mode():
            for chunks in prefills:
                for d in (0, 1, 16, 17):
                    if chunks or d:
                        self.model.forward(self._upload(_synthetic_step(chunks, d)), self.kv_caches)
        torch.cuda.synchronize(self.device)

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

    # ---- sampling ----------------------------------------------------------------------------------
    def sample(self, step: Launched) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
        """Tokens (and requested logprobs) per seq_id of a launched step, waiting for its greedy tokens; each
        request samples from its own generator. Sequences that ended since the launch are skipped.

        A step with non-greedy or logprobs requests is sampled before the next one is launched: its logits
        are read here, and the next step cannot feed a token that is sampled only here.

        With workers, the step is confirmed after it: sampling waits for the logits, so for the whole step, and a
        rank lost meanwhile (NCCL runs asynchronously: an aborted collective may have left rank 0 running on)
        voids the step and raises TensorParallelError, also when it is why sampling failed."""
        if self.workers is None:
            return self._sample(step)
        try:
            result = self._sample(step)
        except Exception:
            self.workers.check()
            raise
        self.workers.check()
        return result

    def _sample(self, step: Launched) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
        if step.ready is not None:
            step.ready.synchronize()
        greedy = step.host_tokens.tolist()
        logits = step.logits
        tokens, logprobs = {}, {}
        for row, seq in enumerate(step.seqs):
            if seq.is_finished:
                continue
            params = seq.sampling_params
            if params.greedy:
                token = greedy[row]
            else:
                if seq.seq_id not in self.generators:
                    self.generators[seq.seq_id] = make_generator(params, self.device)
                token = sample(logits[row], params, self.generators[seq.seq_id])
            tokens[seq.seq_id] = token
            if params.logprobs is not None:
                logprobs[seq.seq_id] = token_logprobs(logits[row], token, params.logprobs)
        return tokens, logprobs

    def release(self, seq_id: int):
        """Forget a finished sequence's generator (its page-table row goes back through the next PageChanges)."""
        self.generators.pop(seq_id, None)

    def gather_kv(self, seq, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of a sequence's first tokens, from its pages
        (with tensor parallelism, every KV head from the rank that holds it)."""
        pos = np.arange(num_tokens)
        slots = np.asarray(seq.page_table, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size
        if self.workers is None:
            return self.kv_at(slots)
        kv = self.workers.together(("kv", slots), lambda: self.kv_at(slots))
        if self.device.type == "cuda":   # confirmed once complete, as a step is in `sample`
            torch.cuda.synchronize(self.device)
        self.workers.check()
        return kv

    def kv_at(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, len(slots), kv_heads, head_dim] at the cache slots (all ranks' heads under tp)."""
        idx = torch.from_numpy(slots).to(self.device)
        kvh, d = self.num_kv_heads, self.cfg.head_dim
        k = torch.stack([kc.view(-1, kvh, d)[idx] for kc, _ in self.kv_caches])
        v = torch.stack([vc.view(-1, kvh, d)[idx] for _, vc in self.kv_caches])
        if self.tp is not None:
            k, v = self.tp.gather_kv_heads(k), self.tp.gather_kv_heads(v)
        return k, v

    def close(self) -> None:
        """Frees the KV cache, the CUDA graphs and the weights; the runner runs nothing after this."""
        self.kv_caches, self.graphs, self.model = [], {}, None
