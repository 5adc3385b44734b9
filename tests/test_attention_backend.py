"""attention_backend="fa3"'s routing on the CPU, with FA3's PyTorch twin (`paged_attention_ref`) standing in for
it: FA3 itself runs on Hopper only (tests/test_fa3_gpu.py). Which prefill rows it takes (every prefill step's,
at their sequences' ends), split where chunkwise's kernel would split them, and a blend's left to chunkwise's
kernel; the tokens stay the reference engine's. Decodes take split-KV as on a GPU (split_kv_threshold=0; on the CPU
short ones would otherwise join the prefill rows).
"""
import importlib

import pytest

from chunkwise.chunks import Blend
from chunkwise.engine import Engine, SamplingParams
from chunkwise.engine import model as engine_model
from chunkwise.engine.model import PREFILL_SPLIT_ROWS
from chunkwise.kernels import paged_attention_ref

pytestmark = pytest.mark.correctness
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def fa3_calls(monkeypatch):
    """FA3 accepted on the CPU, its twin in its place; the (rows, split) of each call."""
    calls = []

    def twin(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale, sliding_window=None, out=None,
             split=False):
        calls.append((q.shape[0], split))
        return paged_attention_ref(q, k_cache, v_cache, page_tables, seq_lens, query_start_loc, scale,
                                   sliding_window=sliding_window, out=out)

    monkeypatch.setattr(importlib.import_module("chunkwise.open_config"), "fa3_unavailable",
                        lambda device, dtype, head_dim: None)
    monkeypatch.setattr(engine_model, "fa3_paged_attention", twin)
    return calls


def test_fa3_takes_every_prefill_step_split_where_chunkwise_would_split_and_tokens_stay_the_references(
        tiny_ckpt, reference_engine, fa3_calls):
    """Mistral's sliding window reaches the twin too. A 600-token prompt fills a step of more than
    PREFILL_SPLIT_ROWS rows (one pass); what is left of the others, a short step (split)."""
    ckpt = tiny_ckpt("mistral", num_hidden_layers=2)
    eng = Engine(ckpt, dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=640, split_kv_threshold=0,
                 attention_backend="fa3")
    prompts = [[(5 * i + 3 * n) % 300 + 3 for i in range(n)] for n in (600, 100, 7)]
    outs = eng.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference_engine("mistral", num_hidden_layers=2)
                                           .generate(prompts, PARAMS)]
    assert fa3_calls and all(split == (rows <= PREFILL_SPLIT_ROWS) for rows, split in fa3_calls), fa3_calls
    assert {split for _, split in fa3_calls} == {False, True}, fa3_calls


def test_a_blends_rows_keep_chunkwises_kernel_under_fa3(tiny_ckpt, fa3_calls):
    """A blend's rows sit at explicit positions, which FA3 does not take: its steps call no FA3, and its tokens
    are those of the same blend on the default backend."""
    ckpt = tiny_ckpt("qwen3", num_hidden_layers=4)
    outs = []
    for backend in ("triton", "fa3"):
        eng = Engine(ckpt, dtype="float32", device="cpu", page_size=4, split_kv_threshold=0,
                     attention_backend=backend)
        doc = eng.register_chunk([(7 * i) % 300 + 3 for i in range(40)])
        fa3_calls.clear()
        outs.append(eng.generate([[[1, 2], doc, [3, 4]]], PARAMS, reuse=Blend(0.3))[0])
    assert outs[1].chunk_reuse[1].blended > 0 and not fa3_calls, fa3_calls
    assert outs[0].token_ids == outs[1].token_ids
