"""Runs one scheduled batch: owns the paged KV cache, builds the step's tensors, the forward, sampling.

KV cache per layer: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim] in the model's dtype;
slot = page_id * page_size + offset. Decode-only batches replay CUDA graphs captured per batch-size bucket
(rows past the real batch are padding: slot -1, so nothing is stored, and their logits are dropped).
"""
from __future__ import annotations

import math

import psutil
import torch

from chunkwise.config import ModelConfig
from chunkwise.engine_config import EngineConfig
from chunkwise.sampling import make_generator, sample, token_logprobs
from kernels.split_kv import DEFAULT_SPLIT_SIZE, split_tile_config
from optimized.model import Model, StepInputs

# The Triton interpreter runs a split-KV decode (split + merge programs) slower than a one-pass decode
# for short contexts; on CPU only long sequences take it by default. On GPU every decode does, which is
# also what the decode CUDA graphs capture.
CPU_SPLIT_KV_THRESHOLD = 256
CPU_KV_CACHE_CAP = 512 << 20   # bytes of KV cache a CPU engine takes by default


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * elem


def activation_reserve(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                       dtype: torch.dtype) -> int:
    """A generous bound on one step's activations, kept free beside the KV cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (4 * cfg.intermediate_size + 6 * cfg.hidden_size + 3 * qkv) * elem + 64
    return max_num_batched_tokens * per_token + 3 * max_num_seqs * cfg.vocab_size * 4 + (256 << 20)


class ModelRunner:
    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor]):
        cfg = config.model_config
        self.config, self.cfg = config, cfg
        self.dtype, self.device, self.page_size = config.dtype, config.device, config.page_size
        threshold = config.split_kv_threshold
        self.split_kv_threshold = threshold if threshold is not None else (
            0 if self.device.type == "cuda" else CPU_SPLIT_KV_THRESHOLD)
        self.split_size = DEFAULT_SPLIT_SIZE if config.split_size is None else config.split_size
        block_n = split_tile_config(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)[1]
        if self.split_size % block_n:
            raise ValueError(f"split_size must be a multiple of {block_n} (the split-KV tile for head_dim "
                             f"{cfg.head_dim}), got {self.split_size}")
        self.model = Model(cfg, weights, split_size=self.split_size, deterministic=config.deterministic)
        self.max_pages_per_seq = config.max_pages_per_seq
        self.num_pages = self._pool_size()
        shape = (self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]
        self.generators: dict[int, torch.Generator | None] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda" and not config.enforce_eager and self.split_kv_threshold == 0:
            self._capture_graphs(config.max_num_seqs)

    def _pool_size(self) -> int:
        """Pages the pool gets: as asked (if memory holds them) or what the memory budget allows."""
        config = self.config
        per_page = page_bytes(self.cfg, self.page_size, self.dtype)
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
    def _slots(self, seq, start: int, end: int) -> list[int]:
        ps, table = self.page_size, seq.block_table
        return [table[p // ps] * ps + p % ps for p in range(start, end)]

    def _table(self, seqs) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)

    def prepare(self, batch) -> tuple[StepInputs, list]:
        """Step tensors for a ScheduledBatch: paged_attention's rows first, then split-KV decodes.

        A decode goes through split-KV when its sequence holds more than split_kv_threshold tokens: a rule
        on the sequence alone, so a token's path (and its bits) never depends on what else is batched.
        Returns the sequences that sample this step (the batch's `samples`), in logits-row order.
        """
        prefill, decode = [], []
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            start = seq.num_computed_tokens
            split = n == 1 and start >= seq.num_prompt_tokens and start + 1 > self.split_kv_threshold
            (decode if split else prefill).append((seq, n, samples))
        ids, pos, slots, qsl, lens, logits_idx, sampled = [], [], [], [0], [], [], []
        for seq, n, samples in prefill + decode:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += self._slots(seq, start, start + n)
            lens.append(start + n)
            if samples:
                logits_idx.append(len(ids) - 1)
                sampled.append(seq)
        for _, n, _ in prefill:
            qsl.append(qsl[-1] + n)
        p = len(prefill)
        host = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self._table([s for s, _, _ in prefill]), seq_lens=torch.tensor(lens[:p], dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            decode_block_tables=self._table([s for s, _, _ in decode]),
            decode_seq_lens=torch.tensor(lens[p:], dtype=torch.int32),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64))
        return host, sampled

    def _to_device(self, host: StepInputs) -> StepInputs:
        pin = self.device.type == "cuda"
        return StepInputs(**{k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True)
                             for k, v in vars(host).items()})

    # ---- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch) -> tuple[list, torch.Tensor]:
        """Forward of one step; returns the sequences that sample now and their logits [N, vocab] float32."""
        host, sampled = self.prepare(batch)
        bs = host.decode_seq_lens.shape[0]
        if host.num_prefill_tokens == 0 and self.graphs and bs <= max(self.graphs):
            return sampled, self._replay(host, bs)
        return sampled, self.model.forward(self._to_device(host), self.kv_caches)

    def _capture_graphs(self, max_num_seqs: int):
        """One graph per decode batch-size bucket over shared static inputs (largest first, one pool)."""
        n = max_num_seqs
        dev, i32, i64 = self.device, torch.int32, torch.int64
        self.static = StepInputs(
            input_ids=torch.zeros(n, dtype=i64, device=dev), positions=torch.zeros(n, dtype=i64, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=i64, device=dev),
            block_tables=torch.zeros(0, self.max_pages_per_seq, dtype=i32, device=dev),
            seq_lens=torch.zeros(0, dtype=i32, device=dev), query_start_loc=torch.zeros(1, dtype=i32, device=dev),
            decode_block_tables=torch.zeros(n, self.max_pages_per_seq, dtype=i32, device=dev),
            decode_seq_lens=torch.ones(n, dtype=i32, device=dev),
            logits_indices=torch.arange(n, dtype=i64, device=dev))
        self.graph_logits: dict[int, torch.Tensor] = {}
        buckets = sorted({b for b in [1, 2, 4, 8, *range(16, n + 1, 16), n] if b <= n}, reverse=True)
        pool = None
        with torch.inference_mode():
            for bs in buckets:
                inp = self._static_view(bs)
                self.model.forward(inp, self.kv_caches)  # warm-up: compiles the kernels outside capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.graph_logits[bs] = self.model.forward(inp, self.kv_caches)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(dev)

    def _static_view(self, bs: int) -> StepInputs:
        s = self.static
        return StepInputs(s.input_ids[:bs], s.positions[:bs], s.slot_mapping[:bs], s.block_tables, s.seq_lens,
                          s.query_start_loc, s.decode_block_tables[:bs], s.decode_seq_lens[:bs],
                          s.logits_indices[:bs])

    def _replay(self, host: StepInputs, n: int) -> torch.Tensor:
        bs = min(b for b in self.graphs if b >= n)
        s = self.static
        s.slot_mapping.fill_(-1)
        s.decode_seq_lens.fill_(1)
        s.input_ids[:n].copy_(host.input_ids, non_blocking=True)
        s.positions[:n].copy_(host.positions, non_blocking=True)
        s.slot_mapping[:n].copy_(host.slot_mapping, non_blocking=True)
        s.decode_seq_lens[:n].copy_(host.decode_seq_lens, non_blocking=True)
        width = host.decode_block_tables.shape[1]
        s.decode_block_tables[:n, :width].copy_(host.decode_block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.graph_logits[bs][:n]

    # ---- sampling ----------------------------------------------------------------------------------
    def sample(self, seqs, logits: torch.Tensor) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
        """Tokens (and requested logprobs) per seq_id; each request samples from its own generator."""
        greedy = torch.argmax(logits, dim=-1).tolist() if logits.shape[0] else []
        tokens, logprobs = {}, {}
        for row, seq in enumerate(seqs):
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
        self.generators.pop(seq_id, None)

    def gather_kv(self, seq, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of a sequence's first tokens, from its pages."""
        slots = torch.tensor(self._slots(seq, 0, num_tokens), dtype=torch.int64, device=self.device)
        kvh, d = self.cfg.num_kv_heads, self.cfg.head_dim
        k = torch.stack([kc.view(-1, kvh, d)[slots] for kc, _ in self.kv_caches])
        v = torch.stack([vc.view(-1, kvh, d)[slots] for _, vc in self.kv_caches])
        return k, v
