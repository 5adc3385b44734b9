"""Split-KV decode and its merge: against the references, against the single-pass kernel, and invariance."""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import merge_splits, merge_splits_ref, paged_attention, split_kv_decode, split_kv_decode_ref
from kernels.testing import DTYPES, TOLERANCE, paginate, query_start_loc, random_kv, rising_scores

pytestmark = pytest.mark.correctness
# The properties worth most examples get three times the profile's count (ci: 30, thorough: 900).
MORE = settings(max_examples=3 * settings.default.max_examples)

HEADS = [(4, 4), (8, 2), (14, 2), (4, 1), (5, 1)]


def _decode(fn, cache, q, scale, window, **kw):
    return fn(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale, sliding_window=window,
              out=torch.full_like(q, float("nan")), **kw)


def _table_cols_past_the_end(seq_lens, page_size, split_size):
    """Unused block-table columns that fill the table to a whole number of splits (at least one column) when
    page_size divides split_size: a split that reads past its end then reads poisoned pages inside the table,
    and an assertion fails, rather than reading memory past the table."""
    pages = max(-(-n // page_size) for n in seq_lens)
    per_split = split_size // page_size if split_size % page_size == 0 else 1
    return per_split - pages % per_split


@given(heads=st.sampled_from(HEADS), head_dim=st.sampled_from([64, 80, 96, 256]), page_size=st.integers(1, 64),
       seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=3), split_size=st.sampled_from([64, 128]),
       window=st.none() | st.integers(1, 200), dtype=st.sampled_from(DTYPES), rising=st.booleans(),
       seed=st.integers(0, 2**16))
@example(heads=(8, 2), head_dim=64, page_size=16, seq_lens=[64, 1, 65], split_size=64, window=None,
         dtype=torch.float32, rising=False, seed=0)
@example(heads=(4, 1), head_dim=80, page_size=1, seq_lens=[200], split_size=64, window=10, dtype=torch.float16,
         rising=False, seed=1)
@example(heads=(4, 1), head_dim=256, page_size=64, seq_lens=[150, 33], split_size=64, window=None,
         dtype=torch.float32, rising=False, seed=2)
@example(heads=(14, 2), head_dim=64, page_size=32, seq_lens=[129, 300], split_size=128, window=70,
         dtype=torch.float16, rising=False, seed=3)
@example(heads=(8, 2), head_dim=64, page_size=16, seq_lens=[300, 150], split_size=128, window=None,
         dtype=torch.float32, rising=True, seed=4)
@example(heads=(4, 1), head_dim=80, page_size=8, seq_lens=[192, 70], split_size=64, window=None,
         dtype=torch.bfloat16, rising=True, seed=5)
@MORE
def test_split_kv_decode_matches_reference_and_single_pass(
        heads, head_dim, page_size, seq_lens, split_size, window, dtype, rising, seed, device):
    """Pinned: a split ending exactly at the sequence end, a one-token sequence, a window that leaves
    the first splits empty, both per-tile page lookups (a page spanning two 32-key tiles; two pages
    per 64-key tile), and scores rising along the sequence (every tile raises the running max, later splits
    outweigh earlier ones); page sizes that are not powers of two take the per-position lookup."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    kvs = [random_kv(n, num_kv_heads, head_dim, dtype, gen, device) for n in seq_lens]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    if rising:
        qs, ks = zip(*(rising_scores(q[s:s + 1], k) for s, (k, _) in enumerate(kvs)))
        q, kvs = torch.cat(qs), [(k, v) for k, (_, v) in zip(ks, kvs)]
    cache = paginate(kvs, page_size, gen, extra_table_cols=_table_cols_past_the_end(seq_lens, page_size, split_size))
    scale = head_dim ** -0.5

    out = _decode(split_kv_decode, cache, q, scale, window, split_size=split_size)
    ref = _decode(split_kv_decode_ref, cache, q, scale, window, split_size=split_size)
    single = paged_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens,
                             query_start_loc([1] * len(seq_lens), device), scale, sliding_window=window)

    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(out, single, **TOLERANCE[dtype])


@given(data=st.data())
@MORE
def test_split_kv_decode_is_bitwise_invariant_to_page_size_permutation_table_width_and_batch(data, device):
    num_heads, num_kv_heads = data.draw(st.sampled_from(HEADS), label="heads")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.none() | st.integers(1, 150), label="window")
    length = data.draw(st.integers(1, 200), label="length")
    page_a, page_b = data.draw(st.integers(1, 64), label="page_a"), data.draw(st.integers(1, 64), label="page_b")
    mates = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=2), label="mates")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    kv = random_kv(length, num_kv_heads, 64, dtype, gen, device)
    q = torch.randn(1, num_heads, 64, generator=gen).to(dtype).to(device)

    alone = _decode(split_kv_decode, paginate([kv], page_a, gen), q, 0.125, window, split_size=64)
    mate_kvs = [random_kv(n, num_kv_heads, 64, dtype, gen, device) for n in mates]
    batch = paginate(mate_kvs[:1] + [kv] + mate_kvs[1:], page_b, gen, extra_table_cols=5)
    qs = torch.randn(len(mates) + 1, num_heads, 64, generator=gen).to(dtype).to(device)
    qs[1] = q[0]
    together = _decode(split_kv_decode, batch, qs, 0.125, window, split_size=64)

    assert torch.equal(together[1:2], alone)


def _partials(num_seqs, num_heads, num_splits, head_dim, gen, empty_frac=0.4):
    partial_out = torch.randn(num_seqs, num_heads, num_splits, head_dim, generator=gen)
    partial_lse = torch.randn(num_seqs, num_heads, num_splits, generator=gen) * 5
    empty = torch.rand(num_seqs, num_heads, num_splits, generator=gen) < empty_frac
    partial_lse[empty] = -math.inf
    partial_out[empty] = 0.0
    partial_lse[0, 0] = -math.inf  # one row with every split empty
    partial_out[0, 0] = 0.0
    return partial_out, partial_lse


@given(num_splits=st.integers(1, 9), head_dim=st.sampled_from([64, 80]), out_dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_merge_splits_weighs_empty_splits_zero_without_nan(num_splits, head_dim, out_dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    partial_out, partial_lse = (t.to(device) for t in _partials(3, 4, num_splits, head_dim, gen))
    out = merge_splits(partial_out, partial_lse, torch.full((3, 4, head_dim), float("nan"), dtype=out_dtype,
                                                            device=device))
    ref = merge_splits_ref(partial_out, partial_lse, torch.empty_like(out))

    assert not out.isnan().any()
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    torch.testing.assert_close(out, ref, **TOLERANCE[out_dtype])
    # Empty splits inserted anywhere leave the result bitwise unchanged.
    order = [num_splits, *range(num_splits), num_splits + 1]
    empty_out = partial_out.new_zeros(3, 4, 2, head_dim)
    empty_lse = partial_lse.new_full((3, 4, 2), -math.inf)
    padded_out = torch.cat([partial_out, empty_out], dim=2)[:, :, order]
    padded_lse = torch.cat([partial_lse, empty_lse], dim=2)[:, :, order]
    assert torch.equal(merge_splits(padded_out.contiguous(), padded_lse.contiguous(), torch.empty_like(out)), out)


@pytest.mark.parametrize("shift", [500.0, -500.0])
def test_merge_splits_result_is_unchanged_by_shifting_every_lse(shift, device):
    """The merge weighs split j by exp(lse_j - max lse): shifting every LSE by +-500, where exp(lse) alone
    overflows or underflows, changes no bit. LSEs on a 2^-10 grid (|lse| < 20 here) stay exact when shifted, so
    the differences the merge exponentiates are the same numbers."""
    gen = torch.Generator().manual_seed(0)
    partial_out, partial_lse = _partials(3, 4, 6, 64, gen)
    partial_lse = torch.round(partial_lse * 1024) / 1024  # -inf (an empty split) stays -inf
    partial_out, partial_lse = partial_out.to(device), partial_lse.to(device)

    def merged(lse):
        return merge_splits(partial_out, lse, torch.full((3, 4, 64), float("nan"), device=device))

    base, shifted = merged(partial_lse), merged(partial_lse + shift)

    torch.testing.assert_close(base, merge_splits_ref(partial_out, partial_lse, torch.empty_like(base)),
                               **TOLERANCE[torch.float32])
    assert not shifted.isnan().any(), f"shift {shift}: the merged output holds NaN"
    assert torch.equal(shifted, base), f"shift {shift}: max change {(shifted - base).abs().max().item():.3g}"


def test_split_kv_decode_rejects_split_size_off_the_tile_grid():
    gen = torch.Generator().manual_seed(0)
    cache = paginate([random_kv(10, 1, 64, torch.float32, gen)], 4, gen)
    q = torch.randn(1, 2, 64)
    for fn in (split_kv_decode, split_kv_decode_ref):
        with pytest.raises(ValueError, match="split_size must be a positive multiple of 64, got 100"):
            fn(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125, split_size=100)
    for fn in (split_kv_decode, split_kv_decode_ref):
        with pytest.raises(ValueError, match="q has 2 rows but seq_lens has 1"):
            fn(torch.randn(2, 2, 64), cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    many = 65536  # one past the launch grid's limit on sequences
    with pytest.raises(ValueError, match="at most 65535 sequences per call, got 65536"):
        split_kv_decode(torch.randn(many, 1, 64), cache.k_cache, cache.v_cache,
                        torch.zeros(many, 1, dtype=torch.int32), torch.ones(many, dtype=torch.int32), 0.125)
