"""The kernels at production sizes on a GPU, in bf16, fp16 and fp32: against the references and invariance.

Error measure (docs/ARCHITECTURE.md, Test tiers): ||out - ref|| / ||ref|| against the float32 reference on the
same inputs.
Bounds and why: fp32 uses IEEE dots, so only exp2-vs-exp and summation order differ (~1e-6; bound 1e-5);
fp16 rounds P and the output to 11 bits (~5e-4 per element; bound 2e-3); bf16 to 8 bits (~4e-3 per
element, ~2-3e-3 in norm; bound 1e-2).
"""
import dataclasses

import pytest
import torch

from chunkwise.kernels import (cascade_decode, cascade_groups, cascade_item_size, paged_attention, paged_attention_ref,
                               paged_decode, relocate_kv, relocate_kv_ref, split_kv_decode, split_kv_decode_ref)
from chunkwise.kernels.paged_attention import paged_split_workspace
from chunkwise.kernels.testing import paginate, query_start_loc, random_kv, rel_err
from chunkwise.model_config import RopeConfig
from chunkwise.reference.model import rotate

pytestmark = [pytest.mark.gpu, pytest.mark.correctness]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
REL_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _attend(fn, cache, q, q_lens, seq_lens, scale, window=None, positions=None, **split):
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    return fn(q, cache.k_cache, cache.v_cache, cache.page_tables, seq_lens, query_start_loc(q_lens, q.device),
              scale, sliding_window=window, out=torch.full_like(q, float("nan")), positions=positions, **split)


def _mixed_batch(num_heads, num_kv_heads, head_dim, dtype, seqs, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    kvs = [random_kv(p + c, num_kv_heads, head_dim, dtype, gen, "cuda") for p, c in seqs]
    cache = paginate(kvs, page_size, gen)
    q = torch.randn(sum(c for _, c in seqs), num_heads, head_dim, generator=gen).to(dtype).cuda()
    return cache, q, [c for _, c in seqs], [p + c for p, c in seqs]


# (cached prefix, new tokens): a 2048-token chunk after 4096 cached, a 1024 chunk after 1024, a fresh
# 777-token prompt, and 40 decodes at contexts up to 4000.
MIXED = [(4096, 2048), (1024, 1024), (0, 777)] + [(100 * i + 37, 1) for i in range(40)]


@pytest.mark.parametrize("split", [None, 512])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_matches_reference_32q_8kv_d128(dtype, split):
    cache, q, q_lens, seq_lens = _mixed_batch(32, 8, 128, dtype, MIXED, 16, seed=0)
    out = _attend(paged_attention, cache, q, q_lens, seq_lens, 128 ** -0.5, split_size=split)
    ref = _attend(paged_attention_ref, cache, q.float(), q_lens, seq_lens, 128 ** -0.5)
    assert rel_err(out, ref) < REL_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 512])
def test_mixed_batch_matches_reference_4q_1kv_d256(dtype, window):
    seqs = [(3000, 1500), (0, 600)] + [(97 * i + 5, 1) for i in range(20)]
    cache, q, q_lens, seq_lens = _mixed_batch(4, 1, 256, dtype, seqs, 16, seed=1)
    out = _attend(paged_attention, cache, q, q_lens, seq_lens, 256 ** -0.5, window)
    ref = _attend(paged_attention_ref, cache, q.float(), q_lens, seq_lens, 256 ** -0.5, window)
    assert rel_err(out, ref) < REL_BOUND[dtype]


