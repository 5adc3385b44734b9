"""open_config: an EngineConfig bound to its checkpoint, as both engines' constructors open it.

Building an `EngineConfig` only describes an engine. Opening it resolves the model (a built-in name may build
or convert a checkpoint into the cache), reads the checkpoint's ModelConfig and checks what depends on the
model or on the kernels: max_model_len against max_position_embeddings, tensor_parallel_size against the
model's shape, split_size against the split-KV tile, attention_backend="fa3" against the device and model.
"""
from __future__ import annotations

from chunkwise.checkpoints import resolve_model
from chunkwise.engine_config import EngineConfig
from chunkwise.kernels.fa3 import fa3_unavailable
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE, split_tile_config
from chunkwise.limits import LIMIT
from chunkwise.model_config import ModelConfig
from chunkwise.tokenizer import is_int


def open_config(config: EngineConfig) -> EngineConfig:
    """`config` opened: `path` and `model_config` set, `max_model_len` and `split_size` resolved."""
    path = resolve_model(config.model)
    model_config = ModelConfig.from_dir(path)
    limit = model_config.max_position_embeddings
    max_len = limit if config.max_model_len is None else config.max_model_len
    bound = LIMIT["max_model_len"]
    if not is_int(max_len) or not bound.admits(max_len, max_position_embeddings=limit):
        raise ValueError(f"max_model_len must be an integer in {bound.interval(max_position_embeddings=limit)} "
                         f"(max_position_embeddings), got {max_len!r}")
    _check_tensor_parallel_shape(config.tensor_parallel_size, model_config)
    if config.attention_backend == "fa3":
        why = fa3_unavailable(config.device, config.dtype, model_config.head_dim)
        if why is not None:
            raise ValueError(f"attention_backend='fa3' cannot run here: {why}")
    split_size = DEFAULT_SPLIT_SIZE if config.split_size is None else config.split_size
    block_n = split_tile_config(model_config.head_dim, 1)[1]   # the tile's keys depend on head_dim alone
    if not is_int(split_size) or not LIMIT["split_size"].admits(split_size, split_tile=block_n) \
            or split_size % block_n:
        raise ValueError(f"split_size must be a multiple of {block_n} (the split-KV tile for head_dim "
                         f"{model_config.head_dim}), got {split_size}")
    return config.opened(path, model_config, int(max_len), split_size)


def _check_tensor_parallel_shape(n: int, cfg: ModelConfig) -> None:
    """Refuses a tensor_parallel_size the model's shape cannot split into equal shards.

    Each rank takes num_heads / N query heads, intermediate_size / N of the MLP and a slice of the vocabulary
    (any size: the last slices are padded). KV heads are split when N divides their number, and replicated
    when their number divides N (rank r holds KV head r * num_kv_heads // N), so a rank's query heads all
    read one of its KV heads."""
    if n == 1:
        return
    for field_name, value in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if value % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {field_name}={value}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={n} and the model's num_key_value_heads={cfg.num_kv_heads}: "
                         f"one must divide the other (KV heads are split or replicated across ranks)")
