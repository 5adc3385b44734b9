"""ModelConfig from HF config.json: every family, RoPE scaling against transformers' own, bad configs."""
import json

import pytest
import torch

from chunkwise.checkpoints import tiny_config_dict
from chunkwise.model_config import FULL, SLIDING, ModelConfig

pytestmark = pytest.mark.correctness


def hf_config_dict(family: str, **overrides) -> dict:
    """The config.json transformers writes for a tiny checkpoint (no weights are made)."""
    from transformers import AutoConfig
    return json.loads(AutoConfig.for_model(family, **tiny_config_dict(family, **overrides)).to_json_string())


@pytest.mark.parametrize("family,bias,qk_norm,tied", [
    ("llama", False, False, False), ("mistral", False, False, False), ("qwen2", True, False, False),
    ("qwen3", False, True, False), ("gemma3_text", False, True, True)])
def test_each_family_parses_its_transformers_config(family, bias, qk_norm, tied):
    cfg = ModelConfig.from_dict(hf_config_dict(family))
    assert (cfg.model_type, cfg.attention_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (family, bias, qk_norm, tied)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 16, 384)
    gemma = family == "gemma3_text"
    assert cfg.num_kv_heads == (1 if gemma else 2)
    assert (cfg.norm_plus_one, cfg.sandwich_norms, cfg.embed_scale is not None) == (gemma, gemma, gemma)
    assert cfg.hidden_act == ("gelu_pytorch_tanh" if gemma else "silu")
    assert cfg.attn_scale == pytest.approx(32 ** -0.5 if gemma else 16 ** -0.5)
    assert cfg.eos_token_ids == (2,)


def test_gemma3_layer_types_window_and_per_type_rope_base():
    cfg = ModelConfig.from_dict(hf_config_dict("gemma3_text"))
    assert cfg.layer_types == (SLIDING, FULL)
    assert (cfg.window(0), cfg.window(1)) == (8, None)
    assert cfg.rope_for(0).theta == 10000.0 and cfg.rope_for(1).theta == 1000000.0


@pytest.mark.parametrize("family,fields", [
    ("gemma3_text", {"num_hidden_layers": 12}),                               # transformers 4's default pattern 6
    ("gemma3_text", {"num_hidden_layers": 7, "sliding_window_pattern": 3}),
    ("gemma3_text", {"num_hidden_layers": 5, "sliding_window_pattern": 1}),
    ("qwen2", {"num_hidden_layers": 6, "use_sliding_window": True, "max_window_layers": 2, "sliding_window": 8}),
    ("qwen3", {"num_hidden_layers": 5, "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 8}),
])
def test_layer_types_of_a_config_without_them_are_what_transformers_derives(family, fields):
    """A config.json written before `layer_types` existed (transformers 4) gets the layer types transformers
    derives from the same fields (its config class is the oracle: the reference shares this parser)."""
    d = hf_config_dict(family, layer_types=None, **fields)   # None: transformers derives them
    want = d.pop("layer_types")
    assert list(ModelConfig.from_dict(d).layer_types) == want


def test_mistral_window_applies_to_every_layer():
    cfg = ModelConfig.from_dict(hf_config_dict("mistral"))
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [24, 24]


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
])
def test_scaled_rope_inverse_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = hf_config_dict("llama", rope_parameters=rope)
    ours = ModelConfig.from_dict(d).rope_for(0).inv_freq(16)
    theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](LlamaConfig(**tiny_config_dict("llama", rope_parameters=rope)),
                                                       "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = ModelConfig.from_dict(hf_config_dict("llama", rope_parameters={"rope_theta": rope["rope_theta"]}))
    assert not torch.equal(ours, plain.rope_for(0).inv_freq(16))   # the scaling is not a no-op here


def test_transformers4_style_rope_scaling_is_read():
    d = hf_config_dict("llama")
    del d["rope_parameters"]
    d.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    rope = ModelConfig.from_dict(d).rope_for(0)
    assert (rope.theta, rope.rope_type, rope.factor) == (5e5, "linear", 2.0)


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gpt2"}, "gpt2"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"head_dim": 15}, "head_dim=15"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ({"hidden_act": "relu"}, "relu"),
])
def test_bad_config_raises_value_error_naming_the_field(change, field):
    d = hf_config_dict("llama")
    d.update(change)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(d)


def test_sliding_layers_without_a_window_are_rejected():
    d = hf_config_dict("gemma3_text")
    d["sliding_window"] = None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dict(d)


def test_missing_config_json_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("content,message", [
    (b"{not json", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
    (b"[1, 2]", "holds a JSON list"),
    (b'"llama"', "holds a JSON str"),
    (json.dumps(dict(hf_config_dict("llama"), hidden_size=[64])).encode(), "hidden_size|list"),
])
def test_unreadable_config_json_is_a_value_error_naming_its_path(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_transformers4_gemma3_scales_only_its_full_layers_rope_as_transformers_does():
    """A Gemma 3 config.json in transformers 4's layout (rope_theta, rope_scaling, rope_local_base_freq): the
    scaling belongs to the full-attention layers only, as transformers' own config reads it."""
    from transformers import Gemma3TextConfig

    d = hf_config_dict("gemma3_text")
    d.pop("rope_parameters", None)
    d.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000.0)
    theirs = Gemma3TextConfig(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})
    cfg = ModelConfig.from_dict(d)
    for i, layer_type in enumerate(cfg.layer_types):
        want = theirs.rope_parameters[layer_type]
        rope = cfg.rope_for(i)
        assert (rope.theta, rope.rope_type, rope.factor) == (want["rope_theta"], want["rope_type"],
                                                             want.get("factor", 1.0)), layer_type
