"""bf16 and fp16 on CPU, where the kernels run in Triton's interpreter: chunkwise.Engine against
chunkwise.reference.Engine in the same dtype, in the default and deterministic modes, under the low-precision
tier's rule (tests/logprobs_close.py).

The interpreter holds bf16 as raw uint16 bits; until the kernels upcast their bf16 operands, computed their
products in float32 and rounded bf16 stores to nearest even there, the optimized engine's bf16 tokens were
garbage from the first one.
"""
import pytest
import torch

import chunkwise.engine
import chunkwise.reference
from logprobs_close import MIN_AGREED_SHARE, TOP_K, check_logprobs_close
from chunkwise.engine import SamplingParams

pytestmark = [pytest.mark.correctness,
              pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 on a GPU is tests/test_parity_gpu.py's")]

LENGTHS, CHUNKS = (1, 9, 40), [None, [4, 5], [16, 1, 23]]
MAX_TOKENS = 16
# Agreed tokens per request, measured here: tiny-qwen3 7, 16, 3; tiny-gemma3 16, 16, 4 (floor: 16 of 48).


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_bf16_greedy_tokens_equal_the_bf16_reference_until_a_near_tie(name, random_prompt):
    ref = chunkwise.reference.Engine(name, dtype="bfloat16", device="cpu")
    # Decodes of sequences past 16 tokens take split-KV and its merge; shorter ones the paged kernel.
    opt = chunkwise.Engine(name, dtype="bfloat16", device="cpu", num_pages=64, split_kv_threshold=16)
    prompts = [random_prompt(n, opt.model_config.vocab_size, seed=i) for i, n in enumerate(LENGTHS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)

    outs = opt.generate(prompts, params, chunk_sizes=CHUNKS)
    refs = ref.generate(prompts, params)

    agreed = [check_logprobs_close(o, r, f"{name} request {i}") for i, (o, r) in enumerate(zip(outs, refs))]
    assert sum(agreed) >= MIN_AGREED_SHARE * MAX_TOKENS * len(prompts), \
        f"{name}: only {agreed} of {MAX_TOKENS} tokens per request agreed before a divergence"


@pytest.mark.parametrize("dtype, deterministic", [("float16", False), ("float16", True), ("bfloat16", True)],
                         ids=["fp16", "fp16-deterministic", "bf16-deterministic"])
def test_every_16_bit_dtype_in_both_modes_gives_the_references_tokens_until_a_near_tie(dtype, deterministic,
                                                                                       random_prompt):
    """Each dtype the CPU engine accepts, through every kernel of its mode: the default mode's fused norms,
    rope_store, activation, paged attention and split-KV decodes with their merge (the bf16 test above covers bf16
    there), and the deterministic mode's matmul and single-pass decodes."""
    ref = chunkwise.reference.Engine("tiny-qwen3", dtype=dtype, device="cpu")
    opt = chunkwise.Engine("tiny-qwen3", dtype=dtype, device="cpu", num_pages=32, deterministic=deterministic,
                           split_kv_threshold=16, split_size=64)
    prompts = [random_prompt(n, opt.model_config.vocab_size, seed=i) for i, n in enumerate(LENGTHS[1:])]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    outs = opt.generate(prompts, params, chunk_sizes=CHUNKS[1:])
    refs = ref.generate(prompts, params)
    agreed = [check_logprobs_close(o, r, f"{dtype} request {i}") for i, (o, r) in enumerate(zip(outs, refs))]
    assert sum(agreed) >= MIN_AGREED_SHARE * 8 * len(prompts), f"only {agreed} of 8 tokens per request agreed"
