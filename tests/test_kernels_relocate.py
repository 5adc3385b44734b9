"""relocate_kv (blend mode's placed K/V, issue #28): against its PyTorch twin bit for bit, V copied whole, the
slots not named left alone, and K re-rotated so that rotations compose as the reference model rotates.

Runs on CPU through Triton's interpreter and on a GPU alike.
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chunkwise.kernels import relocate_kv, relocate_kv_ref
from chunkwise.kernels.testing import DTYPES
from chunkwise.model_config import RopeConfig
from chunkwise.reference.model import rotate

pytestmark = pytest.mark.correctness

# The RoPE configs of the families served: plain (Llama 2, Mistral), Qwen's 1e6 base, linear and llama3 scaling.
ROPES = [RopeConfig(10000.0), RopeConfig(1e6), RopeConfig(10000.0, "linear", factor=4.0),
         RopeConfig(500000.0, "llama3", factor=8.0)]


def _bits(t):
    """The raw bits of t, so that equality is bitwise (NaN and -0.0 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _pair_lengths(x):
    """float32 [..., head_dim // 2]: the length of each (x1, x2) pair that half-split RoPE rotates."""
    half = x.shape[-1] // 2
    return (x[..., :half].float() ** 2 + x[..., half:].float() ** 2).sqrt()


def _case(dtype, num_pages, page_size, kv_heads, head_dim, n, max_delta, gen, device):
    """A random cache and n relocations between disjoint random slots (deltas of either sign)."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:2 * n].to(device)
    deltas = torch.randint(-max_delta, max_delta + 1, (n,), generator=gen).to(device)
    return k, v, slots[:n].clone(), slots[n:].clone(), deltas


@given(dtype=st.sampled_from(DTYPES), page_size=st.integers(1, 32), kv_heads=st.integers(1, 5),
       head_dim=st.sampled_from([2, 6, 64, 80, 128]), n=st.integers(0, 60), rope=st.sampled_from(ROPES),
       seed=st.integers(0, 2**16))
@example(dtype=torch.float32, page_size=16, kv_heads=2, head_dim=64, n=0, rope=ROPES[0], seed=0)
@example(dtype=torch.bfloat16, page_size=1, kv_heads=1, head_dim=128, n=1, rope=ROPES[1], seed=1)
@example(dtype=torch.float16, page_size=7, kv_heads=3, head_dim=80, n=45, rope=ROPES[3], seed=2)
@example(dtype=torch.bfloat16, page_size=16, kv_heads=8, head_dim=64, n=300, rope=ROPES[2], seed=3)
@settings(max_examples=2 * settings.default.max_examples)
def test_relocate_kv_equals_its_twin_bitwise_copies_v_and_leaves_other_slots_alone(
        dtype, page_size, kv_heads, head_dim, n, rope, seed, device):
    """Pinned: n = 0, one relocation, page size 1, head_dim 80 (a padded half), and more relocations than the
    interpreter's program takes at once."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-(2 * n + 3) // page_size)   # room for the slots of both sides and a few never named
    k, v, src, dst, deltas = _case(dtype, num_pages, page_size, kv_heads, head_dim, n, 5000, gen, device)
    inv_freq = rope.inv_freq(head_dim).to(device)
    k_out, v_out, k_ref, v_ref = k.clone(), v.clone(), k.clone(), v.clone()

    relocate_kv(k_out, v_out, src, dst, deltas, inv_freq)
    relocate_kv_ref(k_ref, v_ref, src, dst, deltas, inv_freq)

    assert torch.equal(_bits(k_out), _bits(k_ref)), "K differs from the twin's"
    assert torch.equal(_bits(v_out), _bits(v_ref)), "V differs from the twin's"
    def flat(t):   # [num_slots, kv_heads, head_dim]
        return t.view(-1, kv_heads, head_dim)

    assert torch.equal(_bits(flat(v_out)[dst]), _bits(flat(v)[src])), "V was not copied bit for bit"
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=device)
    untouched[dst] = False
    assert torch.equal(_bits(flat(k_out)[untouched]), _bits(flat(k)[untouched])), "a K slot not named changed"
    assert torch.equal(_bits(flat(v_out)[untouched]), _bits(flat(v)[untouched])), "a V slot not named changed"
    # K's rotation keeps each (x1, x2) pair's length, up to the dtype's rounding of the result
    torch.testing.assert_close(_pair_lengths(flat(k_out)[dst]), _pair_lengths(flat(k)[src]), atol=1e-5,
                               rtol=2 * torch.finfo(dtype).eps)


