"""Split-KV decode and its in-kernel merge: against the references, against the single-pass kernel, invariance."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chunkwise.kernels import paged_attention, split_kv_decode, split_kv_decode_ref
from chunkwise.kernels.split_kv import num_splits_for, split_workspace
from chunkwise.kernels.testing import DTYPES, TOLERANCE, paginate, query_start_loc, random_kv, rising_scores

pytestmark = pytest.mark.correctness
# The properties worth most examples get twice the profile's count (ci: 8, thorough: 600).
MORE = settings(max_examples=2 * settings.default.max_examples)   # the @examples and pinned cases carry the edges

HEADS = [(4, 4), (8, 2), (14, 2), (4, 1), (5, 1)]


def _decode(fn, cache, q, scale, window, **kw):
    return fn(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, scale, sliding_window=window,
              out=torch.full_like(q, float("nan")), **kw)


def _table_cols_past_the_end(seq_lens, page_size, split_size):
    """Unused page-table columns that fill the table to a whole number of splits (at least one column) when
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
    single = paged_attention(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens,
                             query_start_loc([1] * len(seq_lens), device), scale, sliding_window=window)

    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(out, single, **TOLERANCE[dtype])


@given(data=st.data())
@MORE
def test_split_kv_decode_is_bitwise_invariant_to_page_size_permutation_grid_and_batch(data, device):
    """A sequence's bits alone and in a batch, under other page sizes and a wider page table: wider tables
    launch more (empty) split programs, and batch-mates that run longer or shorter finish their merges
    before or after it."""
    num_heads, num_kv_heads = data.draw(st.sampled_from(HEADS), label="heads")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.none() | st.integers(1, 150), label="window")
    length = data.draw(st.integers(1, 200), label="length")
    page_a, page_b = data.draw(st.integers(1, 64), label="page_a"), data.draw(st.integers(1, 64), label="page_b")
    mates = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=2), label="mates")
    extra_splits = data.draw(st.integers(0, 3), label="extra_splits")  # table columns past the longest sequence
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    kv = random_kv(length, num_kv_heads, 64, dtype, gen, device)
    q = torch.randn(1, num_heads, 64, generator=gen).to(dtype).to(device)

    alone = _decode(split_kv_decode, paginate([kv], page_a, gen), q, 0.125, window, split_size=64)
    mate_kvs = [random_kv(n, num_kv_heads, 64, dtype, gen, device) for n in mates]
    batch = paginate(mate_kvs[:1] + [kv] + mate_kvs[1:], page_b, gen,
                     extra_table_cols=1 + extra_splits * -(-64 // page_b))
    qs = torch.randn(len(mates) + 1, num_heads, 64, generator=gen).to(dtype).to(device)
    qs[1] = q[0]
    together = _decode(split_kv_decode, batch, qs, 0.125, window, split_size=64)

    assert torch.equal(together[1:2], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_decode_weighs_splits_by_their_lse_minus_the_max_at_scores_in_the_hundreds(dtype, device):
    """Scores of a few hundred (exp of them overflows float32): each split's weight is exp(lse_j - max lse),
    so the merge stays finite and matches the float32 reference. Three splits of 64, a window across two."""
    gen = torch.Generator().manual_seed(7)
    kvs = [random_kv(n, 2, 64, dtype, gen, device) for n in (170, 129)]
    q = (60 * torch.randn(2, 8, 64, generator=gen)).to(dtype).to(device)  # scores ~ N(0, 60^2)
    cache = paginate(kvs, 16, gen)
    for window in (None, 100):
        out = _decode(split_kv_decode, cache, q, 0.125, window, split_size=64)
        ref = _decode(split_kv_decode_ref, cache, q, 0.125, window, split_size=64)
        assert not out.isnan().any(), f"window {window}: NaN in the output"
        torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_split_kv_decode_gives_a_sequence_without_keys_zeros_and_leaves_its_mates_bitwise_alone(device):
    """seq_len 0: no key is visible, every split weighs 0, and the row is 0 (not NaN); the other rows are
    what they are without it."""
    gen = torch.Generator().manual_seed(8)
    kvs = [random_kv(n, 2, 64, torch.float32, gen, device) for n in (70, 5)]
    q = torch.randn(3, 8, 64, generator=gen).to(device)
    cache = paginate(kvs + [random_kv(1, 2, 64, torch.float32, gen, device)], 16, gen)
    cache.seq_lens[2] = 0
    out = _decode(split_kv_decode, cache, q, 0.125, None, split_size=64)
    mates = _decode(split_kv_decode, paginate(kvs, 16, gen), q[:2], 0.125, None, split_size=64)

    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(out[:2], mates)


def test_one_workspace_serves_launch_after_launch_with_the_bits_of_fresh_scratch(device):
    """An engine step shares one workspace between its layers: each launch leaves the arrival counters zero,
    so the next (other queries, cache, window) gives the bits a fresh workspace gives."""
    gen = torch.Generator().manual_seed(9)
    lens = (150, 1, 64, 200)
    workspace = split_workspace(4, 8, 2, 64, num_splits_for(-(-200 // 16) + 1, 16, 64), device)
    for layer, window in enumerate((None, 70, None)):
        cache = paginate([random_kv(n, 2, 64, torch.float32, gen, device) for n in lens], 16, gen)
        q = torch.randn(4, 8, 64, generator=gen).to(device)
        shared = _decode(split_kv_decode, cache, q, 0.125, window, split_size=64, workspace=workspace)
        fresh = _decode(split_kv_decode, cache, q, 0.125, window, split_size=64)
        assert torch.equal(shared, fresh), f"launch {layer}"
        assert torch.equal(workspace.arrivals, torch.zeros_like(workspace.arrivals)), f"launch {layer}"


def test_split_kv_decode_rejects_split_size_off_the_tile_grid():
    gen = torch.Generator().manual_seed(0)
    cache = paginate([random_kv(10, 1, 64, torch.float32, gen)], 4, gen)
    q = torch.randn(1, 2, 64)
    for fn in (split_kv_decode, split_kv_decode_ref):
        with pytest.raises(ValueError, match="split_size must be a positive multiple of 64, got 100"):
            fn(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.125, split_size=100)
    for fn in (split_kv_decode, split_kv_decode_ref):
        with pytest.raises(ValueError, match="q has 2 rows but seq_lens has 1"):
            fn(torch.randn(2, 2, 64), cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.125)
    args = (q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.125)
    with pytest.raises(ValueError, match=r"workspace.partial_out must be contiguous torch.float32 \(1, 2, 1, 64\)"):
        split_kv_decode(*args, workspace=split_workspace(1, 2, 1, 64, 2, "cpu"))
    with pytest.raises(TypeError, match="workspace must be a SplitWorkspace"):
        split_kv_decode(*args, workspace=(torch.empty(1, 2, 1, 64), torch.empty(1, 2, 1), torch.zeros(1, 1)))
    many = 65536  # one past the launch grid's limit on sequences
    with pytest.raises(ValueError, match="at most 65535 sequences per call, got 65536"):
        split_kv_decode(torch.randn(many, 1, 64), cache.k_cache, cache.v_cache,
                        torch.zeros(many, 1, dtype=torch.int32), torch.ones(many, dtype=torch.int32), 0.125)
