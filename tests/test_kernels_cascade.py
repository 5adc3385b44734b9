"""Cascade decode: bitwise equal to split-KV for every sequence, close to the float32 references, and the
grouping finds exactly the splits whose keys are the same memory for all their members."""
import dataclasses
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chunkwise.kernels import cascade_decode, cascade_decode_ref, cascade_groups, cascade_item_size, split_kv_decode
from chunkwise.kernels.attention_tile import attend_ref
from chunkwise.kernels.testing import DTYPES, TOLERANCE, PagedKV, random_kv
from tests.draws import costly

pytestmark = pytest.mark.correctness
# The tolerance test repeats what the bitwise test and split-KV's own reference test already pin; half the count.
FEWER = settings(max_examples=max(1, settings.default.max_examples // 2))


# A batch is a forest of shared segments: each group has a prefix segment, two optional branch segments (a
# document some of its members share), and per member a branch choice and a private suffix length. Members of
# all groups are interleaved by `order`. A group of one member is a sequence with no partner.
_GROUP = st.tuples(
    st.integers(0, 260) | st.sampled_from([64, 128, 192]),  # prefix length, often on a split boundary
    st.tuples(st.integers(0, 130), st.integers(0, 130)),    # branch lengths
    st.lists(st.tuples(st.sampled_from([None, 0, 1]), st.integers(0, 130)), min_size=1, max_size=5),
)


@st.composite
def batches(draw):
    groups = draw(st.lists(_GROUP, min_size=1, max_size=3))
    return dict(
        kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3, 4, 8])),
        head_dim=draw(st.sampled_from([16, 64, 80])), dtype=draw(st.sampled_from(DTYPES)),
        page_size=draw(st.integers(1, 64)), split_size=draw(st.sampled_from([64, 128])),
        window=draw(st.none() | st.integers(1, 300)), groups=groups,
        order=draw(st.permutations(range(sum(len(g[2]) for g in groups)))), seed=draw(st.integers(0, 2**16)),
        programs=draw(st.none() | st.integers(1, 5)),   # None: one program per item
        item_size=draw(st.none() | st.integers(1, 12)),  # None: cascade_item_size's (a 64-row tile)
    )


def _segments(groups, order):
    """(segment lengths by id, each sequence's segment ids in order), sequences permuted by `order`."""
    lengths, paths = {}, []
    for g, (prefix, branches, members) in enumerate(groups):
        lengths[g, "prefix"] = prefix
        for b, n in enumerate(branches):
            lengths[g, b] = n
        for m, (branch, suffix) in enumerate(members):
            lengths[g, m, "own"] = max(suffix, 1 if prefix + (0 if branch is None else branches[branch]) == 0 else 0)
            paths.append([(g, "prefix")] + ([] if branch is None else [(g, branch)]) + [(g, m, "own")])
    return lengths, [paths[i] for i in order]