@given(dtype=st.sampled_from(DTYPES), num_layers=st.integers(1, 6), data=st.data(), seed=st.integers(0, 2**16))
@example(dtype=torch.bfloat16, num_layers=6, data=None, seed=0)
@settings(max_examples=max(1, settings.default.max_examples // 2))
def test_relocating_some_layers_of_stacked_caches_in_one_launch_equals_a_launch_per_layer(
        dtype, num_layers, data, seed, device):
    """The layered form (caches [layers, ...], `layers` the ones to move, in any order) gives each named layer
    the one-layer form's bits and leaves the others alone. Pinned: every other layer of six, as Gemma's local
    and global RoPE configs split them."""
    gen = torch.Generator().manual_seed(seed)
    ids = (list(range(0, num_layers, 2)) if data is None
           else data.draw(st.lists(st.integers(0, num_layers - 1), unique=True, max_size=num_layers)))
    page_size, kv_heads, head_dim, n = 4, 2, 64, 9
    num_pages = -(-(2 * n + 3) // page_size)
    k, v = (torch.randn(num_layers, num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
            for _ in range(2))
    slots = torch.randperm(num_pages * page_size, generator=gen)[:2 * n].to(device)
    deltas = torch.randint(-3000, 3000, (n,), generator=gen).to(device)
    inv_freq = ROPES[1].inv_freq(head_dim).to(device)
    src, dst = slots[:n].clone(), slots[n:].clone()
    k_out, v_out, k_one, v_one = k.clone(), v.clone(), k.clone(), v.clone()

    layers = torch.tensor(ids, dtype=torch.int64, device=device)
    relocate_kv(k_out, v_out, src, dst, deltas, inv_freq, layers=layers)
    for i in ids:
        relocate_kv(k_one[i], v_one[i], src, dst, deltas, inv_freq)
    k_ref, v_ref = k.clone(), v.clone()
    relocate_kv_ref(k_ref, v_ref, src, dst, deltas, inv_freq, layers=layers)

    for out in ((k_out, v_out), (k_ref, v_ref)):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, (k_one, v_one))), ids


@given(head_dim=st.sampled_from([2, 64, 128]), rope=st.sampled_from(ROPES), max_pos=st.sampled_from([10, 4096]),
       seed=st.integers(0, 2**16))
@example(head_dim=128, rope=ROPES[0], max_pos=4096, seed=0)
@example(head_dim=64, rope=ROPES[3], max_pos=10, seed=1)
@settings(max_examples=settings.default.max_examples)
def test_relocating_a_rotated_key_by_delta_rotates_it_to_its_new_position(head_dim, rope, max_pos, seed, device):
    """relocate(rotate(k, p), delta) == rotate(k, p + delta) (the reference model's rotation), within float32's
    rounding of the angles: each angle a is off by up to eps * a / 2, three of them, which moves a unit pair by
    that many radians; plus a few roundings of the rotation itself."""
    gen = torch.Generator().manual_seed(seed)
    n, kv_heads, page_size = 40, 2, 16
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    p = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    delta = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    inv_freq = rope.inv_freq(head_dim).to(device)
    k_cache = torch.full((-(-2 * n // page_size), page_size, kv_heads, head_dim), float("nan"), device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(2 * n, generator=gen).to(device)
    src, dst = slots[:n].clone(), slots[n:].clone()
    k_cache.view(-1, kv_heads, head_dim)[src] = rotate(k.transpose(0, 1), p, inv_freq).transpose(0, 1)

    relocate_kv(k_cache, v_cache, src, dst, delta, inv_freq)

    moved = k_cache.view(-1, kv_heads, head_dim)[dst]
    expected = rotate(k.transpose(0, 1), p + delta, inv_freq).transpose(0, 1)
    eps = torch.finfo(torch.float32).eps
    max_angle = ((p + delta).max() * inv_freq.max()).item()
    pair = _pair_lengths(k).max().item()
    torch.testing.assert_close(moved, expected, rtol=0, atol=pair * eps * (1.5 * max_angle + 8))


def _small():
    k = torch.zeros(4, 4, 2, 8)
    return dict(k_cache=k, v_cache=torch.zeros_like(k), src_slots=torch.tensor([0, 1]),
                dst_slots=torch.tensor([2, 3]), deltas=torch.tensor([5, 6]), inv_freq=torch.ones(4))


@pytest.mark.parametrize("change, match", [
    (dict(src_slots=torch.tensor([0, 1], dtype=torch.int32)), "src_slots must be contiguous int64"),
    (dict(dst_slots=torch.tensor([2])), "dst_slots must be contiguous int64 \\[n\\].*\\(1,\\)"),
    (dict(deltas=torch.tensor([[5, 6]])), "deltas must be contiguous int64"),
    (dict(inv_freq=torch.ones(8)), "inv_freq must be contiguous float32 \\[4\\], got torch.float32 \\(8,\\)"),
    (dict(inv_freq=torch.ones(4, dtype=torch.float64)), "inv_freq must be contiguous float32"),
    (dict(v_cache=torch.zeros(4, 4, 2, 6)), "v_cache torch.float32 \\(4, 4, 2, 6\\)"),
    (dict(k_cache=torch.zeros(4, 4, 2, 7), v_cache=torch.zeros(4, 4, 2, 7), inv_freq=torch.ones(3)),
     "head_dim 7 must be even"),
    (dict(layers=torch.tensor([0])), "must be equal and contiguous \\[layers, pages"),
    (dict(k_cache=torch.zeros(2, 4, 4, 2, 8), v_cache=torch.zeros(2, 4, 4, 2, 8), layers=torch.tensor([0.0])),
     "layers must be int64"),
])
def test_relocate_kv_rejects_bad_arguments_naming_them(change, match):
    for fn in (relocate_kv, relocate_kv_ref):
        args = _small()
        args.update(change)
        with pytest.raises(ValueError, match=match):
            fn(**args)


@pytest.mark.parametrize("change, match", [
    (dict(dst_slots=torch.tensor([2, 1])), "must be disjoint"),
    (dict(dst_slots=torch.tensor([2, 16])), "dst_slots must lie in \\[0, 16\\), got \\[2, 16\\]"),
    (dict(src_slots=torch.tensor([-1, 0])), "src_slots must lie in \\[0, 16\\)"),
])
def test_relocate_kv_ref_rejects_slots_outside_the_cache_or_overlapping(change, match):
    args = _small()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        relocate_kv_ref(**args)
