"""Deterministic mode on CPU (float32, Triton's interpreter): a token's bits do not depend on its batch-mates,
chunk boundaries, page size, arrival order, preemption or on whether prefill, decode or a recompute wrote it;
and the default mode, whose GEMMs are torch's BLAS, does depend on them here (the tests have the power to see it).
"""
import importlib

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from deterministic_cases import Arrival, Case, assert_bitwise, cases, run_case, solo_run
from chunkwise.kernels import matmul, matmul_ref, paged_attention, paged_decode
from chunkwise.kernels.testing import DTYPES
import chunkwise.engine.model
from chunkwise.engine import Engine, SamplingParams
from tests.draws import costly

PROMPT_LENS = [13, 6, 9, 70]   # the last one only in LONG
MAX_TOKENS = 5
MAX_MODEL_LEN = 80

# Preempts: two requests whose pages do not fit together, the second arriving while the first decodes.
TIGHT = Case(page_size=2, max_num_batched_tokens=8, max_num_seqs=3, num_pages=9, prefix_caching=False,
             split_kv_threshold=0, arrivals=(Arrival(0, 0, None), Arrival(1, 1, (1, 5))), readback_chunks=(4, 4, 9))
# Page size 1, one-token chunks, a chunk ending on a page boundary, all three prompts batched.
MIXED = Case(page_size=1, max_num_batched_tokens=40, max_num_seqs=3, num_pages=None, prefix_caching=True,
             split_kv_threshold=None, arrivals=(Arrival(2, 0, (1, 7, 1)), Arrival(0, 0, (8, 5)), Arrival(1, 2, None)), readback_chunks=None)
# Decodes past 64 tokens on the decode path, where the default mode would split the KV at 64 (two splits).
LONG = Case(page_size=5, max_num_batched_tokens=80, max_num_seqs=2, num_pages=None, prefix_caching=False,
            split_kv_threshold=0, arrivals=(Arrival(3, 0, None), Arrival(1, 0, None)), readback_chunks=(64, 10))



@pytest.fixture(scope="module")
def prompts(random_prompt):
    return [random_prompt(n, VOCAB, seed=i) for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def solo(ckpt, prompts):
    tokens, kv = solo_run(ckpt, prompts, MAX_TOKENS, max_model_len=MAX_MODEL_LEN)
    assert all(len(set(t)) > 1 for t in tokens), f"degenerate greedy output {tokens}"
    return tokens, kv


@given(m=st.integers(1, 80), n=st.integers(1, 300), k=st.integers(1, 150), dtype=st.sampled_from(DTYPES), data=st.data())
@example(m=1, n=1, k=1, dtype=torch.float32, data=None)
@example(m=65, n=257, k=65, dtype=torch.float16, data=None)   # one past every interpreter tile
@example(m=65, n=257, k=65, dtype=torch.bfloat16, data=None)  # every dtype the CPU engine accepts
def test_matmul_matches_reference_and_a_rows_bits_ignore_the_other_rows(m, n, k, dtype, data):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    matmul(x, w, out=out)
    # Against the exact product: float32 accumulation in any order errs by at most (k + 1) * 2**-24 * |x| @ |w|.T
    # (products of these inputs are exact or rounded once), and rounding to a 16-bit dtype by half an ulp more.
    exact = x.double() @ w.double().t()
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    if dtype != torch.float32:
        bound += torch.finfo(dtype).eps / 2 * exact.abs() + torch.finfo(dtype).smallest_normal
    for name, got in (("matmul", out), ("matmul_ref", matmul_ref(x, w))):
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"{name}: max error {(err - bound).max().item():.3g} past the rounding bound"
    lo = data.draw(st.integers(0, m - 1)) if data else m - 1
    hi = data.draw(st.integers(lo + 1, m)) if data else m
    assert torch.equal(matmul(x[lo:hi], w), out[lo:hi]), f"rows {lo}:{hi} of {m} changed bits when computed alone"


# Qwen3-0.6B's weights and a 1/8-head shard of a 70B's, on 132 SMs (H100 SXM, H200) and 114 (H100 PCIe).
@pytest.mark.parametrize("sms", [132, 114])
@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
                                  (1280, 8192), (8192, 1024), (7168, 8192)])
