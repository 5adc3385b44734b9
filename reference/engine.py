"""reference.Engine: the interface both engines share, over a model that recomputes everything.

Each generated token costs a full forward pass over the prompt and every token generated so far: slow,
and obviously free of cache bugs. `page_size` and `chunk_sizes` are validated like the optimized
engine's and otherwise ignored, since there are no pages and no chunks here.
"""
from __future__ import annotations

import torch

from chunkwise.checkpoints import resolve_model
from chunkwise.config import ModelConfig
from chunkwise.sampling import RequestOutput, SamplingParams, make_generator, sample, token_logprobs
from chunkwise.tokenizer import as_prompt_list, decode, encode_prompts, load_tokenizer
from chunkwise.weights import load_weights
from reference.model import ReferenceModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_chunk_sizes(chunk_sizes, prompt_lens: list[int]) -> None:
    """None, one int >= 1 for every prompt, or per prompt None / an int / a list of ints >= 1 summing to
    the prompt's length (a single prompt may take its list directly)."""
    if chunk_sizes is None or _is_int(chunk_sizes):
        per_prompt = [chunk_sizes] * len(prompt_lens)
    elif len(prompt_lens) == 1 and chunk_sizes and all(_is_int(c) for c in chunk_sizes):
        per_prompt = [list(chunk_sizes)]
    else:
        per_prompt = list(chunk_sizes)
        if len(per_prompt) != len(prompt_lens):
            raise ValueError(f"chunk_sizes has {len(per_prompt)} entries for {len(prompt_lens)} prompts")
    for i, (sizes, n) in enumerate(zip(per_prompt, prompt_lens)):
        if sizes is None:
            continue
        if _is_int(sizes):
            sizes = [sizes]
        elif sum(sizes) != n:
            raise ValueError(f"prompt {i}: chunk sizes {list(sizes)} sum to {sum(sizes)}, not the prompt "
                             f"length {n}")
        for c in sizes:
            if not _is_int(c) or c < 1:
                raise ValueError(f"prompt {i}: chunk size {c!r} is not an integer >= 1")


class Engine:
    def __init__(self, model, dtype="float32", device=None, page_size=16, max_model_len=None, **kw):
        """`kw` takes the optimized engine's tuning knobs (num_pages, max_num_seqs, ...) and ignores them."""
        if not _is_int(page_size) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if isinstance(dtype, str) and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
        path = resolve_model(model)
        self.config = ModelConfig.from_dir(path)
        self.tokenizer = load_tokenizer(path)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        limit = self.config.max_position_embeddings
        self.max_model_len = limit if max_model_len is None else max_model_len
        if not _is_int(self.max_model_len) or not 2 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [2, {limit}] (max_position_embeddings), "
                             f"got {max_model_len!r}")
        self.model = ReferenceModel(self.config, load_weights(path, self.dtype, self.device, cfg=self.config))

    def _prepare(self, prompts, sampling_params, chunk_sizes) -> tuple[list[list[int]], list[SamplingParams]]:
        ids = encode_prompts(as_prompt_list(prompts), self.tokenizer, self.config)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        else:
            params = [p or SamplingParams() for p in sampling_params]
            if len(params) != len(ids):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(ids)} prompts")
        check_chunk_sizes(chunk_sizes, [len(t) for t in ids])
        for i, (tokens, p) in enumerate(zip(ids, params)):
            if len(tokens) + p.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(tokens)} tokens + max_tokens {p.max_tokens} exceed "
                                 f"max_model_len {self.max_model_len}")
        return ids, params

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 at every position of `token_ids`."""
        return self.model.forward(torch.tensor(token_ids, device=self.device))[0]

    def generate(self, prompts, sampling_params=None, chunk_sizes=None, **kw) -> list[RequestOutput]:
        """One output per prompt, in order; `kw` (e.g. use_tqdm) is accepted for interface parity."""
        ids, params = self._prepare(prompts, sampling_params, chunk_sizes)
        return [self._generate_one(i, tokens, p) for i, (tokens, p) in enumerate(zip(ids, params))]

    def _generate_one(self, request_id: int, prompt: list[int], params: SamplingParams) -> RequestOutput:
        out = RequestOutput(request_id, list(prompt), logprobs=[] if params.logprobs is not None else None)
        generator = make_generator(params, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.config.eos_token_ids))
        while out.finish_reason is None:
            row = self.logits(prompt + out.token_ids)[-1]
            token = sample(row, params, generator)
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(token_logprobs(row, token, params.logprobs))
            if token in stops:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= params.max_tokens:
                out.finish_reason = "length"
        out.text = decode(self.tokenizer, out.token_ids)
        return out

    def prefill_kv(self, prompt, chunk_sizes=None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer for one prompt as a cache would hold them (after k-norm and RoPE):
        each [num_layers, num_tokens, num_kv_heads, head_dim] in the engine's dtype."""
        ids, _ = self._prepare([prompt], SamplingParams(max_tokens=1), chunk_sizes)
        _, k, v = self.model.forward(torch.tensor(ids[0], device=self.device))
        return k, v
