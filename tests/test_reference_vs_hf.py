"""The reference model against HF transformers (eager attention, float32) on tiny checkpoints that
transformers itself wrote: logits at every position, greedy generations, and the cached K/V."""
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from chunkwise.sampling import SamplingParams

pytestmark = pytest.mark.correctness

PROMPT_LEN = 40          # longer than every sliding window below, so the windows bind
NEW_TOKENS = 32
# float32 on CPU: both sides do the same operations; the measured difference is 0 for every case.
LOGITS_TOL = dict(rtol=1e-5, atol=1e-4)
KV_TOL = dict(rtol=1e-5, atol=1e-5)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama-gqa-untied": ("llama", {}),
    "mistral-window24": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
    "gemma3-mqa-window8": ("gemma3_text", {}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                        "factor": 4.0}}),
    "llama-mha-hd80-tied": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 80,
                                      "hidden_size": 96, "tie_word_embeddings": True}),
    "qwen3-mqa-hd96": ("qwen3", {"num_key_value_heads": 1, "head_dim": 96}),
    "gemma3-3layers-window4": ("gemma3_text", {"num_hidden_layers": 3, "sliding_window": 4,
                                               "layer_types": ["sliding_attention", "sliding_attention",
                                                               "full_attention"]}),
}


@pytest.fixture(params=list(CASES), scope="module")
def case(request, reference_engine, hf_model, random_prompt):
    family, overrides = CASES[request.param]
    eng = reference_engine(family, **overrides)
    return eng, hf_model(family, **overrides), random_prompt(PROMPT_LEN, eng.model_config.vocab_size)


def test_logits_match_hf_at_every_position(case):
    eng, hf, prompt = case
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(eng.logits(prompt), expected, **LOGITS_TOL)


def test_greedy_generation_matches_hf_generate(case):
    eng, hf, prompt = case
    ours = eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert len(theirs) == NEW_TOKENS
    assert ours == theirs


def test_prefill_kv_matches_hf_past_key_values(case):
    eng, hf, prompt = case
    k, v = eng.prefill_kv(prompt)
    cfg = eng.model_config
    assert k.shape == v.shape == (cfg.num_layers, PROMPT_LEN, cfg.num_kv_heads, cfg.head_dim)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer, hf_layer in enumerate(cache.layers):
        # HF's cache is [batch, kv_heads, tokens, head_dim]; a sliding layer keeps only its last tokens.
        hf_k, hf_v = hf_layer.keys[0].transpose(0, 1), hf_layer.values[0].transpose(0, 1)
        kept = hf_k.shape[0]
        assert kept == PROMPT_LEN or (cfg.window(layer) and kept >= cfg.window(layer) - 1), (layer, kept)
        torch.testing.assert_close(k[layer, -kept:], hf_k, **KV_TOL)
        torch.testing.assert_close(v[layer, -kept:], hf_v, **KV_TOL)


@pytest.mark.parametrize("name", ["mistral-window24", "gemma3-mqa-window8", "gemma3-3layers-window4"])
def test_sliding_window_changes_logits_past_the_window(name, reference_engine, random_prompt):
    """Guards the parity tests above against a window that neither side applies."""
    family, overrides = CASES[name]
    eng = reference_engine(family, **overrides)
    prompt = random_prompt(PROMPT_LEN, eng.model_config.vocab_size)
    windowed = eng.logits(prompt)
    unbounded = replace(eng.model_config, sliding_window=10**9)   # same layer types and RoPE, window never binds
    unwindowed = type(eng.model)(unbounded, eng.model.w).forward(torch.tensor(prompt))[0]
    w = eng.model_config.sliding_window
    torch.testing.assert_close(windowed[:w], unwindowed[:w], rtol=0, atol=1e-5)
    assert (windowed[w:] - unwindowed[w:]).abs().amax(-1).min() > 1e-3


SOFTCAP = 2.0   # below the tiny Gemma's largest logits (about 5), so the cap binds


def test_gemma_soft_capped_logits_match_hf_and_are_capped(reference_engine, hf_model, random_prompt):
    """final_logit_softcapping (cap * tanh(logits / cap)): the reference's logits are HF's, and the cap binds."""
    eng = reference_engine("gemma3_text", final_logit_softcapping=SOFTCAP)
    prompt = random_prompt(16, eng.model_config.vocab_size)
    ours = eng.logits(prompt)
    with torch.no_grad():
        torch.testing.assert_close(ours, hf_model("gemma3_text", final_logit_softcapping=SOFTCAP)(
            torch.tensor([prompt])).logits[0], **LOGITS_TOL)
    uncapped = reference_engine("gemma3_text").logits(prompt)
    assert uncapped.abs().max() > SOFTCAP > ours.abs().max()
    torch.testing.assert_close(ours, SOFTCAP * torch.tanh(uncapped / SOFTCAP), **LOGITS_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-gqa-untied", "mistral-window24", "qwen2-bias", "qwen3-qknorm",
                                  "gemma3-mqa-window8", "llama-mha-hd80-tied"])
def test_reference_matches_hf_on_cuda(name, tiny_ckpt, random_prompt):
    from transformers import AutoModelForCausalLM

    from chunkwise.reference import Engine

    torch.backends.cuda.matmul.allow_tf32 = False
    family, overrides = CASES[name]
    path = tiny_ckpt(family, **overrides)
    eng = Engine(path, dtype="float32", device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).cuda()
    prompt = random_prompt(PROMPT_LEN, eng.model_config.vocab_size)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(eng.logits(prompt), hf(ids).logits[0], **LOGITS_TOL)
        theirs = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert eng.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids == theirs


@st.composite
def tiny_configs(draw):
    """A family and config overrides: GQA ratio, head_dim (odd multiples of 16 too), depth, ties, bias,
    windows and per-layer attention types."""
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]))
    kv_heads = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    # transformers insists that hidden_size be a multiple of the head count, whatever head_dim is.
    overrides = dict(num_key_value_heads=kv_heads, num_attention_heads=heads,
                     head_dim=draw(st.sampled_from([16, 32, 48, 80])), hidden_size=heads * draw(st.sampled_from([8, 16])),
                     num_hidden_layers=layers, tie_word_embeddings=draw(st.booleans()))
    if family in ("llama", "qwen3"):
        overrides["attention_bias"] = draw(st.booleans())
    if family == "mistral":
        overrides["sliding_window"] = draw(st.integers(1, 40))
    if family == "gemma3_text":
        overrides["sliding_window"] = draw(st.integers(1, 40))
        overrides["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                                 min_size=layers, max_size=layers))
    return family, overrides


@given(drawn=tiny_configs(), prompt_len=st.integers(1, 48), seed=st.integers(0, 3))
def test_logits_match_hf_for_drawn_configurations(drawn, prompt_len, seed, tiny_ckpt, random_prompt,
                                                  tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from chunkwise.reference import Engine

    family, overrides = drawn
    # Drawn configurations are one-offs: keep them out of the persistent checkpoint cache.
    path = tiny_ckpt(family, seed=seed, cache_dir=tmp_path_factory.getbasetemp() / "drawn", **overrides)
    eng = Engine(path, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    prompt = random_prompt(prompt_len, eng.model_config.vocab_size, seed)
    with torch.no_grad():
        torch.testing.assert_close(eng.logits(prompt), hf(torch.tensor([prompt])).logits[0], **LOGITS_TOL)
