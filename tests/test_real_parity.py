"""optimized.Engine on the real checkpoints: greedy tokens equal HF transformers' with random chunk
boundaries and page sizes (float32). The interpreter makes every token cost seconds on CPU, so each
checkpoint runs one seeded draw of page size and chunking, with both prompts batched in one generate."""
import random

import pytest
import torch

from chunkwise.checkpoints import resolve_model
from optimized import Engine, SamplingParams

pytestmark = [pytest.mark.realmodel, pytest.mark.correctness]

NEW_TOKENS = 12
PROMPTS = {
    "qwen2.5-coder-0.5b": ["def quicksort(arr):", "# Python: read a CSV file and print the sum of column 2\n"],
    "gemma3-270m": ["The three primary colors are", "Water boils at a temperature of"],
}


def random_chunks(rng: random.Random, n: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, n), min(3, n - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


def hf_greedy(model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens (EOS ignored) and its logits predicting each of them."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(out).logits[0, len(prompt_ids) - 1:-1]
    return out[0, len(prompt_ids):].tolist(), logits


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_optimized_greedy_tokens_equal_hf_with_random_chunks_and_page_size(name):
    path = resolve_model(name)
    rng = random.Random(name)
    page_size = rng.randint(1, 32)
    eng = Engine(path, dtype="float32", device="cpu", page_size=page_size, max_model_len=512, num_pages=256)
    prompts = [eng.tokenizer(p).input_ids for p in PROMPTS[name]]
    chunks = [random_chunks(rng, len(p)) for p in prompts]
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), chunk_sizes=chunks)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        want, logits = hf_greedy(hf, prompt)
        pos = next((j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b), None)
        if pos is not None:
            top = torch.topk(logits[pos], 2).values
            pytest.fail(f"{name} page {page_size} prompt {i} chunks {chunks[i]}: first divergence at generated "
                        f"token {pos}: optimized {out.token_ids[pos]}, HF {want[pos]} "
                        f"(HF top-2 margin {float(top[0] - top[1]):.3g})")
        assert len(out.token_ids) == len(want) == NEW_TOKENS