def test_matmul_tiles_for_any_row_count_are_warpgroup_tiles_and_the_warm_up_meets_each(monkeypatch, sms, n, k):
    """What the GPU's bitwise test cannot see off a GPU: at any row count the chosen tile keeps the MMA chain
    (at least one 64-row warpgroup, 16-aligned K tiles: module docstring), and the warm-up's row counts reach every
    tile that steps of up to max_m rows take."""
    mm = importlib.import_module("chunkwise.kernels.matmul")   # the package re-exports the function of this name
    monkeypatch.setattr(mm, "sm_count", lambda device: sms)
    monkeypatch.setattr(mm, "capability", lambda device: (9, 0))
    max_m = 9000
    for dtype in (torch.bfloat16, torch.float16):
        used = {mm.matmul_config(n, k, dtype, "cuda", m) for m in range(1, max_m + 1)}
        for block_m, block_n, block_k, warps, stages in used:
            assert block_m % 64 == 0 and warps % 4 == 0 and block_k % 16 == 0 and warps * 16 <= block_m, \
                (block_m, block_n, block_k, warps, stages)
        warmed = {mm.matmul_config(n, k, dtype, "cuda", m) for m in mm.config_changes(n, k, dtype, "cuda", max_m)}
        assert warmed == used
        assert len(used) > 1, "no row count changes the tile: the test would not see a warm-up that misses one"
    # Off Hopper (an A100 here) the tiles were not measured to keep a row's bits: one tile per weight.
    monkeypatch.setattr(mm, "capability", lambda device: (8, 0))
    assert len({mm.matmul_config(n, k, torch.bfloat16, "cuda", m) for m in range(1, max_m + 1, 37)}) == 1


def test_matmul_tiles_change_exactly_at_their_row_counts(monkeypatch):
    """Both sides of each limit, on 132 SMs: a wide tile from 128 rows (127 keeps the decode tile), and each wide
    tile from the first row count that gives every SM a program (Qwen3-0.6B's QKV: 5 x 32 128x128 tiles from 513
    rows, 9 x 16 128x256 ones from 1025); the warm-up's rows stop at max_m; on 128 SMs, exactly 128 programs."""
    mm = importlib.import_module("chunkwise.kernels.matmul")
    monkeypatch.setattr(mm, "sm_count", lambda device: 132)
    monkeypatch.setattr(mm, "capability", lambda device: (9, 0))
    wide, medium = mm.WIDE_TILES

    def config(n, m):
        return mm.matmul_config(n, 1024, torch.bfloat16, "cuda", m)
    decode = config(4096, 1)
    assert [config(4096, m) for m in (512, 513, 1024, 1025)] == [decode, medium, medium, wide]
    assert config(151936, 127) == config(151936, 1) != wide and config(151936, 128) == wide
    assert mm.config_changes(4096, 1024, torch.bfloat16, "cuda", 1025) == [1, 513, 1025]
    assert mm.config_changes(4096, 1024, torch.bfloat16, "cuda", 1024) == [1, 513]
    assert mm.config_changes(151936, 1024, torch.bfloat16, "cuda", 9000) == [1, 128]
    # Exactly one program an SM is enough: on 128 SMs, 4 x 32 128x128 tiles at 512 rows (3 x 32 at 384 are not).
    monkeypatch.setattr(mm, "sm_count", lambda device: 128)
    assert [config(4096, m) for m in (384, 385, 512)] == [decode, medium, medium]


