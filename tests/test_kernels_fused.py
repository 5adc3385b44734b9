"""The fused step kernels (RMSNorm with residual, q/k-norm + RoPE + K/V store, activation times up) against
their PyTorch references, and their rows' independence from the batch.

Runs on CPU through Triton's interpreter and on a GPU, in float32, float16 and bfloat16. Inputs are random
normals (never zeros) and every output is poisoned with NaN before the call, so an unwritten element fails.
Tolerances are in units of the output dtype's epsilon: the kernels keep the references' rounding points, so
what differs is the float32 summation order (and, on a GPU, exp/rsqrt approximations), worth an ulp or two
after rounding to float16/bfloat16.
"""
import pytest
import torch
import triton
from hypothesis import example, given
from hypothesis import strategies as st

from chunkwise.kernels import (act_and_mul, act_and_mul_ref, add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref,
                     rope_cos_sin, rope_store, rope_store_ref)
from chunkwise.kernels.testing import DTYPES   # bf16 rounds as on GPU under the interpreter too (chunkwise.kernels.tiling.cast)
from chunkwise.kernels.tiling import block_rows

pytestmark = pytest.mark.correctness

# Tolerated ulps: float32 allows for the GPU's approximate exp/rsqrt; the 16-bit types for one rounding of a
# float32 value that differs in its last bits, plus a second rounding where the models round twice.
ULPS = {torch.float32: 16, torch.float16: 2, torch.bfloat16: 2}
HEADS = [(4, 4), (8, 2), (14, 2), (16, 8), (4, 1), (5, 1), (6, 3)]
HEAD_DIMS = [64, 80, 96, 128, 256]
EPS = 1e-6


def _close(out, ref, scale=None):
    """out within ULPS of ref, relative to each element and, where the op cancels inside, to `scale` (the
    magnitude of the op's inputs, broadcast against ref)."""
    assert not out.isnan().any(), "unwritten or NaN output"
    tol = ULPS[ref.dtype] * torch.finfo(ref.dtype).eps
    floor = tol * scale if scale is not None else torch.finfo(ref.dtype).tiny
    err = (out.float() - ref.float()).abs()
    bad = err > tol * ref.float().abs() + floor
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off by more than {ULPS[ref.dtype]} "
                           f"ulps; worst {err.max().item():.3g}")


def _randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _nan(t):
    return torch.full_like(t, float("nan"))


