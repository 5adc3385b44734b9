"""The paged KV cache of one device (one rank's under tensor parallelism): how many pages it gets, its tensors,
and reading a sequence's K/V back out of its pages.

Per layer k_cache, v_cache [num_pages, page_size, kv_heads, head_dim] in the model's dtype; slot = page_id *
page_size + offset. Under tensor parallelism a rank's cache holds its KV heads, and every rank agrees on the pool
size (the smallest any rank can hold), so the pages and page tables are the same on every rank.
"""
from __future__ import annotations

import numpy as np
import psutil
import torch

from chunkwise.engine_config import EngineConfig
from chunkwise.model_config import ModelConfig
from chunkwise.engine.distributed.tensor_parallel import TensorParallel

CPU_KV_CACHE_CAP = 512 << 20   # bytes of KV cache a CPU engine takes by default


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """Bytes one page takes over all layers, K and V (of `kv_heads` heads: a tensor-parallel rank's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * (kv_heads or cfg.num_kv_heads) * cfg.head_dim * elem


def activation_reserve(cfg: ModelConfig, max_rows: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """A generous bound on the activations of one step of up to `max_rows` rows, kept free beside the KV cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (4 * cfg.intermediate_size + 6 * cfg.hidden_size + 3 * qkv) * elem + 64
    return max_rows * per_token + 3 * max_num_seqs * cfg.vocab_size * 4 + (256 << 20)


def pool_size(config: EngineConfig, kv_heads: int, device: torch.device) -> int:
    """Pages the pool gets on `device`: as asked (if memory holds them) or what the memory budget allows."""
    cfg, page_size = config.model_config, config.page_size
    per_page = page_bytes(cfg, page_size, config.dtype, kv_heads)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(free, total * config.gpu_memory_utilization - (total - free))
        # A step of blended prefills holds up to max_blended_rows rows at layer 0, where this config can blend.
        rows = config.max_blended_rows if config.blend_refusal() is None else config.max_num_batched_tokens
        budget -= activation_reserve(cfg, rows, config.max_num_seqs, config.dtype)
        default = int(budget // per_page)
    else:
        budget = psutil.virtual_memory().available
        # Room for every running sequence at full length, capped: the pool is zeroed, so it is all
        # resident, and a CPU engine serves a few short requests.
        cap = min(CPU_KV_CACHE_CAP, budget // 4)
        default = min(config.max_num_seqs * config.max_pages_per_seq, int(cap // per_page))
    num_pages = default if config.num_pages is None else config.num_pages
    if num_pages * per_page > budget:
        raise ValueError(f"num_pages={num_pages} of page_size={page_size} needs "
                         f"{num_pages * per_page / 2**30:.2f} GiB of KV cache; only "
                         f"{max(budget, 0) / 2**30:.2f} GiB are available")
    if num_pages < 1:
        raise ValueError(f"page_size={page_size}: one page of KV cache takes {per_page / 2**30:.2f} GiB, "
                         f"more than the {max(budget, 0) / 2**30:.2f} GiB available for the cache")
    return num_pages


class LayerCaches(list):
    """Each layer's (k_cache, v_cache) [pages, page_size, kv_heads, head_dim], views of `k` and `v` [layers, pages,
    page_size, kv_heads, head_dim], so that a kernel can reach every layer in one launch (`relocate_kv`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__(zip(k, v))
        self.k, self.v = k, v


class KVCache:
    """The pool's pages on the device, `layers[i]` = (k_cache, v_cache) of layer i, zeroed."""

    def __init__(self, config: EngineConfig, kv_heads: int, device: torch.device, tp: TensorParallel | None = None):
        cfg = config.model_config
        self.page_size, self.kv_heads, self.head_dim, self.device, self.tp = (
            config.page_size, kv_heads, cfg.head_dim, device, tp)
        num_pages = pool_size(config, kv_heads, device)
        self.num_pages = num_pages if tp is None else tp.min(num_pages)
        shape = (cfg.num_layers, self.num_pages, self.page_size, kv_heads, cfg.head_dim)
        self.layers = LayerCaches(torch.zeros(shape, dtype=config.dtype, device=device),
                                  torch.zeros(shape, dtype=config.dtype, device=device))

    def slots(self, page_table: list[int], num_tokens: int) -> np.ndarray:
        """int64 [num_tokens]: the cache slots of a sequence's first tokens, from its page table."""
        pos = np.arange(num_tokens)
        return np.asarray(page_table, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def at(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, len(slots), kv_heads, head_dim] at the cache slots (every rank's heads under tensor
        parallelism: a collective, which every rank calls with the same slots)."""
        idx = torch.from_numpy(slots).to(self.device)
        kvh, d = self.kv_heads, self.head_dim
        k = torch.stack([kc.view(-1, kvh, d)[idx] for kc, _ in self.layers])
        v = torch.stack([vc.view(-1, kvh, d)[idx] for _, vc in self.layers])
        if self.tp is not None:
            k, v = self.tp.gather_kv_heads(k), self.tp.gather_kv_heads(v)
        return k, v

    def close(self) -> None:
        """Frees the cache's tensors."""
        self.layers = LayerCaches(torch.zeros(0), torch.zeros(0))
