"""paged_attention against its PyTorch reference, and the bitwise invariance of attention rows.

Runs on CPU through Triton's interpreter (float32, float16 and bfloat16) and on a GPU alike; sizes stay small because
the interpreter is slow. Production sizes live in test_kernels_gpu.py.
"""
import importlib
import itertools

import pytest
import torch
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chunkwise.kernels import paged_attention, paged_attention_ref, paged_decode, paged_decode_ref
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.testing import DTYPES, TOLERANCE, paginate, query_start_loc, random_kv, rising_scores

pytestmark = pytest.mark.correctness
# The properties worth most examples get twice the profile's count (ci: 8, thorough: 600).
MORE = settings(max_examples=2 * settings.default.max_examples)   # the @examples and pinned cases carry the edges

# (num_heads, num_kv_heads): MHA, GQA (incl. Qwen2.5-0.5B's 14/2), MQA (incl. an odd group of 5).
HEADS = [(4, 4), (8, 2), (14, 2), (4, 1), (5, 1), (6, 3)]
HEAD_DIMS = [64, 64, 80, 96, 128, 256]


# Split the context every 128 positions (two 64-key tiles in float32, one 128-key tile in 16-bit) or not at all.
SPLITS = [None, 128]


def _run_batch(fn, cache, qs, q_lens, seq_lens, scale, window, **split):
    q = torch.cat(qs)
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    qsl = query_start_loc(q_lens, q.device)
    return fn(q, cache.k_cache, cache.v_cache, cache.page_tables, seq_lens, qsl, scale,
              sliding_window=window, out=out, **split)


@given(heads=st.sampled_from(HEADS), head_dim=st.sampled_from(HEAD_DIMS), page_size=st.integers(1, 64),
       seqs=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 40)), min_size=1, max_size=3),
       window=st.none() | st.integers(1, 80), dtype=st.sampled_from(DTYPES), rising=st.booleans(),
       split=st.sampled_from(SPLITS), seed=st.integers(0, 2**16))
@example(heads=(4, 1), head_dim=64, page_size=1, seqs=[(5, 3)], window=None, dtype=torch.float32, rising=False,
         split=None, seed=1)
@example(heads=(8, 2), head_dim=80, page_size=16, seqs=[(37, 1), (0, 1)], window=None, dtype=torch.float32,
         rising=False, split=None, seed=2)
@example(heads=(14, 2), head_dim=64, page_size=16, seqs=[(20, 12)], window=None, dtype=torch.float16, rising=False,
         split=None, seed=3)
@example(heads=(4, 4), head_dim=96, page_size=16, seqs=[(16, 5)], window=7, dtype=torch.float32, rising=False,
         split=None, seed=4)
@example(heads=(5, 1), head_dim=64, page_size=7, seqs=[(0, 33), (7, 7)], window=8, dtype=torch.float16, rising=False,
         split=128, seed=5)
@example(heads=(8, 2), head_dim=64, page_size=16, seqs=[(150, 50), (0, 1)], window=None, dtype=torch.float32,
         rising=True, split=128, seed=6)
@example(heads=(4, 1), head_dim=80, page_size=5, seqs=[(230, 20)], window=None, dtype=torch.bfloat16, rising=True,
         split=128, seed=7)
