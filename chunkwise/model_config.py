"""Model configuration read from an HF `config.json`, for every family both engines serve.

Both engines read the same `ModelConfig`; neither looks at the raw JSON. Everything that differs between
families is a field here, so the model code has no `if family == ...` beyond what these fields say.
A field the config.json leaves out takes the value transformers' config class for the family gives it (its
defaults differ per family: Gemma 3's RoPE bases and query scalar, Mistral's window, EOS ids, context lengths),
so a checkpoint computes what transformers would compute from the same file.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ROPE_TYPES = ("default", "linear", "llama3")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2] in float32, with the checkpoint's scaling applied."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            # Meta's llama3 scaling: long wavelengths slowed by `factor`, short kept, smooth in between.
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str                      # "silu" or "gelu_pytorch_tanh" (gated MLP either way)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                 # bias on the q/k/v projections
    o_proj_bias: bool                    # bias on o_proj too (attention_bias in Llama, Qwen3, Gemma 3; never Qwen2)
    qk_norm: bool                        # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    layer_types: tuple[str, ...]         # FULL or SLIDING, one per layer
    sliding_window: int | None           # a SLIDING layer's query sees the last `sliding_window` positions
    rope: dict[str, RopeConfig]          # per layer type
    attn_scale: float                    # softmax scale
    embed_scale: float | None            # Gemma: embeddings times sqrt(hidden_size), rounded to the dtype
    norm_plus_one: bool                  # Gemma: RMSNorm weight applied as (1 + w)
    sandwich_norms: bool                 # Gemma: norms before and after both attention and MLP
    final_logit_softcapping: float | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_for(self, layer: int) -> RopeConfig:
        return self.rope[self.layer_types[layer]]

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in checkpoint directory {path.parent}")
        try:
            d = json.loads(path.read_bytes())
        except ValueError as e:   # JSONDecodeError and UnicodeDecodeError both are
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object of config fields")
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:   # TypeError: a field of the wrong JSON type, e.g. int([4])
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {FAMILIES}")
        gemma = model_type == "gemma3_text"

        def need(key: str):
            if d.get(key) is None:
                raise ValueError(f"config.json field {key!r} is missing (model_type {model_type!r})")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        for key, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                           ("num_key_value_heads", kv_heads), ("num_hidden_layers", layers)):
            if value < 1:
                raise ValueError(f"config.json field {key!r} must be >= 1, got {value}")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                                 f"and config.json has no 'head_dim'")
            head_dim = hidden // heads
        head_dim = int(head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE")
        _refuse_unsupported(d)

        theirs = _transformers_config(d, model_type)

        def field(key: str):
            """`key` as config.json gives it, or as transformers' config class defaults it when left out."""
            return d[key] if key in d else getattr(theirs, key, None)

        layer_types = tuple(d.get("layer_types") or _default_layer_types(d, model_type, layers, field))
        if len(layer_types) != layers or not set(layer_types) <= {FULL, SLIDING}:
            raise ValueError(f"config.json field 'layer_types' must list {layers} entries of {FULL!r} or "
                             f"{SLIDING!r}, got {list(layer_types)}")
        window = field("sliding_window")
        if SLIDING in layer_types and (window is None or int(window) < 1):
            raise ValueError(f"config.json field 'sliding_window' must be >= 1 for sliding layers, got {window}")

        if gemma:
            scale = float(field("query_pre_attn_scalar")) ** -0.5
        else:
            scale = head_dim ** -0.5
        act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"config.json activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        if d.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        attention_bias = bool(d.get("attention_bias", model_type == "qwen2"))
        eos = field("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(field("rms_norm_eps")),
            hidden_act=act, max_position_embeddings=int(field("max_position_embeddings")),
            tie_word_embeddings=bool(field("tie_word_embeddings")),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and model_type in ("llama", "qwen3", "gemma3_text"),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            layer_types=layer_types, sliding_window=int(window) if SLIDING in layer_types else None,
            rope=_rope_configs(d, model_type, getattr(theirs, "rope_parameters", None) or {}), attn_scale=scale,
            embed_scale=hidden ** 0.5 if gemma else None, norm_plus_one=gemma, sandwich_norms=gemma,
            final_logit_softcapping=d.get("final_logit_softcapping"),
            bos_token_id=field("bos_token_id"), eos_token_ids=eos_ids,
        )


def _refuse_unsupported(d: dict) -> None:
    """Gemma features neither engine implements, refused rather than silently computed without."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError(f"config.json field 'attn_logit_softcapping' is {d['attn_logit_softcapping']!r}; "
                         f"attention logit soft-capping is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"config.json field 'use_bidirectional_attention' is {d['use_bidirectional_attention']!r}; "
                         f"only causal attention is supported")


def _transformers_config(d: dict, model_type: str):
    """transformers' config class for `d`, as `from_pretrained` builds it: the oracle for every field `d` leaves out."""
    from transformers import AutoConfig
    kw = copy.deepcopy({k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})
    try:   # a copy: transformers fills in the nested dicts it is given (rope_parameters) in place
        return AutoConfig.for_model(model_type, **kw)
    except Exception as e:   # its validation errors are not all ValueErrors (huggingface_hub's strict dataclasses)
        raise ValueError(f"transformers refuses this {model_type} config: {e}") from None


def _default_layer_types(d: dict, model_type: str, layers: int, field) -> list[str]:
    """Layer types for configs written before `layer_types` existed (transformers 4); `field(key)` reads a field
    of the config, or transformers' default for it."""
    if model_type == "mistral":
        return [SLIDING if field("sliding_window") else FULL] * layers
    if model_type in ("qwen2", "qwen3"):
        first = int(field("max_window_layers"))
        return [SLIDING if d.get("use_sliding_window") and i >= first else FULL for i in range(layers)]
    if model_type == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern", 6))
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    return [FULL] * layers


def _rope_configs(d: dict, model_type: str, theirs: dict) -> dict[str, RopeConfig]:
    """RoPE per layer type, from transformers 5's `rope_parameters` or 4's `rope_theta`/`rope_scaling`; what they
    leave out (a base, llama3's original context, a layer type's parameters) is what transformers resolved,
    `theirs` (its `rope_parameters`: per layer type for Gemma 3, flat otherwise)."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params["rope_theta"] = d.get("rope_theta")
        if model_type == "gemma3_text":
            params = {FULL: params, SLIDING: {"rope_theta": d.get("rope_local_base_freq")}}
    if FULL not in params and SLIDING not in params:
        params = {FULL: params, SLIDING: params}
    resolved = {kind: theirs.get(kind, theirs) for kind in (FULL, SLIDING)}
    return {kind: _rope(params.get(kind) or resolved[kind], resolved[kind]) for kind in (FULL, SLIDING)}


def _rope(p: dict, resolved: dict) -> RopeConfig:
    rope_type = p.get("rope_type") or p.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    kw = {k: p[k] if p.get(k) is not None else resolved.get(k)
          for k in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    theta = kw.pop("rope_theta")
    if theta is None:   # transformers 5 resolves every base; kept for a version that leaves one out
        raise ValueError("config.json field 'rope_theta' is missing")
    return RopeConfig(theta=float(theta), rope_type=rope_type, **{k: v for k, v in kw.items() if v is not None})
