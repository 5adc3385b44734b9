"""Random paged caches for the kernel tests and benchmarks.

Each sequence's K/V is made contiguous first ([seq_len, num_kv_heads, head_dim]) and then placed into random,
non-contiguous pages of a pool that also holds unused pages; so one logical sequence can be laid out under
any page size or permutation and the attention results compared.
"""
from dataclasses import dataclass

import torch

# The dtypes the interpreter tests run, and their tolerances against the float32 references: fp32 differs only
# by exp2-vs-exp rounding; fp16 and bf16 round P before the PV product and the output (2^-11 and 2^-8 relative
# each; P's rounding moves the output by at most that fraction of max |v|, about 4 for these inputs).
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@dataclass
class PagedKV:
    k_cache: torch.Tensor       # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    page_tables: torch.Tensor  # int32 [num_seqs, max_pages_per_seq]
    seq_lens: torch.Tensor      # int32 [num_seqs]


def random_kv(seq_len, num_kv_heads, head_dim, dtype, generator, device="cpu"):
    """(k, v), each [seq_len, num_kv_heads, head_dim] of standard normals (never zeros)."""
    shape = (seq_len, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k.to(device), v.to(device)


def rising_scores(q, k, rise=0.05):
    """(q, k) with every query's score against key position p raised by about rise * p * 4 / sqrt(head_dim):
    each later KV tile holds larger scores, so the online softmax must rescale what it has accumulated.

    q [n, num_heads, head_dim], k [seq_len, num_kv_heads, head_dim]: both gain a multiple of one unit direction.
    """
    head_dim = k.shape[-1]
    u = torch.ones(head_dim, device=k.device) / head_dim ** 0.5
    pos = torch.arange(k.shape[0], device=k.device, dtype=torch.float32)
    return ((q.float() + 4 * u).to(q.dtype),
            (k.float() + rise * pos[:, None, None] * u).to(k.dtype))


def paginate(kv_seqs, page_size, generator, spare_pages=3, extra_table_cols=1, poison=float("nan")):
    """Place sequences [(k, v), ...] into randomly permuted pages of a fresh pool.

    Everything a sequence must not read is made to show if read: the spare pages and the slots past each
    sequence's end hold `poison` (NaN by default), and the unused page-table columns point at spare pages.
    """
    if spare_pages < 1:
        raise ValueError(f"spare_pages must be >= 1 (unused table columns point at them), got {spare_pages}")
    k0 = kv_seqs[0][0]
    device, dtype, (num_kv_heads, head_dim) = k0.device, k0.dtype, k0.shape[1:]
    pages_per_seq = [-(-k.shape[0] // page_size) for k, _ in kv_seqs]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    width = max(pages_per_seq) + extra_table_cols
    spare = torch.tensor(order[sum(pages_per_seq):], dtype=torch.int32)
    table = spare[torch.randint(0, spare_pages, (len(kv_seqs), width), generator=generator)]
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


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64, after checking out holds no NaN (an unwritten, NaN-poisoned row)."""
    assert not out.isnan().any(), "unwritten or NaN output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
