"""Engine arguments and requests, validated the same way for both engines.

Only the interface lives here (what a caller may pass and the errors it gets); each engine keeps its own
model code, so a compute bug cannot hide in a shared module.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkwise.chunks import Blend, ChunkRegistry, Piece, check_reuse, is_composite
from chunkwise.limits import LIMIT
from chunkwise.model_config import ModelConfig
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import as_prompt_list, encode_prompts, is_int, is_single_prompt


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    chunk_sizes: list[int] | None   # the caller's prefill chunk lengths, summing to the prompt length
    pieces: tuple[Piece, ...] | None = None   # a composite prompt's pieces, in order (chunkwise/chunks.py)
    reuse: str | Blend = "exact"              # "exact" or the Blend asked for ("blend" resolved to DEFAULT_BLEND)
    # A composite prompt's ids as one int64 array, joined from its chunks' arrays (made once per chunk): the page
    # pool takes its bytes from it instead of from a pass over prompt_token_ids. None for a plain prompt.
    prompt_array: np.ndarray | None = None


def validate_requests(model_config: ModelConfig, tokenizer, max_model_len: int, prompts, sampling_params=None,
                      chunk_sizes=None, reuse="exact", chunks: ChunkRegistry | None = None) -> list[Request]:
    """Validated requests for a batch: every prompt, sampling params and chunking is checked before any
    engine touches one, so a bad request raises (naming the prompt index) and disturbs nothing.

    `chunk_sizes`: None, one int for every prompt, or one entry per prompt (None, an int, or a list of
    chunk lengths). For a batch (a list of prompts) a flat list of ints always means one int per prompt,
    whatever the batch's size; for a single prompt (a string or one list of ids) it is that prompt's chunks.

    A composite prompt (a Chunk, or a list holding one, mixed with text and id lists; chunkwise/chunks.py) is
    the concatenation of its pieces, checked against `chunks` (the engine's registry), and is split into prefill
    chunks as a plain prompt is: by the token budget, or by `chunk_sizes` if given (its pieces' boundaries matter
    to the prefix cache and the `chunk_reuse` report, not to the steps). `reuse`: one mode ("exact", "blend" or a
    Blend) or one per prompt.
    """
    if (is_single_prompt(prompts) or is_composite(prompts)) and isinstance(chunk_sizes, (list, tuple)):
        chunk_sizes = [chunk_sizes]
    prompts = [prompts] if is_composite(prompts) else as_prompt_list(prompts)
    pieces: list[tuple[Piece, ...] | None] = [None] * len(prompts)
    arrays: dict[int, np.ndarray] = {}
    for i, p in enumerate(prompts):
        if is_composite(p):
            if chunks is None:
                raise ValueError(f"prompt {i} holds chunks, which this engine does not take")
            prompts[i], pieces[i] = chunks.pieces(p, tokenizer, i)
            arrays[i] = chunks.ids_array(prompts[i], pieces[i])
    ids = encode_prompts(prompts, tokenizer, model_config, arrays)
    n = len(ids)
    modes = per_prompt(reuse, n, "reuse", lambda v: isinstance(v, (str, Blend)), "a reuse mode or one per prompt")
    params = per_prompt(sampling_params, n, "sampling_params", is_params, "a SamplingParams or one per prompt")
    sizes = per_prompt(chunk_sizes, n, "chunk_sizes", is_chunking,
                        "None, an int, or one entry per prompt (None, an int or a list of chunk lengths)")
    requests = []
    for i, (tokens, p, c, pc, mode) in enumerate(zip(ids, params, sizes, pieces, modes)):
        p = p if p is not None else SamplingParams()
        check_against_vocab(p, model_config.vocab_size, i)
        mode = check_reuse(mode, i)
        if not LIMIT["request_tokens"].admits(len(tokens) + p.max_tokens, max_model_len=max_model_len):
            raise ValueError(f"prompt {i}: {len(tokens)} tokens + max_tokens {p.max_tokens} exceed "
                             f"max_model_len {max_model_len}")
        if mode != "exact" and c is not None:
            raise ValueError(f"prompt {i}: chunk_sizes={c!r:.80} cannot be combined with reuse={mode!r}: a blended "
                             f"prompt is prefilled in one step (its recompute is chosen over the whole prompt)")
        if mode != "exact" and pc is not None:
            c = [len(tokens)]
        requests.append(Request(tokens, p, expand_chunk_sizes(c, len(tokens), i), pc, mode, arrays.get(i)))
    return requests


def check_against_vocab(params: SamplingParams, vocab_size: int, index: int) -> None:
    """The sampling fields that depend on the model: logprobs and top_k counts, stop token ids."""
    for name in ("logprobs", "top_k"):
        value = getattr(params, name)
        if value is not None and not LIMIT[name].below_upper(value, vocab_size=vocab_size):
            raise ValueError(f"prompt {index}: {name}={value} exceeds the vocabulary size {vocab_size}")
    stop = LIMIT["stop_token_id"]
    bad = [t for t in params.stop_token_ids if not stop.admits(t, vocab_size=vocab_size)]
    if bad:
        raise ValueError(f"prompt {index}: stop_token_ids {bad} are outside the vocabulary "
                         f"{stop.interval(vocab_size=vocab_size)}")


def single_prompt(prompt) -> list:
    """`prompt` as a batch of one, for an API taking exactly one; TypeError naming the value if it is not one
    prompt. An empty one passes, for encode_prompts to refuse by value."""
    if is_composite(prompt):
        return [prompt]
    prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if not (is_single_prompt(prompt) or (isinstance(prompt, (list, tuple)) and len(prompt) == 0)):
        raise TypeError(f"expected one prompt (a string, a list of token ids, or a list holding a Chunk), got {type(prompt).__name__} "
                        f"{prompt!r:.80}")
    return [prompt]


def is_params(v) -> bool:
    return v is None or isinstance(v, SamplingParams)


def is_chunking(v) -> bool:
    """One prompt's chunking: None, a fixed chunk length, or a list of chunk lengths (checked later)."""
    return v is None or is_int(v) or isinstance(v, (list, tuple))


def per_prompt(value, n: int, name: str, is_entry, expected: str) -> list:
    """`value` for each of n prompts: one value shared by all, or a list/tuple of exactly n entries."""
    if value is None or (is_entry(value) and not isinstance(value, (list, tuple))):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be {expected}; got {type(value).__name__} {value!r:.80}")
    for i, v in enumerate(value):
        if not is_entry(v):
            raise TypeError(f"{name}[{i}] is {type(v).__name__} {v!r:.80}; {name} must be {expected}")
    if len(value) != n:
        hint = ""
        if name == "chunk_sizes" and all(is_int(c) for c in value):
            hint = (f" (a flat list of ints gives one chunk length per prompt; for one prompt's chunk "
                    f"lengths pass [{list(value)}])")
        raise ValueError(f"{name} has {len(value)} entries for {n} prompt{'s' if n != 1 else ''}{hint}")
    return list(value)


def expand_chunk_sizes(chunk_sizes, prompt_len: int, index: int) -> list[int] | None:
    """One prompt's chunk lengths from None, an int (fixed chunk length) or an explicit list."""
    if chunk_sizes is None:
        return None
    if is_int(chunk_sizes):
        if not LIMIT["chunk_size"].admits(chunk_sizes):
            raise ValueError(f"prompt {index}: chunk size {chunk_sizes} must be >= 1")
        full, rest = divmod(prompt_len, chunk_sizes)
        return [int(chunk_sizes)] * full + ([rest] if rest else [])
    if not isinstance(chunk_sizes, (list, tuple)):
        raise TypeError(f"prompt {index}: chunk sizes must be None, an int or a list of ints, got "
                        f"{type(chunk_sizes).__name__} {chunk_sizes!r:.80}")
    sizes = list(chunk_sizes)
    for c in sizes:
        if not is_int(c) or not LIMIT["chunk_size"].admits(c):
            raise ValueError(f"prompt {index}: chunk size {c!r} in {sizes} is not an integer >= 1")
    if sum(sizes) != prompt_len:
        raise ValueError(f"prompt {index}: chunk sizes {sizes} sum to {sum(sizes)}, not the prompt length "
                         f"{prompt_len}")
    return [int(c) for c in sizes]
