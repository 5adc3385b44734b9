"""Checkpoints by name: tiny random ones written by HF transformers itself, and the real ones.

`tiny_checkpoint(family, seed, **overrides)` builds `XConfig(...)`, instantiates the model with
`AutoModelForCausalLM.from_config` under a fixed seed and saves it with `save_pretrained`, so the tensor
names and layouts come from transformers, not from this project. Directories are cached under
$CHUNKWISE_CACHE (default ~/.cache/chunkwise), keyed by a hash of the arguments, through
`chunkwise.checkpoint_cache.cached_dir` (the one build-once-and-rename logic, shared with the real checkpoints).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from chunkwise import real_checkpoints
from chunkwise.checkpoint_cache import cache_root, cached_dir

TINY_NAMES = {"tiny-llama": "llama", "tiny-mistral": "mistral", "tiny-qwen2": "qwen2",
              "tiny-qwen3": "qwen3", "tiny-gemma3": "gemma3_text"}
REAL_NAMES = tuple(real_checkpoints.CHECKPOINTS)
FAMILY_ALIASES = {"gemma3": "gemma3_text"}

# Bump when the factory's defaults or output change, so stale cached directories are not reused.
# (2: directories are built through cached_dir, with its marker file; 3: random norm weights and biases.)
_FACTORY_VERSION = 3
NORM_WEIGHT_STD = 0.1   # transformers initialises norm weights to 1 (Gemma's to 0) and biases to 0

TINY_VOCAB_SIZE = 384   # ids 0..2 are pad, bos and eos
_COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# initializer_range 0.1 gives varied greedy output for these four; Gemma 3 collapses there, and its
# default 0.02 works (measured with transformers' own init: 16-24 distinct tokens in 24 greedy steps).
_DEFAULTS = {
    "llama": dict(_COMMON, initializer_range=0.1, tie_word_embeddings=False),
    "mistral": dict(_COMMON, initializer_range=0.1, tie_word_embeddings=False, sliding_window=24),
    "qwen2": dict(_COMMON, initializer_range=0.1, tie_word_embeddings=False),
    "qwen3": dict(_COMMON, initializer_range=0.1, tie_word_embeddings=False),
    "gemma3_text": dict(_COMMON, initializer_range=0.02, num_key_value_heads=1, query_pre_attn_scalar=32,
                        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        tie_word_embeddings=True),
}


def _family(family: str) -> str:
    family = FAMILY_ALIASES.get(family, family)
    if family not in _DEFAULTS:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(_DEFAULTS)}")
    return family


def tiny_config_dict(family: str, **overrides) -> dict:
    """The keyword arguments given to the family's HF config class."""
    kw = dict(_DEFAULTS[_family(family)])
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" in kw and "layer_types" not in overrides:
        # Gemma's default pattern: every other layer slides, the last one attends fully.
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i % 2 or i == n - 1) else "sliding_attention"
                             for i in range(n)]
    return kw


def tiny_checkpoint(family: str, seed: int = 0, cache_dir: str | Path | None = None, **overrides) -> Path:
    """A cached directory holding a tiny random float32 checkpoint of `family`, written by transformers.
    `cache_dir` replaces `cache_root()/tiny`, e.g. a temporary one for one-off drawn configurations."""
    family = _family(family)
    kw = tiny_config_dict(family, **overrides)
    key = json.dumps({"v": _FACTORY_VERSION, "family": family, "seed": seed, "config": kw}, sort_keys=True)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny"
    path = root / f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return cached_dir(path, key, lambda out: _write_tiny(family, seed, kw, out))


def _write_tiny(family: str, seed: int, kw: dict, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        # Norm weights and biases are drawn too, not left at transformers' constant init: an engine that
        # swapped q_norm with k_norm, or added a bias twice, would otherwise compute the same numbers.
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(".bias") or (name.endswith("norm.weight") and name != "model.norm.weight"):
                p.add_(NORM_WEIGHT_STD * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        # A large final-norm weight scales the logits, widening top-2 margins without changing argmax.
        # Gemma applies the weight as (1 + w), so 7 there is the same factor 8.
        model.model.norm.weight.fill_(7.0 if family == "gemma3_text" else 8.0)
    model.save_pretrained(out, safe_serialization=True)


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A checkpoint directory from a path, a tiny name ("tiny-llama", ...) or a real name ("gemma3-270m", ...)."""
    name = str(name_or_path)
    if name in TINY_NAMES:
        return tiny_checkpoint(TINY_NAMES[name])
    if name in REAL_NAMES:
        return real_checkpoints.ensure_converted(name)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint directory {path} has no config.json")
        return path
    raise ValueError(f"model {name!r} is neither a checkpoint directory nor a built-in name "
                     f"{sorted(TINY_NAMES) + list(REAL_NAMES)}")