@given(hidden=st.sampled_from([64, 100, 896, 1000, 1152]), whole_blocks=st.integers(0, 2),
       extra_rows=st.integers(-2, 5), mode=st.sampled_from(["plain", "add", "add_pre"]), plus_one=st.booleans(),
       x_scale=st.sampled_from([1.0, 1e-3]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@example(hidden=1000, whole_blocks=1, extra_rows=1, mode="add", plus_one=False, x_scale=1.0,
         dtype=torch.float32, seed=0)
@example(hidden=100, whole_blocks=0, extra_rows=1, mode="add_pre", plus_one=True, x_scale=1e-3,
         dtype=torch.float16, seed=1)
@example(hidden=896, whole_blocks=1, extra_rows=-1, mode="add", plus_one=True, x_scale=1.0,
         dtype=torch.bfloat16, seed=2)   # every dtype the engine accepts, pinned: each is one draw of three
@example(hidden=64, whole_blocks=0, extra_rows=2, mode="plain", plus_one=False, x_scale=1.0,
         dtype=torch.bfloat16, seed=3)
def test_rms_norm_matches_reference_with_and_without_residual(
        hidden, whole_blocks, extra_rows, mode, plus_one, x_scale, dtype, seed, device):
    """Row counts around multiples of the rows one program takes; hidden sizes not powers of two. x_scale
    1e-3 makes eps (1e-6) matter against the mean square."""
    rows = max(1, whole_blocks * block_rows(triton.next_power_of_2(hidden), device) + extra_rows)
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, rows, hidden, dtype=dtype, device=device, scale=x_scale)
    residual = _randn(gen, rows, hidden, dtype=dtype, device=device, scale=x_scale)
    weight = _randn(gen, hidden, dtype=dtype, device=device)
    pre = _randn(gen, hidden, dtype=dtype, device=device) if mode == "add_pre" else None
    out = _nan(x)

    if mode == "plain":
        rms_norm(x, weight, EPS, plus_one, out=out)
        _close(out, rms_norm_ref(x, weight, EPS, plus_one))
        return
    res_out = _nan(x)
    add_rms_norm(x, residual, weight, EPS, plus_one, pre_weight=pre, out=out, residual_out=res_out)
    _, res_ref = add_rms_norm_ref(x, residual, weight, EPS, plus_one, pre_weight=pre)
    if pre is None:
        assert torch.equal(res_out, res_ref)  # one rounding of x + residual, the same on both sides
    else:
        # norm_pre(x) + residual cancels: the pre-norm's last-ulp difference counts against its own size.
        _close(res_out, res_ref, scale=rms_norm_ref(x, pre, EPS, plus_one).abs().float() + res_ref.abs().float())
    # The final norm, judged on the kernel's own sum.
    _close(out, rms_norm_ref(res_out, weight, EPS, plus_one))


@given(hidden=st.sampled_from([64, 1000]), rows=st.integers(2, 80), pre=st.booleans(), plus_one=st.booleans(),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_rms_norm_rows_are_bitwise_independent_of_their_batch(hidden, rows, pre, plus_one, dtype, data, device):
    """A slice of the rows normalized alone gives the same bits as inside the whole batch (batch invariance)."""
    start = data.draw(st.integers(0, rows - 1), label="start")
    end = data.draw(st.integers(start + 1, rows), label="end")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x, residual = (_randn(gen, rows, hidden, dtype=dtype, device=device) for _ in range(2))
    weight, pre_weight = (_randn(gen, hidden, dtype=dtype, device=device) for _ in range(2))
    args = (EPS, plus_one, pre_weight if pre else None)

    whole, whole_res = add_rms_norm(x, residual, weight, *args)
    part, part_res = add_rms_norm(x[start:end], residual[start:end], weight, *args)

    assert torch.equal(part, whole[start:end]) and torch.equal(part_res, whole_res[start:end])


@given(heads=st.sampled_from(HEADS), head_dim=st.sampled_from(HEAD_DIMS), num_tokens=st.integers(1, 40),
       page_size=st.integers(1, 32), qk_norm=st.booleans(), bias=st.booleans(), plus_one=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@example(heads=(5, 1), head_dim=80, num_tokens=1, page_size=1, qk_norm=True, bias=False, plus_one=True,
         dtype=torch.float32, seed=0)
@example(heads=(16, 8), head_dim=128, num_tokens=37, page_size=16, qk_norm=True, bias=False, plus_one=False,
         dtype=torch.float16, seed=1)
@example(heads=(14, 2), head_dim=64, num_tokens=9, page_size=7, qk_norm=False, bias=True, plus_one=False,
         dtype=torch.float32, seed=2)
@example(heads=(4, 1), head_dim=256, num_tokens=5, page_size=3, qk_norm=True, bias=False, plus_one=True,
         dtype=torch.float16, seed=3)
@example(heads=(4, 2), head_dim=16, num_tokens=11, page_size=4, qk_norm=True, bias=True, plus_one=False,
         dtype=torch.bfloat16, seed=4)   # the tiny engines' shape, in bf16
def test_rope_store_matches_reference_and_skips_padding_slots(
        heads, head_dim, num_tokens, page_size, qk_norm, bias, plus_one, dtype, seed, device):
    """Random slots in a NaN-filled pool, about a fifth of them -1 (padding): those tokens store nothing, the
    others store exactly their K/V; q is rotated for every token. Positions up to 40k, as long contexts have."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(gen, num_tokens, width, dtype=dtype, device=device)
    qkv_bias = _randn(gen, width, dtype=dtype, device=device) if bias else None
    q_norm, k_norm = ((_randn(gen, head_dim, dtype=dtype, device=device) for _ in range(2)) if qk_norm
                      else (None, None))
    positions = torch.randint(0, 40960, (num_tokens,), generator=gen).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
    cos, sin = rope_cos_sin(positions, inv_freq)
    num_pages = num_tokens // page_size + 2
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    slots = slots.to(device)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    args = (qkv, qkv_bias, q_norm, k_norm, cos, sin, slots)

    q = rope_store(*args, k_cache, v_cache, EPS, plus_one, q_out=torch.full(
        (num_tokens, num_heads, head_dim), float("nan"), dtype=dtype, device=device))
    q_ref = rope_store_ref(*args, k_ref, v_ref, EPS, plus_one)

    # RoPE's x1*cos - x2*sin cancels: judged against the size of the rotated (normed) inputs.
    _close(q, q_ref, scale=q_ref.abs().amax(-1, keepdim=True).float())
    stored = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    stored[slots[slots >= 0]] = True
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        flat, flat_ref = cache.view(-1, num_kv_heads, head_dim), ref.view(-1, num_kv_heads, head_dim)
        assert flat[~stored].isnan().all(), "a padding token or an unused slot was written"
        if cache is v_cache:
            assert torch.equal(flat[stored], flat_ref[stored])  # V is copied (plus the bias, rounded once)
        else:
            _close(flat[stored], flat_ref[stored], scale=flat_ref[stored].abs().amax(-1, keepdim=True).float())


@given(inter=st.integers(1, 700), whole_blocks=st.integers(0, 2), extra_rows=st.integers(-2, 5),
       act=st.sampled_from(["silu", "gelu_pytorch_tanh"]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
@example(inter=1, whole_blocks=0, extra_rows=1, act="silu", dtype=torch.float32, seed=0)
@example(inter=683, whole_blocks=1, extra_rows=1, act="gelu_pytorch_tanh", dtype=torch.float16, seed=1)
@example(inter=128, whole_blocks=0, extra_rows=3, act="silu", dtype=torch.bfloat16, seed=2)
@example(inter=100, whole_blocks=1, extra_rows=-1, act="gelu_pytorch_tanh", dtype=torch.bfloat16, seed=3)
def test_act_and_mul_matches_reference(inter, whole_blocks, extra_rows, act, dtype, seed, device):
    """Intermediate sizes from 1 to odd ones; gate values spread to +-12, where SiLU and GELU saturate."""
    block_cols = min(triton.next_power_of_2(inter), 1024) if device.type == "cuda" else triton.next_power_of_2(inter)
    rows = max(1, whole_blocks * block_rows(block_cols, device) + extra_rows)
    gen = torch.Generator().manual_seed(seed)
    gate_up = _randn(gen, rows, 2 * inter, dtype=dtype, device=device, scale=4.0)
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=device)

    act_and_mul(gate_up, act, out=out)

    # PyTorch's GELU cancels in 1 + tanh(u) for gate < -5 (it returns 0 where x * sigmoid(2u), the kernel's
    # form, is 1e-7): there the reference's own error is an ulp of |gate * up|.
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(out, act_and_mul_ref(gate_up, act), scale=(gate * up).abs() if act == "gelu_pytorch_tanh" else None)


def test_fused_kernels_refuse_bad_arguments_naming_them():
    x, w = torch.randn(3, 64), torch.randn(64)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got torch.int64"):
        rms_norm(torch.ones(3, 64, dtype=torch.int64), w, EPS, False)
    with pytest.raises(ValueError, match="weight must be contiguous \\[64\\], got \\(32,\\)"):
        rms_norm(x, torch.randn(32), EPS, False)
    with pytest.raises(ValueError, match="residual must be contiguous torch.float32 \\(3, 64\\)"):
        add_rms_norm(x, torch.randn(4, 64), w, EPS, False)
    with pytest.raises(ValueError, match="act must be one of"):
        act_and_mul(torch.randn(3, 8), "relu")
    with pytest.raises(ValueError, match="gate_up must be \\[tokens, 2 \\* intermediate\\]"):
        act_and_mul(torch.randn(3, 7), "silu")
    k_cache = torch.zeros(4, 2, 2, 64)
    qkv, cos = torch.randn(3, 8 * 64), torch.randn(3, 32)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping must be int64 \\[3\\], got torch.int32"):
        rope_store(qkv, None, None, None, cos, cos, slots.int(), k_cache, k_cache.clone(), EPS, False)
    with pytest.raises(ValueError, match="cos must be contiguous float32 \\[3, 32\\]"):
        rope_store(qkv, None, None, None, cos[:2], cos, slots, k_cache, k_cache.clone(), EPS, False)
    with pytest.raises(ValueError, match="q_norm and k_norm must be given together"):
        rope_store(qkv, None, torch.randn(64), None, cos, cos, slots, k_cache, k_cache.clone(), EPS, False)
    with pytest.raises(ValueError, match="qkv \\(3, 257\\) must be"):
        rope_store(torch.randn(3, 257), None, None, None, cos, cos, slots, k_cache, k_cache.clone(), EPS, False)
