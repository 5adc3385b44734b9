"""Triton kernels for a paged KV cache, each beside a PyTorch reference of itself.

KV cache layout, per layer: `k_cache`, `v_cache` of shape [num_pages, page_size, num_kv_heads, head_dim]
(slot = page_id * page_size + offset). A token's heads and head_dim are contiguous, so one KV head of one
position is a contiguous run of head_dim elements: the attention kernels read it coalesced.
"""
# Importing chunkwise (the parent package, first) chose Triton's interpreter on a machine without CUDA.
from chunkwise.kernels.tiling import INTERPRET
from chunkwise.kernels.interpreter import speed_up

if INTERPRET:
    speed_up()

from chunkwise.kernels.cascade import (CascadeGroups, cascade_decode, cascade_decode_ref, cascade_groups,  # noqa: E402
                                       cascade_item_size)
from chunkwise.kernels.paged_attention import (paged_attention, paged_attention_ref, paged_decode,  # noqa: E402
                                               paged_decode_ref)
from chunkwise.kernels.split_kv import merge_splits_ref, split_kv_decode, split_kv_decode_ref  # noqa: E402
from chunkwise.kernels.fused_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from chunkwise.kernels.rope_store import rope_cos_sin, rope_store, rope_store_ref  # noqa: E402
from chunkwise.kernels.relocate import relocate_kv, relocate_kv_ref  # noqa: E402
from chunkwise.kernels.activation import act_and_mul, act_and_mul_ref  # noqa: E402
from chunkwise.kernels.matmul import matmul, matmul_ref  # noqa: E402

__all__ = [
    "paged_attention", "paged_attention_ref", "paged_decode", "paged_decode_ref",
    "split_kv_decode", "split_kv_decode_ref", "merge_splits_ref",
    "CascadeGroups", "cascade_groups", "cascade_item_size", "cascade_decode", "cascade_decode_ref",
    "rms_norm", "rms_norm_ref", "add_rms_norm", "add_rms_norm_ref",
    "rope_cos_sin", "rope_store", "rope_store_ref",
    "relocate_kv", "relocate_kv_ref",
    "act_and_mul", "act_and_mul_ref",
    "matmul", "matmul_ref",
]
