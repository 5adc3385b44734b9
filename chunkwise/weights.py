"""Safetensors checkpoints (one file or sharded) loaded into a flat {HF tensor name: tensor} dict.

The names and shapes are checked against what the config implies (`expected_shapes`), so a checkpoint
that does not fit its config fails here with the offending tensor's name, not deep inside a matmul.
Tied embeddings: a checkpoint may still carry `lm_head.weight` (state dicts saved by hand, GGUF
conversions); it is accepted only when it equals `model.embed_tokens.weight` exactly, and dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from chunkwise.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Non-persistent buffers that older transformers versions saved; they hold nothing the config lacks.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` must hold, by HF name, with its shape."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q_out, h), "self_attn.k_proj.weight": (kv_out, h),
            "self_attn.v_proj.weight": (kv_out, h), "self_attn.o_proj.weight": (h, q_out),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if cfg.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                          "self_attn.v_proj.bias": (kv_out,)})
        if cfg.o_proj_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        if cfg.sandwich_norms:
            layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """{tensor name: safetensors file holding it}, from the shard index or the single file's header."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid shard index: {e}") from None
        files = {name: ckpt_dir / shard for name, shard in weight_map.items()}
        for name, f in files.items():
            if not f.is_file():
                raise ValueError(f"tensor {name!r} is mapped to {f.name}, which is missing from {ckpt_dir}")
        return files
    single = ckpt_dir / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {ckpt_dir}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"cannot read safetensors file {path}: {e}") from None


def _to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype!r} is not a torch floating-point dtype")
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating-point dtype name")
    return value


def load_weights(ckpt_dir: str | Path, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", cfg: ModelConfig | None = None,
                 shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in `ckpt_dir`, cast to `dtype` on `device`, checked against `cfg`
    (read from the directory's config.json when not given). Raises ValueError naming a missing,
    unexpected or wrongly shaped tensor, or an unreadable file. `shard(name, tensor)`, if given, replaces
    each tensor by the part of it this process keeps (a tensor-parallel rank's slice), as it is read, so
    only the slices are kept and moved to the device."""
    ckpt_dir = Path(ckpt_dir)
    cfg = cfg if cfg is not None else ModelConfig.from_dir(ckpt_dir)
    dtype = _to_dtype(dtype)
    expected = expected_shapes(cfg)
    files = {n: f for n, f in checkpoint_files(ckpt_dir).items() if not n.endswith(_IGNORED_SUFFIXES)}
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in files
    for name in sorted(files):
        if name not in expected and not (tied_head and name == "lm_head.weight"):
            raise ValueError(f"unexpected tensor {name!r} in {ckpt_dir} for a {cfg.model_type} config")
    for name in expected:
        if name not in files:
            raise ValueError(f"tensor {name!r} is missing from checkpoint {ckpt_dir}")

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with _open(path) as f:
            for name in f.keys():
                if files.get(name) != path:
                    continue
                try:
                    t = f.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as e:
                    raise ValueError(f"cannot read tensor {name!r} from {path}: {e}") from None
                want = expected.get(name, expected["model.embed_tokens.weight"])
                if tuple(t.shape) != want:
                    raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                                     f"from config.json")
                weights[name] = t if shard is None else shard(name, t)
    for name in files:
        if name not in weights:
            raise ValueError(f"tensor {name!r} is listed for {files[name].name} but that file lacks it")
    if tied_head:
        head = weights.pop("lm_head.weight")
        if not torch.equal(head, weights["model.embed_tokens.weight"]):
            raise ValueError("tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                             "but config.json sets tie_word_embeddings")
    return {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