@MORE
def test_paged_attention_matches_reference(heads, head_dim, page_size, seqs, window, dtype, rising, split, seed,
                                           device):
    """seqs: (cached prefix, new chunk) per sequence; the cases pinned above: page size 1, one-token chunks,
    a chunk ending on a page boundary, a prefix equal to the page size, a zero prefix with a window, and scores
    rising along the sequence over four fp32 and two bf16 KV tiles (every tile raises the running max), the
    last three with the context split across programs (split: every 128 positions; None: one pass)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    kvs = [random_kv(p + c, num_kv_heads, head_dim, dtype, gen, device) for p, c in seqs]
    qs = [torch.randn(c, num_heads, head_dim, generator=gen).to(dtype).to(device) for _, c in seqs]
    if rising:
        qs, ks = zip(*(rising_scores(q, k) for q, (k, _) in zip(qs, kvs)))
        kvs = [(k, v) for k, (_, v) in zip(ks, kvs)]
    cache = paginate(kvs, page_size, gen)
    args = (cache, list(qs), [c for _, c in seqs], [p + c for p, c in seqs], head_dim ** -0.5, window)

    out = _run_batch(paged_attention, *args, split_size=split)
    ref = _run_batch(paged_attention_ref, *args)

    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


@given(heads=st.sampled_from(HEADS), head_dim=st.sampled_from(HEAD_DIMS), page_size=st.integers(1, 64),
       lens=st.lists(st.integers(1, 150), min_size=1, max_size=4), window=st.none() | st.integers(1, 80),
       dtype=st.sampled_from(DTYPES), max_rows=st.sampled_from([64, 128, 256]), sum_by_dot=st.booleans(),
       seed=st.integers(0, 2**16))
@example(heads=(14, 2), head_dim=64, page_size=16, lens=[130, 1, 17], window=None, dtype=torch.bfloat16, max_rows=64,
         sum_by_dot=False, seed=1)
# A draw whose 128-row prefill tiles and 16-row decode tiles summed a row otherwise on the CPU, when the
# interpreter's dot split its products by the tile's height.
@example(heads=(4, 4), head_dim=80, page_size=34, lens=[116, 13, 32, 40], window=None, dtype=torch.bfloat16,
         max_rows=128, sum_by_dot=True, seed=15)
def test_paged_decode_gives_paged_attentions_bits_for_one_query_per_sequence(heads, head_dim, page_size, lens, window,
                                                                            dtype, max_rows, sum_by_dot, seed, device):
    """paged_decode takes program s as sequence s instead of searching query_start_loc: the same rows, the same
    bits (with row sums by dot, from its own 16-row tiles against paged_attention's of max_rows), and its reference
    agrees."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    cache = paginate([random_kv(n, num_kv_heads, head_dim, dtype, gen, device) for n in lens], page_size, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens)
    scale = head_dim ** -0.5
    out = paged_decode(*args, scale, sliding_window=window, out=torch.full_like(q, float("nan")), max_rows=max_rows,
                       sum_by_dot=sum_by_dot)
    single = paged_attention(*args, query_start_loc([1] * len(lens), device), scale, sliding_window=window,
                             max_rows=max_rows, sum_by_dot=sum_by_dot)
    assert torch.equal(out, single)
    torch.testing.assert_close(out, paged_decode_ref(*args, scale, sliding_window=window), **TOLERANCE[dtype])


def test_paged_decode_refuses_other_than_one_query_per_sequence():
    q, cache, _ = _small_case()
    for fn in (paged_decode, paged_decode_ref):
        with pytest.raises(ValueError, match="one query per sequence: q has 3 rows for 1 sequences"):
            fn(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.125)


def test_paged_decode_loads_unpipelined_from_exactly_two_programs_an_sm(monkeypatch):
    """On Hopper's shared memory and 132 SMs, 8 KV heads: 33 sequences (264 programs) are busy and take one stage,
    32 (256) keep three; off CUDA no batch is busy."""
    pa = importlib.import_module("chunkwise.kernels.paged_attention")   # the package re-exports the function
    assert pa.busy_decode_seqs(8, torch.device("cpu")) == float("inf")
    monkeypatch.setattr(pa, "sm_count", lambda device: 132)
    monkeypatch.setattr(pa, "shared_memory", lambda device: 227 * 1024)
    stages = {}

    def launch(q, k_cache, v_cache, page_tables, seq_lens, qsl, scale, window, out, layout, *split):
        stages[q.shape[0]] = layout[4]   # (block_m, block_q, block_n, num_warps, num_stages, blocks)
        return q
    monkeypatch.setattr(pa, "_launch", launch)
    gen = torch.Generator().manual_seed(0)
    for n in (32, 33):
        cache = paginate([random_kv(3, 8, 128, torch.bfloat16, gen) for _ in range(n)], 16, gen)
        q = torch.zeros(n, 16, 128, dtype=torch.bfloat16)
        pa.paged_decode(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.1)
    assert stages == {32: 3, 33: 1}


def test_row_sums_by_dot_give_decodes_16_row_tiles_over_the_prefills_key_tiles(monkeypatch):
    """paged_decode with sum_by_dot launches decode_tile_config's tiles (busy or not, whatever max_rows): the group's
    rows padded to 16, over the key tiles that tile_config gives the prefill (a row folds the same tiles, in the same
    order, so its bits can match), on three stages on Hopper and two elsewhere."""
    pa = importlib.import_module("chunkwise.kernels.paged_attention")
    for head_dim, group, dtype, smem in itertools.product((64, 128, 256), (1, 2, 4, 7, 16),
                                                          (torch.bfloat16, torch.float16, torch.float32),
                                                          (0, 164 * 1024, 227 * 1024)):
        rows, block_n, warps, stages = pa.decode_tile_config(head_dim, group, dtype, smem)
        assert (rows, warps) == (max(16, triton.next_power_of_2(group)), 4)
        assert block_n == pa.tile_config(head_dim, group, dtype, smem)[1]
        assert stages == (3 if smem >= pa.HOPPER_SHARED_MEMORY else 2)
    # three stages from exactly Hopper's threshold, two one byte below it
    assert [pa.decode_tile_config(128, 2, torch.bfloat16, smem)[3]
            for smem in (pa.HOPPER_SHARED_MEMORY, pa.HOPPER_SHARED_MEMORY - 1)] == [3, 2]
    monkeypatch.setattr(pa, "sm_count", lambda device: 132)
    monkeypatch.setattr(pa, "shared_memory", lambda device: 227 * 1024)
    layouts = {}

    def launch(q, k_cache, v_cache, page_tables, seq_lens, qsl, scale, window, out, layout, *rest):
        layouts[q.shape[0]] = layout   # (block_m, block_q, block_n, num_warps, num_stages, blocks)
        return q
    monkeypatch.setattr(pa, "_launch", launch)
    gen = torch.Generator().manual_seed(0)
    for n in (2, 33):   # not busy, and busy (test above)
        cache = paginate([random_kv(3, 8, 128, torch.bfloat16, gen) for _ in range(n)], 16, gen)
        q = torch.zeros(n, 16, 128, dtype=torch.bfloat16)
        pa.paged_decode(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 0.1, max_rows=256,
                        sum_by_dot=True)
    assert layouts == {2: (16, 8, 128, 4, 3, 2), 33: (16, 8, 128, 4, 3, 33)}


def _chunk_ends(data, length):
    cuts = data.draw(st.lists(st.integers(1, max(1, length - 1)), max_size=3, unique=True), label="cuts")
    return sorted({c for c in cuts if c < length} | {length})


def check_rows_invariant(heads, head_dim, dtype, window, length, ends, page_a, page_b, mates, seed, device,
                         split=None):
    """A sequence's attention rows computed in one chunk under page size page_a equal, bitwise, the rows computed
    chunk by chunk (chunks ending at `ends`) under page_b between batch-mates (cached prefix, new tokens); both
    passes one-pass (split None) or both with the context split every `split` positions."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv(length, num_kv_heads, head_dim, dtype, gen, device)
    q = torch.randn(length, num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5

    whole = _run_batch(paged_attention, paginate([kv], page_a, gen), [q], [length], [length], scale, window,
                       split_size=split)

    # Batch B: the sequence sits between batch-mates, under another page size and another random permutation.
    mate_kvs = [random_kv(p + c, num_kv_heads, head_dim, dtype, gen, device) for p, c in mates]
    mate_qs = [torch.randn(c, num_heads, head_dim, generator=gen).to(dtype).to(device) for _, c in mates]
    cache_b = paginate(mate_kvs[:1] + [kv] + mate_kvs[1:], page_b, gen)
    pieces, start = [], 0
    for end in ends:
        qs = mate_qs[:1] + [q[start:end]] + mate_qs[1:]
        q_lens = [c for _, c in mates[:1]] + [end - start] + [c for _, c in mates[1:]]
        seq_lens = [p + c for p, c in mates[:1]] + [end] + [p + c for p, c in mates[1:]]
        out = _run_batch(paged_attention, cache_b, qs, q_lens, seq_lens, scale, window, split_size=split)
        first = q_lens[0] if mates else 0
        pieces.append(out[first:first + end - start])
        start = end

    chunked = torch.cat(pieces)
    differs = (chunked != whole).flatten(1).any(1).nonzero().flatten().tolist()
    assert not differs, (f"rows {differs[:8]} differ from the one-chunk pass, by up to "
                         f"{(chunked.float() - whole.float()).abs().max().item():.3g}")


@given(data=st.data())
@MORE
def test_attention_rows_are_bitwise_invariant_to_chunking_page_size_permutation_and_batch(data, device):
    heads = data.draw(st.sampled_from(HEADS), label="heads")
    head_dim = data.draw(st.sampled_from([64, 80]), label="head_dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.none() | st.integers(1, 70), label="window")
    length = data.draw(st.integers(1, 150), label="length")
    ends = _chunk_ends(data, length)
    page_a, page_b = data.draw(st.integers(1, 64), label="page_a"), data.draw(st.integers(1, 64), label="page_b")
    mates = data.draw(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=2), label="mates")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    split = data.draw(st.sampled_from(SPLITS), label="split")
    check_rows_invariant(heads, head_dim, dtype, window, length, ends, page_a, page_b, mates, seed, device, split)


# Issue 8's shrunk failure: under the interpreter `tl.dot` was the host BLAS's matmul, and OpenBLAS's Haswell
# kernel rounded row 1 of the one-chunk pass differently from row 0 of the second chunk's pass. Then bf16
# across several KV tiles, a window, page sizes that do not divide the tile, and batch-mates on both sides.
PINNED_ROW_CASES = [
    dict(heads=(4, 4), head_dim=64, dtype=torch.float32, window=None, length=7, ends=[1, 7], page_a=1, page_b=1,
         mates=[], seed=0),
    dict(heads=(8, 2), head_dim=80, dtype=torch.bfloat16, window=45, length=150, ends=[1, 64, 65, 150], page_a=7,
         page_b=16, mates=[(10, 3), (50, 1)], seed=3),
    # Split every 128: rows whose block straddles the split boundary, chunks ending on and across it, and a
    # batch-mate whose context ends inside the second split.
    dict(heads=(8, 2), head_dim=64, dtype=torch.float32, window=None, length=150, ends=[100, 128, 129, 150],
         page_a=16, page_b=5, mates=[(140, 2)], seed=4, split=128),
]


@pytest.mark.parametrize("case", PINNED_ROW_CASES)
def test_attention_rows_are_bitwise_invariant_in_pinned_cases(case, device):
    check_rows_invariant(**case, device=device)


def _small_case():
    gen = torch.Generator().manual_seed(0)
    cache = paginate([random_kv(10, 2, 64, torch.float32, gen)], 4, gen)
    q = torch.randn(3, 4, 64, generator=gen)
    return q, cache, query_start_loc([3])


@pytest.mark.parametrize("change, match", [
    (dict(sliding_window=0), "sliding_window must be None or an int >= 1, got 0"),
    (dict(q=torch.randn(3, 3, 64)), "num_heads 3"),
    (dict(q=torch.randn(3, 4, 32)), "q \\(3, 4, 32\\)"),
    (dict(page_tables=torch.zeros(1, 4, dtype=torch.int64)), "page_tables must be int32"),
    (dict(seq_lens=torch.tensor([10], dtype=torch.int64)), "seq_lens must be int32"),
    (dict(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32)), "query_start_loc must be int32 \\[2\\]"),
    (dict(max_rows=32), "max_rows must be 64, 128 or 256, got 32"),
    (dict(split_size=100), "split_size must be a positive multiple of 64 \\(the key tile\\), got 100"),
    (dict(workspace=object()), "workspace is the split scratch: pass split_size with it"),
    (dict(split_size=128, workspace=object()), "workspace must be a SplitWorkspace"),
])
def test_paged_attention_rejects_bad_arguments_naming_them(change, match):
    q, cache, qsl = _small_case()
    args = dict(q=q, k_cache=cache.k_cache, v_cache=cache.v_cache, page_tables=cache.page_tables,
                seq_lens=cache.seq_lens, query_start_loc=qsl, scale=0.125)
    args.update(change)
    # max_rows and the split are the kernel's tiling, which its reference has none of
    kernel_only = {"max_rows", "split_size", "workspace"} & change.keys()
    for fn in (paged_attention,) if kernel_only else (paged_attention, paged_attention_ref):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(**args)


def test_tiles_take_256_rows_only_where_shared_memory_holds_them_and_capped_ones_three_stages_on_hopper():
    pa = importlib.import_module("chunkwise.kernels.paged_attention")   # the package re-exports the function of that name
    assert pa.shared_memory(torch.device("cpu")) == 0
    assert pa.tile_config(128, 2, torch.bfloat16, 0)[0] == 128
    assert pa.tile_config(128, 2, torch.bfloat16, 164 * 1024)[0] == 128   # A100: 256 rows not measured there
    assert pa.tile_config(128, 2, torch.bfloat16, 227 * 1024)[0] == 256   # Hopper
    assert pa.tile_config(128, 2, torch.bfloat16, 227 * 1024, max_rows=128)[0] == 128
    # one warpgroup of the same 128-key tiles on any device; a third stage only where Hopper's shared memory holds it
    assert [pa.tile_config(128, group, torch.bfloat16, smem, max_rows=64)
            for group in (2, 4, 8) for smem in (0, 164 * 1024, 227 * 1024)] == [
        (64, 128, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3)] * 3
    assert pa.tile_config(128, 2, torch.float16, 227 * 1024, max_rows=64) == (64, 128, 4, 3)
    # busy decode batches load unpipelined, two blocks an SM, where the third stage would be taken
    assert [pa.tile_config(128, 2, torch.bfloat16, smem, max_rows=64, busy=True)
            for smem in (0, 164 * 1024, 227 * 1024)] == [(64, 128, 4, 2), (64, 128, 4, 2), (64, 128, 4, 1)]
    assert pa.tile_config(128, 2, torch.bfloat16, 227 * 1024, busy=True) == (256, 128, 8, 2)
    # a GQA group needs its rows, and 128 of them keep two stages (three would not fit)
    assert [pa.tile_config(128, 128, torch.bfloat16, smem, max_rows=64)
            for smem in (0, 227 * 1024)] == [(128, 128, 4, 2)] * 2
    # capped 128-row tiles (a blend's rows, split prefills) pipeline a third stage on Hopper only; 256 rows keep two
    assert [pa.tile_config(128, 2, torch.bfloat16, smem, max_rows=128)
            for smem in (0, 164 * 1024, pa.HOPPER_SHARED_MEMORY - 1, pa.HOPPER_SHARED_MEMORY, 227 * 1024)] == \
        [(128, 128, 8, 2)] * 3 + [(128, 128, 8, 3)] * 2
    assert pa.tile_config(128, 2, torch.bfloat16, 227 * 1024)[3] == 2
    assert pa.tile_config(128, 2, torch.float32, 227 * 1024)[0] == 64


def test_a_split_launch_leaves_its_arrival_counts_at_zero_so_the_next_launch_on_its_workspace_merges():
    """A step's layers share one split workspace: each launch must leave its arrival counts at zero (the last
    split of each block and KV head resets its count), or the next launch's merges never run."""
    gen = torch.Generator().manual_seed(3)
    (num_heads, num_kv_heads), head_dim, dtype, split = (4, 2), 64, torch.float32, 128
    seqs = [(130, 20), (60, 5)]                     # (cached prefix, new rows): three splits and one
    kvs = [random_kv(p + c, num_kv_heads, head_dim, dtype, gen, "cpu") for p, c in seqs]
    qs = [torch.randn(c, num_heads, head_dim, generator=gen).to(dtype) for _, c in seqs]
    cache = paginate(kvs, 16, gen)
    args = (cache, qs, [c for _, c in seqs], [p + c for p, c in seqs], head_dim ** -0.5, None)
    workspace = paged_split_workspace(sum(c for _, c in seqs), num_heads, dtype, cache.k_cache, cache.page_tables,
                                      split)
    ref = _run_batch(paged_attention_ref, *args)
    for launch in range(2):
        out = _run_batch(paged_attention, *args, split_size=split, workspace=workspace)
        assert workspace.arrivals.eq(0).all(), f"launch {launch} left counts {workspace.arrivals.tolist()}"
        torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