@pytest.mark.parametrize("split", [None, 512])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_is_bitwise_equal_to_one_pass_across_page_sizes_and_batches(dtype, split):
    """Single pass (split None) or the context split every 512 positions, in both the whole and the chunked runs."""
    gen = torch.Generator().manual_seed(2)
    length = 6144
    kv = random_kv(length, 8, 128, dtype, gen, "cuda")
    q = torch.randn(length, 32, 128, generator=gen).to(dtype).cuda()
    whole = _attend(paged_attention, paginate([kv], 16, gen), q, [length], [length], 128 ** -0.5, split_size=split)
    mates = [random_kv(n, 8, 128, dtype, gen, "cuda") for n in (3000, 5)]
    for page_size in (1, 7, 32):
        cache = paginate([mates[0], kv, mates[1]], page_size, gen)
        start, pieces = 0, []
        for end in (4096, 4097, 5000, 6144):
            q_b = torch.cat([q[:3], q[start:end], q[:1]])  # batch-mates decode around the chunk
            out = _attend(paged_attention, cache, q_b, [3, end - start, 1], [3000, end, 5], 128 ** -0.5,
                          split_size=split)
            pieces.append(out[3:3 + end - start])
            start = end
        assert torch.equal(torch.cat(pieces), whole), f"page_size {page_size}"


