"""Deterministic mode on the GPU in bfloat16, the precision users run: tokens and K/V bitwise the same whatever the
chunking, page size, batch, arrival order and preemption, and whichever of prefill, decode (CUDA graphs on) or a
recompute wrote them; on a tiny model and on one of Qwen3-0.6B's shape (28 layers, 16/8 heads of 128, vocab 151936).
"""
import pytest
import torch
from hypothesis import example, given, settings

from chunkwise.checkpoints import tiny_checkpoint
from deterministic_cases import Arrival, Case, assert_bitwise, cases, run_case, solo_run
from chunkwise.kernels import matmul, matmul_ref
from chunkwise.kernels.matmul import config_changes, matmul_config

pytestmark = pytest.mark.gpu

QWEN3_0_6B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.02)
TINY_LENS, TINY_TOKENS, TINY_LEN = [37, 9, 130], 12, 192
QWEN_LENS, QWEN_TOKENS, QWEN_LEN = [300, 45, 170], 16, 512
FEWER = settings(max_examples=max(1, settings.default.max_examples // 3))


def prompts_of(lens, vocab):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def tiny():
    path = tiny_checkpoint("qwen3")
    prompts = prompts_of(TINY_LENS, 384)
    kw = dict(dtype="bfloat16", max_model_len=TINY_LEN)
    return path, prompts, kw, solo_run(path, prompts, TINY_TOKENS, **kw)


@pytest.fixture(scope="module")
def qwen():
    path = tiny_checkpoint("qwen3", **QWEN3_0_6B_SHAPE)
    prompts = prompts_of(QWEN_LENS, QWEN3_0_6B_SHAPE["vocab_size"])
    kw = dict(dtype="bfloat16", max_model_len=QWEN_LEN)
    return path, prompts, kw, solo_run(path, prompts, QWEN_TOKENS, **kw)


@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (200, 72)])
def test_matmul_rows_are_bitwise_whatever_the_row_count(n, k):
    """Row counts from 1 to 2100 take every tile that matmul_config chooses for these weights (its tiles grow
    with the rows), and each gives a row the same bits."""
    rows = 2100
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    full = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(x, w, out=full)
    torch.testing.assert_close(full, matmul_ref(x, w), atol=2e-2, rtol=1e-2)
    changes = config_changes(n, k, x.dtype, "cuda", rows)
    slices = [(0, 1), (5, 6), (3, 67), (64, 128)] + [(rows - m, rows) for m in changes]
    configs = {matmul_config(n, k, x.dtype, "cuda", hi - lo) for lo, hi in slices}
    assert configs == {matmul_config(n, k, x.dtype, "cuda", m) for m in range(1, rows + 1)}, "a tile left untested"
    for lo, hi in slices + [(100, 612), (0, rows - 1)]:
        assert torch.equal(matmul(x[lo:hi], w), full[lo:hi]), f"rows {lo}:{hi} of {rows} changed bits (n={n}, k={k})"


# Tight: the 130-token prompt and the 37-token one cannot both hold their pages; decodes past 128 tokens.
TINY_TIGHT = Case(page_size=16, max_num_batched_tokens=64, max_num_seqs=3, num_pages=11, prefix_caching=False,
                  split_kv_threshold=None, arrivals=(Arrival(2, 0, None), Arrival(0, 2, (1, 36))),
                  readback_chunks=(128, 13))


@settings(max_examples=settings.default.max_examples)
@given(case=cases(TINY_LENS, TINY_TOKENS, max_page_size=33))
@example(case=TINY_TIGHT)
def test_tiny_bf16_tokens_and_kv_are_bitwise_across_chunks_pages_batch_arrivals_and_preemption(tiny, case):
    path, prompts, kw, solo = tiny
    assert_bitwise(run_case(path, prompts, case, TINY_TOKENS, **kw), case, *solo)


def test_tiny_tight_pool_preempts(tiny):
    path, prompts, kw, solo = tiny
    outcome = run_case(path, prompts, TINY_TIGHT, TINY_TOKENS, **kw)
    assert outcome.preemptions > 0
    assert_bitwise(outcome, TINY_TIGHT, *solo)


QWEN_MIXED = Case(page_size=16, max_num_batched_tokens=256, max_num_seqs=3, num_pages=None, prefix_caching=True,
                  split_kv_threshold=None, arrivals=(Arrival(1, 0, None), Arrival(0, 0, (100, 1, 199)),
                                                     Arrival(2, 3, None)), readback_chunks=(45, 15))
QWEN_TIGHT = Case(page_size=7, max_num_batched_tokens=128, max_num_seqs=3, num_pages=50, prefix_caching=False,
                  split_kv_threshold=None, arrivals=(Arrival(0, 0, None), Arrival(2, 1, None)),
                  readback_chunks=None)


@FEWER
@given(case=cases(QWEN_LENS, QWEN_TOKENS, max_page_size=64))
@example(case=QWEN_MIXED)
@example(case=QWEN_TIGHT)
def test_qwen3_shape_bf16_tokens_and_kv_are_bitwise_across_chunks_pages_batch_arrivals_and_preemption(qwen, case):
    path, prompts, kw, solo = qwen
    assert_bitwise(run_case(path, prompts, case, QWEN_TOKENS, **kw), case, *solo)