def test_matmul_refuses_mismatched_operands():
    with pytest.raises(ValueError, match=r"x \(3, 4\) and w \(5, 6\)"):
        matmul(torch.ones(3, 4), torch.ones(5, 6))
    with pytest.raises(ValueError, match="w .*torch.float16.* must match x"):
        matmul(torch.ones(3, 4), torch.ones(5, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        matmul(torch.ones(3, 4, dtype=torch.int32), torch.ones(5, 4, dtype=torch.int32))


@costly(max_examples=max(1, settings.default.max_examples // 3))
@given(case=cases(PROMPT_LENS[:3], MAX_TOKENS))
@example(case=MIXED)
def test_deterministic_tokens_and_kv_are_bitwise_whatever_the_chunks_pages_batch_arrivals_and_preemption(
        ckpt, prompts, solo, case):
    """Tokens, the K/V each request wrote into its pages (by prefill, decode, or recompute after a preemption) and
    a later prefill_kv of prompt + generated tokens: all bitwise those of the prompt run alone, unchunked."""
    outcome = run_case(ckpt, prompts, case, MAX_TOKENS, max_model_len=MAX_MODEL_LEN)
    assert_bitwise(outcome, case, *solo)


def test_tight_pool_preempts_and_recompute_is_bitwise(ckpt, prompts, solo):
    outcome = run_case(ckpt, prompts, TIGHT, MAX_TOKENS, max_model_len=MAX_MODEL_LEN)
    assert outcome.preemptions > 0, "the pinned tight pool no longer preempts: the case tests no recompute"
    assert_bitwise(outcome, TIGHT, *solo)


def test_long_decodes_round_like_prefill(ckpt, prompts, solo, monkeypatch):
    """With split_size 64 the default mode would merge two KV splits here, in decodes and (a prefill split every
    64 positions) in the prompt's short steps; deterministic decodes and prefills stay one pass."""
    monkeypatch.setattr(chunkwise.engine.model, "PREFILL_SPLIT_SIZE", 64)
    outcome = run_case(ckpt, prompts, LONG, MAX_TOKENS, max_model_len=MAX_MODEL_LEN, split_size=64)
    assert_bitwise(outcome, LONG, *solo)


def test_default_mode_is_not_batch_invariant_on_cpu_where_the_blas_rounds_by_row_count(ckpt, prompts):
    """The same property in the default mode fails here: proof that the tests above can see a broken mode."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 64, generator=gen), torch.randn(256, 64, generator=gen)
    if all(torch.equal(x[:m] @ w.t(), (x @ w.t())[:m]) for m in range(1, 13)):
        pytest.skip("this host's BLAS keeps a row's bits whatever the row count: the default mode is invariant here")
    one = [prompts[0]]   # one request, chunked: its K/V rows come from GEMMs of other row counts than alone
    case = Case(page_size=3, max_num_batched_tokens=40, max_num_seqs=1, num_pages=None, prefix_caching=False,
                split_kv_threshold=None, arrivals=(Arrival(0, 0, (8, 5)),), readback_chunks=(1, 16))
    with pytest.raises(AssertionError, match="differs") as failure:
        assert_bitwise(run_case(ckpt, one, case, MAX_TOKENS, deterministic=False, max_model_len=MAX_MODEL_LEN),
                       case, *solo_run(ckpt, one, MAX_TOKENS, deterministic=False, max_model_len=MAX_MODEL_LEN))
    print(failure.value)


def test_deterministic_must_be_a_bool(ckpt):
    with pytest.raises(ValueError, match="deterministic must be a bool, got 'yes'"):
        Engine(ckpt, deterministic="yes")


FIRST_STEP = sum(PROMPT_LENS[:2])   # prefill rows of the test's first step: both prompts whole


@pytest.mark.parametrize("deterministic, split_rows, calls", [
    # one pass: prefill in 256-row tiles, decodes on their own path in 16 (paged_decode's tiles), every row summing
    # by dot (the same bits from any tile)
    (True, 512, {("paged_attention", 256, None, True), ("paged_decode", None, None, True)}),
    # a step of exactly PREFILL_SPLIT_ROWS rows splits, in 128-row tiles
    (False, FIRST_STEP, {("paged_attention", 128, 512, False)}),
    # one row more than it takes one pass, in up to 256 rows
    (False, FIRST_STEP - 1, {("paged_attention", 256, None, False)}),
])
def test_attention_tiles_and_context_splits_by_mode_and_step(ckpt, prompts, monkeypatch, deterministic, split_rows,
                                                            calls):
    # Deterministic decodes take paged_decode's own tiles and its prefill never splits (a token's bits must not
    # depend on the step); one pass may take 256 rows on Hopper (the CPU's interpreter takes 128 either way). The
    # default mode's decodes are split-KV.
    seen = set()

    def recording(fn):
        def record(*args, max_rows=None, split_size=None, sum_by_dot=False, **kwargs):
            seen.add((fn.__name__, max_rows, split_size, sum_by_dot))
            given = {"max_rows": max_rows, "split_size": split_size}
            return fn(*args, **{k: v for k, v in given.items() if v is not None}, sum_by_dot=sum_by_dot, **kwargs)
        return record
    monkeypatch.setattr(chunkwise.engine.model, "paged_attention", recording(paged_attention))
    monkeypatch.setattr(chunkwise.engine.model, "paged_decode", recording(paged_decode))
    monkeypatch.setattr(chunkwise.engine.model, "PREFILL_SPLIT_ROWS", split_rows)
    eng = Engine(ckpt, deterministic=deterministic, max_model_len=MAX_MODEL_LEN, split_kv_threshold=0)
    eng.generate(prompts[:2], SamplingParams(max_tokens=3))
    assert seen == calls