@pytest.mark.parametrize("heads, kv_heads, sliding", [(16, 8, None), (32, 8, None), (8, 1, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_tile_for_decodes_and_prefill_chunks(dtype, heads, kv_heads, sliding):
    """64-, 128- and 256-row tiles give a row the same bits, and so does `paged_decode` (one loop; 64 rows,
    unpipelined in busy batches, three stages otherwise on Hopper). With row sums by dot (deterministic mode's
    prefill and decodes) paged_decode's 16-row tiles give them too, though their dots lower to mma.sync on Hopper
    and the taller tiles' to wgmma (with tl.sum's row sums, 16- and 32-row tiles failed this)."""
    for seqs in (MIXED, [(100 * i + 37, 1) for i in range(200)], [(6000 + 7 * i, 1) for i in range(8)]):
        cache, q, q_lens, seq_lens = _mixed_batch(heads, kv_heads, 128, dtype, seqs, 16, seed=len(seqs))
        for by_dot in (False, True):
            rows = [_attend(paged_attention, cache, q, q_lens, seq_lens, 128 ** -0.5, window=sliding, max_rows=m,
                            sum_by_dot=by_dot) for m in (64, 128, 256)]
            assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2]), f"{len(seqs)} sequences"
            if all(n == 1 for n in q_lens):   # busy at 8 KV heads and 200 sequences, not at 1 or 8 sequences
                decode = paged_decode(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens,
                                      128 ** -0.5, sliding_window=sliding, max_rows=64, sum_by_dot=by_dot)
                assert torch.equal(decode, rows[0]), f"{len(seqs)} sequences, by dot: {by_dot}"


def test_split_context_prefill_reuses_its_workspace_and_is_race_free():
    """One workspace through 30 launches (chunks of 512 and 64 rows and decodes after 1k-16k tokens, the splits'
    arrivals reused): every launch gives the first one's bits, and the arrivals are left zero."""
    seqs = [(16384 - 512, 512), (1000, 64)] + [(331 * i + 7, 1) for i in range(30)]
    cache, q, q_lens, seq_lens = _mixed_batch(16, 8, 128, torch.bfloat16, seqs, 16, seed=5)
    ws = paged_split_workspace(q.shape[0], 16, q.dtype, cache.k_cache, cache.page_tables, 512)
    first = _attend(paged_attention, cache, q, q_lens, seq_lens, 128 ** -0.5, split_size=512, workspace=ws)
    for _ in range(29):
        again = _attend(paged_attention, cache, q, q_lens, seq_lens, 128 ** -0.5, split_size=512, workspace=ws)
        assert torch.equal(again, first)
    assert not ws.arrivals.any()
    ref = _attend(paged_attention_ref, cache, q.float(), q_lens, seq_lens, 128 ** -0.5)
    assert rel_err(first, ref) < REL_BOUND[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_matches_reference_and_single_pass_at_long_context(dtype):
    gen = torch.Generator().manual_seed(3)
    lens = [16384, 9000, 513, 1]
    cache = paginate([random_kv(n, 8, 128, dtype, gen, "cuda") for n in lens], 16, gen)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(dtype).cuda()
    args = (cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, 128 ** -0.5)
    out = split_kv_decode(q, *args, out=torch.full_like(q, float("nan")))
    ref = split_kv_decode_ref(q.float(), *args)
    single = paged_attention(q, *args[:4], query_start_loc([1] * len(lens), "cuda"), args[4])
    assert rel_err(out, ref) < REL_BOUND[dtype]
    assert rel_err(out, single.float()) < REL_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_is_bitwise_invariant_at_long_context(dtype):
    gen = torch.Generator().manual_seed(4)
    kv = random_kv(20000, 8, 128, dtype, gen, "cuda")
    q = torch.randn(1, 32, 128, generator=gen).to(dtype).cuda()
    alone = paginate([kv], 16, gen)
    alone_out = split_kv_decode(q, alone.k_cache, alone.v_cache, alone.page_tables, alone.seq_lens, 0.1)
    mates = [random_kv(n, 8, 128, dtype, gen, "cuda") for n in (7000, 3)]
    batch = paginate([mates[0], kv, mates[1]], 7, gen, extra_table_cols=300)
    q_b = torch.randn(3, 32, 128, generator=gen).to(dtype).cuda()
    q_b[1] = q[0]
    out = split_kv_decode(q_b, batch.k_cache, batch.v_cache, batch.page_tables, batch.seq_lens, 0.1)
    assert torch.equal(out[1:2], alone_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1000])
def test_split_kv_merge_is_race_free_and_cascade_is_bitwise_split_kv_at_production_size(dtype, window):
    """48 decodes, 40 of them on one cached 4096-token prefix (8 shared splits), own suffixes of 1..1200
    tokens, in a table 8192 tokens wide: every run of split-KV gives the same bits (the last-arriving program
    merges, whatever the arrival order), and cascade gives split-KV's bits."""
    gen = torch.Generator().manual_seed(6)
    suffix = torch.randint(1, 1201, (48,), generator=gen).tolist()
    prefix = random_kv(4096, 8, 128, dtype, gen, "cuda")
    pool = paginate([prefix] + [random_kv(n, 8, 128, dtype, gen, "cuda") for n in suffix + [992] * 8], 16, gen)
    table = torch.zeros(48, 512, dtype=torch.int32, device="cuda")
    lens = []
    for s, n in enumerate(suffix):
        own = pool.page_tables[1 + s, :-(-n // 16)]
        if s < 40:   # the prefix's pages, then the sequence's own (its suffix starts on a page boundary)
            table[s, :256 + len(own)] = torch.cat([pool.page_tables[0, :256], own])
            lens.append(4096 + n)
        else:        # no partner: a sequence of its own, 992 tokens (62 pages) before its suffix
            mine = torch.cat([pool.page_tables[9 + s, :62], own])
            table[s, :len(mine)] = mine
            lens.append(992 + n)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(48, 32, 128, generator=gen).to(dtype).cuda()
    args = (q, pool.k_cache, pool.v_cache, table, seq_lens)
    runs = [split_kv_decode(*args, 128 ** -0.5, sliding_window=window, out=torch.full_like(q, float("nan")))
            for _ in range(10)]
    # Items of the default size (16 members of four heads: a 64-row tile, which Hopper computes with wgmma),
    # of split-KV's 16 rows, of 28 rows in a 32-row tile, and of 128 rows; one program per item, and persistent
    # programs looping over several items each (a graph's fixed grid).
    cascades = []
    for item_size in (cascade_item_size(128, 4), 4, 7, 32):
        groups = cascade_groups(table.cpu(), seq_lens.cpu(), 16, 512, item_size=item_size).to("cuda")
        assert groups.num_shared == 8 and groups.programs == 8 * -(-40 // item_size)
        cascades += [cascade_decode(*args, dataclasses.replace(groups, programs=p), 128 ** -0.5,
                                    sliding_window=window, out=torch.full_like(q, float("nan")))
                     for p in (groups.programs, 7, 1)]

    assert not runs[0].isnan().any()
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    assert all(torch.equal(c, runs[0]) for c in cascades)
    ref = split_kv_decode_ref(q.float(), *args[1:], 128 ** -0.5, sliding_window=window)
    assert rel_err(runs[0], ref) < REL_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1000])
def test_explicit_positions_match_reference_and_the_whole_pass_bitwise_32q_8kv_d128(dtype, window):
    """A blend's recomputed rows: 15% of three documents' positions (6144, 3000 and 700 tokens) plus each one's
    last, scattered over many query blocks: against the reference, and bitwise the rows of a whole-sequence pass
    with implicit positions."""
    gen = torch.Generator().manual_seed(7)
    lengths = [6144, 3000, 700]
    kvs = [random_kv(n, 8, 128, dtype, gen, "cuda") for n in lengths]
    cache = paginate(kvs, 16, gen)
    qs = [torch.randn(n, 32, 128, generator=gen).to(dtype).cuda() for n in lengths]
    subsets = [torch.cat([torch.randperm(n - 1, generator=gen)[:int(0.15 * n)].sort().values, torch.tensor([n - 1])])
               for n in lengths]
    q = torch.cat([x[rows.cuda()] for x, rows in zip(qs, subsets)])
    positions = torch.cat(subsets).cuda()
    q_lens = [len(rows) for rows in subsets]

    out = _attend(paged_attention, cache, q, q_lens, lengths, 128 ** -0.5, window, positions)
    ref = _attend(paged_attention_ref, cache, q.float(), q_lens, lengths, 128 ** -0.5, window, positions)
    whole = _attend(paged_attention, cache, torch.cat(qs), lengths, lengths, 128 ** -0.5, window)

    assert rel_err(out, ref) < REL_BOUND[dtype]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert torch.equal(out, torch.cat([whole[start + rows.cuda()] for start, rows in zip(starts, subsets)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relocate_kv_equals_its_twin_bitwise_and_composes_rotations(dtype):
    """20000 of a 65536-slot cache's K/V (8 kv heads, d128) moved by up to 32768 positions: bitwise the twin's,
    V bit for bit, other slots untouched; and in float32 a key rotated to p and moved by delta is the key rotated
    to p + delta (the reference model's rotation), within float32's rounding of the angles."""
    gen = torch.Generator().manual_seed(8)
    n, shape = 20000, (4096, 16, 8, 128)
    k = torch.randn(shape, generator=gen).to(dtype).cuda()
    v = torch.randn(shape, generator=gen).to(dtype).cuda()
    slots = torch.randperm(4096 * 16, generator=gen)[:2 * n].cuda()
    src, dst = slots[:n].clone(), slots[n:].clone()
    deltas = torch.randint(0, 32768, (n,), generator=gen).cuda()
    inv_freq = RopeConfig(1e6).inv_freq(128).cuda()
    k_out, v_out, k_ref, v_ref = k.clone(), v.clone(), k.clone(), v.clone()
    relocate_kv(k_out, v_out, src, dst, deltas, inv_freq)
    relocate_kv_ref(k_ref, v_ref, src, dst, deltas, inv_freq)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert torch.equal(v_out.view(-1, 8, 128)[dst], v.view(-1, 8, 128)[src])
    untouched = torch.ones(4096 * 16, dtype=torch.bool, device="cuda")
    untouched[dst] = False
    assert torch.equal(k_out.view(-1, 8, 128)[untouched], k.view(-1, 8, 128)[untouched])

    if dtype == torch.float32:
        p = torch.randint(0, 32768, (n,), generator=gen).cuda()
        key = torch.randn(n, 8, 128, generator=gen).cuda()
        k_out.view(-1, 8, 128)[src] = rotate(key.transpose(0, 1), p, inv_freq).transpose(0, 1)
        relocate_kv(k_out, v_out, src, dst, deltas, inv_freq)
        expected = rotate(key.transpose(0, 1), p + deltas, inv_freq).transpose(0, 1)
        max_angle = ((p + deltas).max() * inv_freq.max()).item()
        pair = (key[..., :64] ** 2 + key[..., 64:] ** 2).sqrt().max().item()
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(k_out.view(-1, 8, 128)[dst], expected, rtol=0,
                                   atol=pair * eps * (1.5 * max_angle + 8))
