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
from chunkwise.sampling import make_generator, sample, token_logprobs
from optimized.model import Model, StepInputs

# The Triton interpreter runs a split-KV decode (split + merge programs) slower than a one-pass decode
# for short contexts; on CPU only long sequences take it by default. On GPU every decode does, which is
# also what the decode CUDA graphs capture.
CPU_SPLIT_KV_THRESHOLD = 256


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
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device, page_size: int, max_model_len: int, num_pages: int | None,
                 gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                 enforce_eager: bool, split_kv_threshold: int | None = None):
        self.cfg, self.dtype, self.device, self.page_size = cfg, dtype, device, page_size
        if split_kv_threshold is None:
            split_kv_threshold = 0 if device.type == "cuda" else CPU_SPLIT_KV_THRESHOLD
        if not isinstance(split_kv_threshold, int) or split_kv_threshold < 0:
            raise ValueError(f"split_kv_threshold must be an integer >= 0, got {split_kv_threshold!r}")
        self.split_kv_threshold = split_kv_threshold
        self.model = Model(cfg, weights)
        self.max_pages_per_seq = math.ceil(max_model_len / page_size)
        self.num_pages = self._pool_size(num_pages, gpu_memory_utilization, max_num_batched_tokens,
                                         max_num_seqs)
        shape = (self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
        self.generators: dict[int, torch.Generator | None] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if device.type == "cuda" and not enforce_eager and split_kv_threshold == 0:
            self._capture_graphs(max_num_seqs)

    def _pool_size(self, num_pages: int | None, utilization: float, max_tokens: int, max_seqs: int) -> int:
        """Pages the pool gets: as asked (if memory holds them) or what the memory budget allows."""
        per_page = page_bytes(self.cfg, self.page_size, self.dtype)
        if self.device.type == "cuda":
            if not 0.0 < utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(free, total * utilization - (total - free))
            budget -= activation_reserve(self.cfg, max_tokens, max_seqs, self.dtype)
            default = int(budget // per_page)
        else:
            budget = psutil.virtual_memory().available
            # the CPU default: room for every running sequence at full length, within a quarter of RAM
            default = min(max_seqs * self.max_pages_per_seq, int(budget // 4 // per_page))
        if num_pages is None:
            num_pages = default
        elif not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an integer >= 1, got {num_pages!r}")
        elif num_pages * per_page > budget:
            raise ValueError(f"num_pages={num_pages} needs {num_pages * per_page / 2**30:.2f} GiB of KV cache; "
                             f"only {max(budget, 0) / 2**30:.2f} GiB are available")
        if num_pages < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB)")
        return num_pages

    # ---- step inputs -------------------------------------------------------------------------------
    def _slots(self, seq, start: int, end: int) -> list[int]:
        ps, table = self.page_size, seq.block_table
        return [table[p // ps] * ps + p % ps for p in range(start, end)]

    def _table(self, seqs) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)

    def prepare(self, seqs, num_new_tokens) -> tuple[StepInputs, list]:
        """Step tensors for (seq, n) pairs: paged_attention's rows first, then split-KV decodes.

        A decode goes through split-KV when its sequence holds more than split_kv_threshold tokens: a rule
        on the sequence alone, so a token's path (and its bits) never depends on what else is batched.
        Returns the sequences that sample this step too.
        """
        prefill, decode = [], []
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            split = n == 1 and start >= seq.num_prompt_tokens and start + 1 > self.split_kv_threshold
            (decode if split else prefill).append((seq, n))
        ids, pos, slots, qsl, lens, logits_idx, sampled = [], [], [], [0], [], [], []
        for seq, n in prefill + decode:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += self._slots(seq, start, start + n)
            lens.append(start + n)
            if start + n == seq.num_tokens:
                logits_idx.append(len(ids) - 1)
                sampled.append(seq)
        for _, n in prefill:
            qsl.append(qsl[-1] + n)
        p = len(prefill)
        host = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=self._table([s for s, _ in prefill]), seq_lens=torch.tensor(lens[:p], dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            decode_block_tables=self._table([s for s, _ in decode]),
            decode_seq_lens=torch.tensor(lens[p:], dtype=torch.int32),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64))
        return host, sampled

    def _to_device(self, host: StepInputs) -> StepInputs:
        pin = self.device.type == "cuda"
        return StepInputs(**{k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True)
                             for k, v in vars(host).items()})

    # ---- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs, num_new_tokens) -> tuple[list, torch.Tensor]:
        """Forward of one step; returns the sequences that sample now and their logits [N, vocab] float32."""
        host, sampled = self.prepare(seqs, num_new_tokens)
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
