"""Engine arguments and requests, validated the same way for both engines.

Only the interface lives here (what a caller may pass and the errors it gets); each engine keeps its own
model code, so a compute bug cannot hide in a shared module.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from chunkwise.checkpoints import resolve_model
from chunkwise.config import ModelConfig
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import encode_prompts, is_int, load_tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Checkpoint:
    """What an engine opens: the checkpoint with its config and tokenizer, and the validated common args."""
    path: Path
    config: ModelConfig
    tokenizer: object | None
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


def open_checkpoint(model, dtype, device, page_size, max_model_len) -> Checkpoint:
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    elif dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    path = resolve_model(model)
    config = ModelConfig.from_dir(path)
    limit = config.max_position_embeddings
    max_model_len = limit if max_model_len is None else max_model_len
    if not is_int(max_model_len) or not 2 <= max_model_len <= limit:
        raise ValueError(f"max_model_len must be an integer in [2, {limit}] (max_position_embeddings), "
                         f"got {max_model_len!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return Checkpoint(path, config, load_tokenizer(path), dtype, device, int(max_model_len))


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    chunk_sizes: list[int] | None   # the caller's prefill chunk lengths, summing to the prompt length


def prepare_requests(ckpt: Checkpoint, prompts, sampling_params=None, chunk_sizes=None) -> list[Request]:
    """Validated requests for a batch: every prompt, sampling params and chunking is checked before any
    engine touches one, so a bad request raises ValueError (naming the prompt index) and disturbs nothing."""
    ids = encode_prompts(prompts, ckpt.tokenizer, ckpt.config)
    n = len(ids)
    params = per_prompt(sampling_params, n, "sampling_params", lambda v: v is None or isinstance(v, SamplingParams))
    if n == 1 and isinstance(chunk_sizes, (list, tuple)) and chunk_sizes and all(is_int(c) for c in chunk_sizes):
        chunk_sizes = [chunk_sizes]   # one prompt's flat list of chunk lengths
    chunks = per_prompt(chunk_sizes, n, "chunk_sizes", lambda v: v is None or is_int(v))
    requests = []
    for i, (tokens, p, c) in enumerate(zip(ids, params, chunks)):
        p = p if p is not None else SamplingParams()
        if len(tokens) + p.max_tokens > ckpt.max_model_len:
            raise ValueError(f"prompt {i}: {len(tokens)} tokens + max_tokens {p.max_tokens} exceed "
                             f"max_model_len {ckpt.max_model_len}")
        requests.append(Request(tokens, p, expand_chunk_sizes(c, len(tokens), i)))
    return requests


def per_prompt(value, n: int, name: str, is_one) -> list:
    """`value` for each of n prompts: one value shared by all, or a list of exactly n."""
    if is_one(value):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def expand_chunk_sizes(chunk_sizes, prompt_len: int, index: int) -> list[int] | None:
    """One prompt's chunk lengths from None, an int (fixed chunk length) or an explicit list."""
    if chunk_sizes is None:
        return None
    if is_int(chunk_sizes):
        if chunk_sizes < 1:
            raise ValueError(f"prompt {index}: chunk size {chunk_sizes} must be >= 1")
        full, rest = divmod(prompt_len, chunk_sizes)
        return [int(chunk_sizes)] * full + ([rest] if rest else [])
    sizes = list(chunk_sizes)
    for c in sizes:
        if not is_int(c) or c < 1:
            raise ValueError(f"prompt {index}: chunk size {c!r} in {sizes} is not an integer >= 1")
    if sum(sizes) != prompt_len:
        raise ValueError(f"prompt {index}: chunk sizes {sizes} sum to {sum(sizes)}, not the prompt length "
                         f"{prompt_len}")
    return [int(c) for c in sizes]
