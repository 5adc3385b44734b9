"""vLLM's FlashAttention-3 over the paged cache: the default mode's prefill attention where it is installed on
Hopper and asked for (`EngineConfig.attention_backend="fa3"`). Its PyTorch twin is `paged_attention_ref`.

Why another library's kernel: over the same paged cache and page tables, FA3's plain causal prefill runs at
cuDNN's speed, faster than `paged_attention` (docs/BENCHMARKS.md). What it does and Triton 3.6 cannot express
on Hopper is the register split between producer and consumer warpgroups. The engine's own kernel stays the
default, and the only one in deterministic mode, whose decodes must give the prefill's bits.

Layouts (those of `paged_attention`; FA3 reads vLLM's cache layout, which is ours):
    q, out:            [rows, num_heads, head_dim], each sequence's rows its last positions
    k_cache, v_cache:  [num_pages, page_size, num_kv_heads, head_dim]
    page_tables:       int32 [num_seqs, max_pages_per_seq];  seq_lens: int32 [num_seqs];  query_start_loc: int32
                       [num_seqs + 1]. Rows past query_start_loc[-1] (a CUDA graph's padding) are not written.
Without `split` (num_splits=1) each row sweeps its keys in one pass, so its bits do not depend on how its prompt
was chunked or on its batch-mates (tests/test_fa3_gpu.py). With it FA3 splits the keys across programs as it
chooses, as `paged_attention`'s split_size does for a short chunk, which fills few programs otherwise; a row's bits
then depend on its step. The length bounds FA3 takes on the host come from shapes, not contents: no read back,
and a captured CUDA graph replays them for any step it holds.
"""
import functools

import torch

from chunkwise.kernels.tiling import capability

MAX_HEAD_DIM = 256   # FA3's forward: head_dim a multiple of 8 up to this


@functools.cache
def library():
    """(vLLM's flash_attn_varlen_func, None), or (None, why it is missing). Imported on first use only: importing
    vLLM takes seconds, which an engine that never asks for FA3 should not pay."""
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import (FA3_AVAILABLE, FA3_UNAVAILABLE_REASON,
                                                               flash_attn_varlen_func)
    except ImportError as e:
        return None, f"vllm.vllm_flash_attn does not import ({e})"
    return (flash_attn_varlen_func, None) if FA3_AVAILABLE else (None, FA3_UNAVAILABLE_REASON)


def fa3_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA3 cannot run this model here, or None when it can."""
    why = library()[1]
    if why is not None:
        return f"vLLM's FlashAttention-3 library is not available: {why}"
    if device.type != "cuda":
        return f"it runs on CUDA devices only, got {device}"
    major, minor = capability(device)
    if major != 9:
        return f"it runs on Hopper GPUs (compute capability 9.x) only; {device} is {major}.{minor}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it computes in float16 or bfloat16, got {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}"
    return None


def fa3_paged_attention(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale, sliding_window=None,
                        out=None, split=False):
    """Causal attention of every query row over its sequence's pages (`paged_attention`'s contract); returns out.
    sliding_window w: a row sees its last w positions, itself included (FA3's left window w - 1). split: FA3's
    own choice of key splits (num_splits=0) rather than one pass."""
    out = torch.empty_like(q) if out is None else out
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    library()[0](q, k_cache, v_cache, q.shape[0], query_start_loc, page_tables.shape[1] * k_cache.shape[1],
                 seqused_k=seq_lens, softmax_scale=scale, causal=True, window_size=window, block_table=page_tables,
                 out=out, num_splits=0 if split else 1, fa_version=3)
    return out
