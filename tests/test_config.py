"""ModelConfig from HF config.json: every family, RoPE scaling against transformers' own, bad configs; every RoPE
layout (transformers 4 and 5, flat and per layer type) and every field, read as transformers' own config classes,
rotary embeddings and models read them."""
import json

import pytest
import torch

from chunkwise.checkpoints import tiny_config_dict
from chunkwise.model_config import FULL, SLIDING, ModelConfig
from chunkwise.weights import expected_shapes

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
    ({"hidden_size": 66, "head_dim": None}, "hidden_size=66 is not divisible by num_attention_heads=4"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": -1}, "num_key_value_heads"),
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


# --- every layout and field, read as transformers' own config classes and modules read it ------------------------

def hf_config(d: dict):
    """transformers' config class for `d` (a config.json as a dict), as from_pretrained would build it."""
    from transformers import AutoConfig
    return AutoConfig.for_model(d["model_type"], **{k: v for k, v in json.loads(json.dumps(d)).items()
                                                     if k not in ("model_type", "transformers_version")})


def hf_model_on_meta(d: dict):
    """transformers' model of `d` with no storage (shapes only), and its config."""
    from transformers import AutoModelForCausalLM
    config = hf_config(d)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), config


def v4_layout(family: str, rope_theta=None, rope_scaling=None, **fields) -> dict:
    """A config.json in transformers 4's layout: rope_theta and rope_scaling at the top, no rope_parameters."""
    d = hf_config_dict(family, **fields)
    d.pop("rope_parameters", None)
    d.update({k: v for k, v in (("rope_theta", rope_theta), ("rope_scaling", rope_scaling)) if v is not None})
    return d


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GEMMA_LOCAL = {"rope_local_base_freq": 10000.0}
ROPE_LAYOUTS = {
    # transformers 5: rope_parameters, flat
    "llama-v5-default": lambda: hf_config_dict("llama", rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "llama-v5-linear": lambda: hf_config_dict("llama", rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                        "factor": 4.0}),
    "llama-v5-llama3": lambda: hf_config_dict("llama", rope_parameters=dict(LLAMA3)),
    "llama-v5-llama3-factors": lambda: hf_config_dict("llama", rope_parameters=dict(
        LLAMA3, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=128)),
    "qwen2-v5-theta": lambda: hf_config_dict("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mistral-v5-linear": lambda: hf_config_dict("mistral", rope_parameters={"rope_type": "linear",
                                                                            "rope_theta": 1e6, "factor": 2.0}),
    # transformers 4: rope_theta and rope_scaling ("type" or "rope_type"), or no scaling at all
    "llama-v4-plain": lambda: v4_layout("llama", 5e5),
    "llama-v4-null-scaling": lambda: dict(v4_layout("llama", 5e5), rope_scaling=None),
    "llama-v4-default-scaling": lambda: v4_layout("llama", 5e5, {"rope_type": "default"}),
    "llama-v4-linear-type": lambda: v4_layout("llama", 5e5, {"type": "linear", "factor": 2.0}),
    "llama-v4-llama3": lambda: v4_layout("llama", 5e5, {k: v for k, v in LLAMA3.items() if k != "rope_theta"}),
    "qwen3-v4-linear": lambda: v4_layout("qwen3", 1e6, {"rope_type": "linear", "factor": 4.0}),
    "mistral-v4-plain": lambda: v4_layout("mistral", 1e6),
    # Gemma 3, transformers 4: the scaling and rope_theta are the full layers', rope_local_base_freq the sliding ones'
    "gemma3-v4-plain": lambda: v4_layout("gemma3_text", 1e6, **GEMMA_LOCAL),
    "gemma3-v4-linear": lambda: v4_layout("gemma3_text", 1e6, {"rope_type": "linear", "factor": 8.0}, **GEMMA_LOCAL),
    "gemma3-v4-llama3": lambda: v4_layout("gemma3_text", 1e6, {k: v for k, v in LLAMA3.items() if k != "rope_theta"},
                                          rope_local_base_freq=20000.0),
    "gemma3-v4-no-local-base": lambda: v4_layout("gemma3_text", 1e6, {"rope_type": "linear", "factor": 8.0}),
    "gemma3-v4-pattern-3": lambda: v4_layout("gemma3_text", 1e6, {"rope_type": "linear", "factor": 4.0},
                                             num_hidden_layers=7, layer_types=None, sliding_window_pattern=3,
                                             **GEMMA_LOCAL),
    # Gemma 3, transformers 5: rope_parameters per layer type, one of them possibly absent
    "gemma3-v5-linear-full": lambda: hf_config_dict("gemma3_text", rope_parameters={
        FULL: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma3-v5-full-only": lambda: hf_config_dict("gemma3_text", rope_parameters={
        FULL: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
    "gemma3-v5-sliding-only": lambda: hf_config_dict("gemma3_text", rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 5e4}}),
    "gemma3-v5-llama3-full": lambda: hf_config_dict("gemma3_text", rope_parameters={
        FULL: dict(LLAMA3), SLIDING: {"rope_type": "default", "rope_theta": 1e4}}),
}


def hf_inv_freq(model, config, layer_type: str) -> torch.Tensor:
    """The inverse frequencies transformers' rotary embedding gives `layer_type`'s layers (its own class, on the CPU),
    after checking it applies no attention scaling (which ModelConfig has no field for)."""
    rotary = type(model.model.rotary_emb)(config)   # built outside the meta context: on the CPU
    per_type = hasattr(rotary, f"{layer_type}_inv_freq")
    scaling = getattr(rotary, f"{layer_type}_attention_scaling" if per_type else "attention_scaling")
    assert scaling == 1.0, scaling
    return getattr(rotary, f"{layer_type}_inv_freq" if per_type else "inv_freq").float()


@pytest.mark.parametrize("layout", list(ROPE_LAYOUTS))
def test_every_rope_layout_gives_each_layer_the_inverse_frequencies_transformers_gives_it(layout):
    """RoPE from every config.json layout transformers reads (5's rope_parameters, flat or per layer type; 4's
    rope_theta + rope_scaling with "type" or "rope_type"; Gemma 3's rope_local_base_freq): each layer's inverse
    frequencies are those of transformers' own rotary embedding for that layer's type."""
    d = ROPE_LAYOUTS[layout]()
    cfg = ModelConfig.from_dict(json.loads(json.dumps(d)))
    model, config = hf_model_on_meta(d)
    assert list(cfg.layer_types) == list(getattr(config, "layer_types", None) or cfg.layer_types)
    for i, layer_type in enumerate(cfg.layer_types):
        torch.testing.assert_close(cfg.rope_for(i).inv_freq(cfg.head_dim), hf_inv_freq(model, config, layer_type),
                                   rtol=1e-6, atol=0, msg=lambda m: f"layer {i} ({layer_type}): {m}")


def test_the_rope_layouts_differ_where_their_scaling_does():
    """The layouts above are not all one RoPE: the scaled ones move the frequencies, and Gemma's two layer types
    differ, so the comparison with transformers would see a scaling applied to the wrong layers or not at all."""
    def freqs(layout: str, layer: int) -> torch.Tensor:
        cfg = ModelConfig.from_dict(ROPE_LAYOUTS[layout]())
        return cfg.rope_for(layer).inv_freq(cfg.head_dim)
    assert not torch.equal(freqs("llama-v4-plain", 0), freqs("llama-v4-linear-type", 0))
    assert not torch.equal(freqs("llama-v4-plain", 0), freqs("llama-v4-llama3", 0))
    assert not torch.equal(freqs("llama-v5-llama3", 0), freqs("llama-v5-llama3-factors", 0))
    assert not torch.equal(freqs("gemma3-v4-plain", 1), freqs("gemma3-v4-linear", 1))       # layer 1 is full
    assert torch.equal(freqs("gemma3-v4-plain", 0), freqs("gemma3-v4-linear", 0))           # layer 0 slides


ABSENT = object()   # a field left out of config.json (transformers' default then applies)
FIELD_CASES = {
    **{family: (family, {}) for family in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")},
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "gemma3-attention-bias": ("gemma3_text", {"attention_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "gemma3-untied": ("gemma3_text", {"tie_word_embeddings": False}),
    "llama-head-dim-32": ("llama", {"head_dim": 32}),
    "llama-mha-no-kv-field": ("llama", {"num_key_value_heads": ABSENT}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-gelu": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "llama-eos-list": ("llama", {"eos_token_id": [2, 7], "bos_token_id": 5}),
    "llama-eps": ("llama", {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}),
    "gemma3-softcap-scalar": ("gemma3_text", {"final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64}),
    "gemma3-3-layers": ("gemma3_text", {"num_hidden_layers": 3, "sliding_window": 4}),
    "mistral-null-window": ("mistral", {"sliding_window": None}),
    "llama-no-head-dim-field": ("llama", {"head_dim": ABSENT}),
    "gemma3-no-tie-field": ("gemma3_text", {"tie_word_embeddings": ABSENT}),
    "qwen2-sliding": ("qwen2", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 1, "layer_types": ABSENT}),
    "qwen3-sliding-unused": ("qwen3", {"use_sliding_window": False, "sliding_window": 8, "layer_types": ABSENT}),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_every_config_field_reads_as_transformers_reads_it(case):
    """Each field a config.json may set (biases, tying, head_dim, GQA/MQA/MHA, activation, EOS ids, eps, Gemma's
    soft-capping and query scalar, sliding windows) is read as transformers' config class reads it, and the tensors
    the engines expect are the names and shapes of transformers' model built from it."""
    family, overrides = FIELD_CASES[case]
    d = hf_config_dict(family, **{k: v for k, v in overrides.items() if v is not ABSENT})
    assert_reads_as_transformers({k: v for k, v in d.items() if overrides.get(k) is not ABSENT})


def assert_reads_as_transformers(d: dict) -> None:
    """ModelConfig of config.json `d` holds what transformers' config class, rotary embeddings and model read from
    it: every field, each layer's type, window and RoPE frequencies, and the checkpoint's tensor names and shapes."""
    cfg = ModelConfig.from_dict(json.loads(json.dumps(d)))
    model, theirs = hf_model_on_meta(d)
    eos = theirs.eos_token_id
    layer_types = getattr(theirs, "layer_types", None) or [
        SLIDING if getattr(theirs, "sliding_window", None) else FULL] * theirs.num_hidden_layers
    assert cfg.layer_types == tuple(layer_types)
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [
        theirs.sliding_window if t == SLIDING else None for t in layer_types]
    gemma = d["model_type"] == "gemma3_text"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.hidden_size,
        theirs.intermediate_size)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.tie_word_embeddings)
    assert cfg.hidden_act == (theirs.hidden_activation if gemma else theirs.hidden_act)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, tuple(eos) if isinstance(eos, list)
                                                     else () if eos is None else (eos,))
    assert cfg.attn_scale == pytest.approx((theirs.query_pre_attn_scalar if gemma else theirs.head_dim) ** -0.5,
                                           rel=1e-12)
    assert cfg.final_logit_softcapping == getattr(theirs, "final_logit_softcapping", None)
    assert (cfg.embed_scale is not None, cfg.norm_plus_one, cfg.sandwich_norms) == (gemma, gemma, gemma)
    for i, layer_type in enumerate(cfg.layer_types):
        torch.testing.assert_close(cfg.rope_for(i).inv_freq(cfg.head_dim), hf_inv_freq(model, config=theirs,
                                   layer_type=layer_type), rtol=1e-6, atol=0, msg=lambda m: f"layer {i}: {m}")
    theirs_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if theirs.tie_word_embeddings:
        del theirs_shapes["lm_head.weight"]   # the same tensor as the embedding; checkpoints hold it once
    assert expected_shapes(cfg) == theirs_shapes


def without(d: dict, *paths: str) -> dict:
    """`d` with each dotted path ("rope_parameters.full_attention") left out."""
    d = json.loads(json.dumps(d))
    for path in paths:
        *outer, last = path.split(".")
        node = d
        for key in outer:
            node = node[key]
        node.pop(last, None)
    return d


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq")
QWEN_SLIDING = dict(num_hidden_layers=30, use_sliding_window=True, sliding_window=8, max_window_layers=3)
# case: (family, fields given to transformers' config class, fields then left out of its config.json, transformers
# 4 fields then added to it, which transformers 5 would have rewritten had they been given to its config class)
LEFT_OUT = {
    # Every family, each optional field (the families' defaults differ: context length, EOS/BOS, window, RoPE base)
    **{f"{family}-no-{name}": (family, {}, fields) for family in FAMILIES for name, fields in (
        ("max_position_embeddings", ("max_position_embeddings",)),
        ("bos_token_id", ("bos_token_id",)), ("eos_token_id", ("eos_token_id",)),
        ("rope", ROPE_FIELDS), ("rms_norm_eps", ("rms_norm_eps",)),
        ("tie_word_embeddings", ("tie_word_embeddings",)), ("sliding_window", ("sliding_window",)))},
    "gemma3-no-query_pre_attn_scalar": ("gemma3_text", {}, ("query_pre_attn_scalar",)),
    "gemma3-v4-no-rope_theta": ("gemma3_text", {}, ROPE_FIELDS, {
        "rope_local_base_freq": 5e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "gemma3-v4-no-rope_local_base_freq": ("gemma3_text", {}, ROPE_FIELDS, {"rope_theta": 5e5}),
    "gemma3-v5-no-sliding-rope": ("gemma3_text", {"rope_parameters": {FULL: {"rope_type": "linear", "rope_theta": 1e6,
                                                                              "factor": 8.0}}},
                                  (f"rope_parameters.{SLIDING}",)),
    "gemma3-v5-no-full-rope": ("gemma3_text", {"rope_parameters": {SLIDING: {"rope_type": "default",
                                                                             "rope_theta": 5e4}}},
                               (f"rope_parameters.{FULL}",)),
    "llama-linear-no-rope_theta": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5,
                                                                 "factor": 2.0}}, ("rope_parameters.rope_theta",)),
    "llama-llama3-no-original-context": ("llama", {"rope_parameters": dict(LLAMA3), "max_position_embeddings": 512},
                                         ("rope_parameters.original_max_position_embeddings",)),
    "gemma3-llama3-no-original-context": (
        "gemma3_text", {"rope_parameters": {FULL: dict(LLAMA3), SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
                        "max_position_embeddings": 512},
        (f"rope_parameters.{FULL}.original_max_position_embeddings",)),
    **{f"{family}-sliding-no-max_window_layers": (family, QWEN_SLIDING, ("max_window_layers", "layer_types"))
       for family in ("qwen2", "qwen3")},
    **{f"{family}-sliding-no-window": (family, dict(QWEN_SLIDING), ("sliding_window", "layer_types"))
       for family in ("qwen2", "qwen3")},
}


@pytest.mark.parametrize("case", list(LEFT_OUT))
def test_a_field_left_out_reads_as_transformers_defaults_it(case):
    """A config.json that leaves a field out (each optional field of each family) gives the ModelConfig that
    transformers' own config class gives the same file: its family's default, not one of ours."""
    family, overrides, fields, *v4_fields = LEFT_OUT[case]
    d = without(hf_config_dict(family, **overrides), *fields)
    assert_reads_as_transformers(dict(d, **(v4_fields[0] if v4_fields else {})))


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)])
def test_an_unimplemented_gemma_feature_is_refused_naming_its_field(field, value):
    d = dict(hf_config_dict("gemma3_text"), **{field: value})
    with pytest.raises(ValueError, match=f"{field}.*{value}"):
        ModelConfig.from_dict(d)


def test_reading_a_config_leaves_its_dict_as_given():
    """transformers fills in the rope_parameters it is handed; ModelConfig gives it a copy, so the caller's dict
    (and a later read of it) is what the config.json said."""
    d = without(hf_config_dict("gemma3_text", rope_parameters={FULL: dict(LLAMA3)}),
                f"rope_parameters.{FULL}.original_max_position_embeddings")
    before = json.loads(json.dumps(d))
    ModelConfig.from_dict(d)
    assert d == before
