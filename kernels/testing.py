"""Random paged caches for the kernel tests and benchmarks.

Each sequence's K/V is made contiguous first ([seq_len, num_kv_heads, head_dim]) and then placed into random,
non-contiguous pages of a pool that also holds unused pages; so one logical sequence can be laid out under
any page size or permutation and the attention results compared.
"""
from dataclasses import dataclass

import torch

# The dtypes the interpreter tests run, and their tolerances against the float32 references: fp32 differs only
# by exp2-vs-exp rounding; fp16 rounds P to fp16 before the PV product and the output to fp16 (2^-11 relative
# each).
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@dataclass
class PagedKV:
    k_cache: torch.Tensor       # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_pages_per_seq]
    seq_lens: torch.Tensor      # int32 [num_seqs]


def random_kv(seq_len, num_kv_heads, head_dim, dtype, generator, device="cpu"):
    """(k, v), each [seq_len, num_kv_heads, head_dim] of standard normals (never zeros)."""
    shape = (seq_len, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k.to(device), v.to(device)


def paginate(kv_seqs, page_size, generator, spare_pages=3, extra_table_cols=1, poison=float("nan")):
    """Place sequences [(k, v), ...] into randomly permuted pages of a fresh pool.

    Unused pages, the slots past each sequence's end and the unused block-table columns are filled so that
    reading them would show: the cache with `poison` (NaN by default), the table with random page ids.
    """
    k0 = kv_seqs[0][0]
    device, dtype, (num_kv_heads, head_dim) = k0.device, k0.dtype, k0.shape[1:]
    pages_per_seq = [-(-k.shape[0] // page_size) for k, _ in kv_seqs]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    width = max(pages_per_seq) + extra_table_cols
    table = torch.randint(0, num_pages, (len(kv_seqs), width), generator=generator, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), poison, dtype=dtype)
    v_cache = torch.full_like(k_cache, poison)
    for s, ((k, v), n) in enumerate(zip(kv_seqs, pages_per_seq)):
        pages = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        table[s, :n] = pages
        pos = torch.arange(k.shape[0])
        k_cache[pages[pos // page_size].long(), pos % page_size] = k.cpu()
        v_cache[pages[pos // page_size].long(), pos % page_size] = v.cpu()
    seq_lens = torch.tensor([k.shape[0] for k, _ in kv_seqs], dtype=torch.int32)
    return PagedKV(k_cache.to(device), v_cache.to(device), table.to(device), seq_lens.to(device))


def query_start_loc(q_lens, device="cpu"):
    """int32 [len(q_lens) + 1]: cumulative query counts starting at 0."""
    return torch.tensor([0] + q_lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