def _page_keys(lengths, path, page_size):
    """One key per page of the sequence: pages whose content is the same segments up to their end, and which
    they fill, share a key (as a prefix cache would share them); a partly filled last page is private."""
    ends = torch.tensor([lengths[s] for s in path]).cumsum(0).tolist()
    keys = []
    for k in range(-(-ends[-1] // page_size)):
        end = (k + 1) * page_size
        covered = next(i for i, e in enumerate(ends) if e >= end) if end <= ends[-1] else None
        keys.append(("shared", k, tuple(path[:covered + 1])) if covered is not None else ("own", tuple(path), k))
    return keys


def _tables(lengths, paths, page_size, gen, extra_cols=1):
    """Page tables (random page ids, random entries past each sequence's pages) and the page keys behind them."""
    keys = [_page_keys(lengths, p, page_size) for p in paths]
    distinct = list(dict.fromkeys(k for ks in keys for k in ks))
    ids = dict(zip(distinct, torch.randperm(len(distinct) + 3, generator=gen).tolist()))
    width = max(len(ks) for ks in keys) + extra_cols
    table = torch.randint(0, len(distinct) + 3, (len(paths), width), generator=gen, dtype=torch.int32)
    for s, ks in enumerate(keys):
        table[s, :len(ks)] = torch.tensor([ids[k] for k in ks], dtype=torch.int32)
    return table, len(distinct) + 3


def _build(spec, device):
    """(PagedKV with NaN in every unused slot, q, each sequence's contiguous (k, v)) for a drawn batch."""
    gen = torch.Generator().manual_seed(spec["seed"])
    kv_heads, head_dim, dtype, page_size = spec["kv_heads"], spec["head_dim"], spec["dtype"], spec["page_size"]
    lengths, paths = _segments(spec["groups"], spec["order"])
    table, num_pages = _tables(lengths, paths, page_size, gen)
    seg_kv = {s: random_kv(n, kv_heads, head_dim, dtype, gen) for s, n in lengths.items()}
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    seqs = []
    for s, path in enumerate(paths):
        k = torch.cat([seg_kv[p][0] for p in path])
        v = torch.cat([seg_kv[p][1] for p in path])
        pos = torch.arange(k.shape[0])
        k_cache[table[s, pos // page_size].long(), pos % page_size] = k
        v_cache[table[s, pos // page_size].long(), pos % page_size] = v
        seqs.append((k.to(device), v.to(device)))
    seq_lens = torch.tensor([k.shape[0] for k, _ in seqs], dtype=torch.int32)
    q = torch.randn(len(paths), kv_heads * spec["group"], head_dim, generator=gen).to(dtype)
    cache = PagedKV(k_cache.to(device), v_cache.to(device), table.to(device), seq_lens.to(device))
    return cache, q.to(device), seqs


def _run(fn, cache, q, spec, groups):
    return fn(q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens, *([] if groups is None else [groups]),
              spec["head_dim"] ** -0.5, sliding_window=spec["window"], split_size=spec["split_size"],
              out=torch.full_like(q, float("nan")))


def _spec(groups, order=None, **kw):
    spec = dict(kv_heads=2, group=4, head_dim=64, dtype=torch.float32, page_size=16, split_size=64, window=None,
                groups=groups, order=order or list(range(sum(len(g[2]) for g in groups))), seed=0, programs=None,
                item_size=None)
    return {**spec, **kw}


def _groups(cache, spec, device):
    """cascade_groups of a built batch on `device` with items of spec["item_size"] members (None: the default),
    launched on spec["programs"] programs when drawn."""
    item_size = spec["item_size"] or cascade_item_size(spec["head_dim"], spec["group"])
    groups = cascade_groups(cache.page_tables.cpu(), cache.seq_lens.cpu(), spec["page_size"], spec["split_size"],
                            item_size=item_size).to(device)
    return groups if spec["programs"] is None else dataclasses.replace(groups, programs=spec["programs"])


@costly(max_examples=settings.default.max_examples)
@given(spec=batches())
# Four members sharing exactly two splits (prefix on the boundary), one with no partner, interleaved; one
# program takes both items (one per split: four members fill a 16-row tile with their four heads).
@example(spec=_spec([(128, (0, 0), [(None, 5), (None, 70), (None, 0), (None, 130)]), (100, (0, 0), [(None, 40)])],
                    order=[4, 0, 2, 1, 3], programs=1, item_size=4))
# Two members per item (eight heads each): five sharers of two splits make six items, over four programs.
@example(spec=_spec([(130, (0, 0), [(None, 1), (None, 2), (None, 3), (None, 4), (None, 5)])], kv_heads=1, group=8,
                    programs=4, item_size=2))
# Ten members of three heads sharing three splits: items of five (15 rows of a 16-row tile), then items of all
# ten (30 rows of a 32-row tile, a member's heads straddling the MMA's 16-row blocks on a GPU).
@example(spec=_spec([(192, (0, 0), [(None, k) for k in range(1, 11)])], kv_heads=1, group=3, item_size=5))
@example(spec=_spec([(192, (0, 0), [(None, k) for k in range(1, 11)])], kv_heads=1, group=3, item_size=10))
# A prefix shorter than one split (nothing shared) beside a tree: a branch shared by two of three members.
@example(spec=_spec([(40, (0, 0), [(None, 3), (None, 9)]), (64, (100, 20), [(0, 1), (0, 50), (1, 7)])],
                    kv_heads=1, group=3, head_dim=80, dtype=torch.float16, page_size=7, split_size=64))
# A window starting inside the shared prefix: the member with the longest suffix sees none of split 0.
@example(spec=_spec([(192, (0, 0), [(None, 1), (None, 60), (None, 120)])], window=100, page_size=1,
                    head_dim=16, group=1))
# The prefix ends 4 tokens short of split 1's end, inside its last page, which each member fills with its own tokens:
# the members agree on every page of split 1 but that one, so only split 0 is theirs to share.
@example(spec=_spec([(124, (0, 0), [(None, 10), (None, 20)])]))
def test_cascade_decode_is_bitwise_equal_to_split_kv_decode(spec, device):
    cache, q, _ = _build(spec, device)
    cascade = _run(cascade_decode, cache, q, spec, _groups(cache, spec, device))
    split = _run(split_kv_decode, cache, q, spec, None)

    assert not cascade.isnan().any()
    assert torch.equal(cascade, split)


@given(spec=batches())
@example(spec=_spec([(128, (64, 0), [(0, 5), (0, 70), (None, 3)])], window=90, dtype=torch.float16))
@example(spec=_spec([(130, (0, 0), [(None, 1), (None, 9)])], head_dim=16, dtype=torch.bfloat16, page_size=4))
@FEWER
def test_cascade_decode_matches_its_reference_and_full_attention(spec, device):
    cache, q, seqs = _build(spec, device)
    groups = _groups(cache, spec, device)
    out = _run(cascade_decode, cache, q, spec, groups)
    ref = _run(cascade_decode_ref, cache, q, spec, groups)
    full = torch.stack([attend_ref(q[s:s + 1], k, v, torch.tensor([k.shape[0] - 1], device=device),
                                   spec["head_dim"] ** -0.5, spec["window"])[0][0] for s, (k, v) in enumerate(seqs)])

    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[spec["dtype"]])
    torch.testing.assert_close(out, full.to(out.dtype), **TOLERANCE[spec["dtype"]])


def _shared_splits_by_definition(tables, seq_lens, page_size, split_size):
    """{(j, members)}: for each split j, the sequences holding it whole whose tables agree on every page up to
    its end, where two or more do."""
    nodes = {}
    for s, n in enumerate(seq_lens):
        for j in range(n // split_size):
            last_page = ((j + 1) * split_size - 1) // page_size
            nodes.setdefault((j, tuple(tables[s][:last_page + 1])), []).append(s)
    return {(j, tuple(m)) for (j, _), m in nodes.items() if len(m) > 1}


def _shared_splits_by_tree_walk(tables, lens, page_size, split_size):
    """([(j, members)], shared_splits): the grouping as first written, a walk down the tree of shared prefixes
    (split by split, each group split by its members' pages), kept as the oracle of the vectorised one."""
    whole = [n // split_size for n in lens]
    shared, shared_splits = [], [0] * len(lens)
    candidates = [list(range(len(lens)))]  # sets of sequences that share every split before j
    j = 0
    while candidates:
        pages = slice(j * split_size // page_size, ((j + 1) * split_size - 1) // page_size + 1)
        narrowed = []
        for group in candidates:
            by_pages = {}
            for s in group:
                if whole[s] > j:
                    by_pages.setdefault(tuple(tables[s][pages]), []).append(s)
            for members in by_pages.values():
                if len(members) > 1:
                    shared.append((j, members))
                    narrowed.append(members)
                    for s in members:
                        shared_splits[s] = j + 1
        candidates = narrowed
        j += 1
    return shared, shared_splits


@given(groups=st.lists(_GROUP, min_size=1, max_size=4), data=st.data())
@example(groups=[(128, (0, 0), [(None, 0), (None, 0)])], data=None)  # twins ending exactly on a split boundary
# Twins ending on a page boundary inside split 1: their zero padding agrees, but split 1 is not theirs whole.
@example(groups=[(96, (0, 0), [(None, 0), (None, 0)])], data=None)
# A tree: a prefix of three splits shared by six, then a document of two more splits by four of them (items of
# two members: the four make two items per split, the six three).
@example(groups=[(192, (128, 64), [(0, 3), (0, 0), (1, 70), (None, 9), (0, 64), (0, 1)]), (64, (0, 0), [(None, 5)])],
         data=None)
def test_cascade_groups_shares_exactly_the_splits_whose_pages_all_members_hold(groups, data):
    page_size, split_size, order, item_size, stale = 16, 64, None, 2, True
    if data is not None:
        page_size = data.draw(st.integers(1, 64), label="page_size")
        split_size = data.draw(st.sampled_from([16, 64, 128]), label="split_size")
        order = data.draw(st.permutations(range(sum(len(g[2]) for g in groups))), label="order")
        item_size = data.draw(st.integers(1, 5), label="item_size")
        stale = data.draw(st.booleans(), label="stale entries (else zero padding) past each sequence's pages")
    lengths, paths = _segments(groups, order or range(sum(len(g[2]) for g in groups)))
    table, _ = _tables(lengths, paths, page_size, torch.Generator().manual_seed(0), extra_cols=4)
    seq_lens = [sum(lengths[s] for s in p) for p in paths]
    # Entries past a sequence's pages must not count as shared: random ones, as a reused page-table row
    # holds, or zero padding (ragged lists), as the engine's tables start.
    own = [row[:-(-n // page_size)] for row, n in zip(table.tolist(), seq_lens)]
    tables = table.numpy() if stale else [row + [0] * 4 for row in own]

    g = cascade_groups(tables, torch.tensor(seq_lens, dtype=torch.int32), page_size, split_size, item_size=item_size)

    starts = g.starts.tolist()
    found = [(j, tuple(g.members[starts[i]:starts[i + 1]].tolist())) for i, j in enumerate(g.split.tolist())]
    walk, walk_splits = _shared_splits_by_tree_walk(own, seq_lens, page_size, split_size)
    assert sorted(found) == sorted((j, tuple(m)) for j, m in walk)
    assert g.shared_splits.tolist() == walk_splits
    assert set(found) == _shared_splits_by_definition(own, seq_lens, page_size, split_size)
    assert [j for j, _ in found] == sorted(j for j, _ in found)
    assert all(list(m) == sorted(m) for _, m in found)
    # Work items: each shared split's members in consecutive runs of item_size, the last one shorter.
    items = list(zip(g.item_shared.tolist(), g.item_first.tolist()))
    assert items == [(i, f) for i in range(g.num_shared) for f in range(starts[i], starts[i + 1], item_size)]
    assert g.num_items.tolist() == [len(items)] and g.programs == len(items) and g.item_size == item_size


def test_cascade_groups_and_decode_reject_inconsistent_input(device):
    with pytest.raises(ValueError, match="2 page tables but 1 seq_lens"):
        cascade_groups([[0], [0]], [3], 4, 64, item_size=4)
    with pytest.raises(ValueError, match="sequence 1: seq_len 9 must be >= 1 and fit its 2 pages of 4"):
        cascade_groups([[0, 1], [0, 2]], [8, 9], 4, 64, item_size=4)
    with pytest.raises(ValueError, match="sequence 0: seq_len 0"):
        cascade_groups([[0]], [0], 4, 64, item_size=4)
    with pytest.raises(ValueError, match="split_size must be a positive int, got 0"):
        cascade_groups([[0]], [1], 4, 0, item_size=4)
    with pytest.raises(ValueError, match="item_size must be a positive int, got 0"):
        cascade_groups([[0]], [1], 4, 64, item_size=0)

    spec = _spec([(128, (0, 0), [(None, 5), (None, 9)])])
    cache, q, _ = _build(spec, device)
    groups = cascade_groups(cache.page_tables, cache.seq_lens, 16, 64, item_size=4).to(device)
    args = (q, cache.k_cache, cache.v_cache, cache.page_tables, cache.seq_lens)
    with pytest.raises(ValueError, match="groups were made for split_size 64, not 128"):
        cascade_decode(*args, groups, 0.125, split_size=128)
    with pytest.raises(ValueError, match="groups cover 1 sequences, the batch has 2"):
        first = cascade_groups(cache.page_tables[:1], cache.seq_lens[:1], 16, 64, item_size=4)
        cascade_decode(*args, first.to(device), 0.125, split_size=64)
    with pytest.raises(TypeError, match="groups must be a CascadeGroups"):
        cascade_decode(*args, {"split": groups.split}, 0.125, split_size=64)
    with pytest.raises(ValueError, match="groups.split must be 1-d int32"):
        cascade_decode(*args, dataclasses.replace(groups, split=groups.split.long()), 0.125, split_size=64)
    with pytest.raises(ValueError, match="groups' items hold 33 members of 4 heads each; a shared-split tile of "
                                         "head_dim 64 holds 1 to 128 rows"):
        cascade_decode(*args, dataclasses.replace(groups, item_size=33), 0.125, split_size=64)
    with pytest.raises(ValueError, match="groups.programs must be an int >= 1 when there are items, got 0"):
        cascade_decode(*args, dataclasses.replace(groups, programs=0), 0.125, split_size=64)
    with pytest.raises(ValueError, match="must be equally long"):
        cascade_decode(*args, dataclasses.replace(groups, item_first=groups.item_first[:1]), 0.125, split_size=64)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="groups.split must be 1-d int32 on cuda"):
            cascade_decode(*args, groups.to("cpu"), 0.125, split_size=64)
    assert math.isfinite(cascade_decode(*args, groups, 0.125, split_size=64).sum().item())
