"""chunkwise.reference.Engine: the interface both engines share, over a model that recomputes everything.

Each generated token costs a full forward pass over the prompt and every token generated so far: slow,
and obviously free of cache bugs. It takes the same `EngineConfig` fields as the optimized engine and
validates them alike; the paging and batching ones (`REFERENCE_IGNORED`: page_size, num_pages, ...) and
`chunk_sizes` are then ignored, since there are no pages and no chunks here. Registered chunks are handles
only: every prompt, composite or not, is recomputed in full, and its `chunk_reuse` says so.
"""
from __future__ import annotations

import torch

from chunkwise.chunks import Chunk, ChunkRegistry, reuse_report
from chunkwise.engine_config import REFERENCE_IGNORED, EngineConfig
from chunkwise.requests import single_prompt, validate_requests
from chunkwise.sampling import RequestOutput, SamplingParams, make_generator, sample, token_logprobs
from chunkwise.tokenizer import decode, load_tokenizer
from chunkwise.weights import load_weights
from chunkwise.reference.model import ReferenceModel


class Engine:
    ignored_fields = REFERENCE_IGNORED

    def __init__(self, model, **kwargs):
        """`kwargs`: EngineConfig's fields; those in `ignored_fields` are validated, then ignored."""
        self.engine_config = config = EngineConfig(model, **kwargs)
        self.model_config, self.tokenizer = config.model_config, load_tokenizer(config.path)
        self.dtype, self.device, self.max_model_len = config.dtype, config.device, config.max_model_len
        weights = load_weights(config.path, self.dtype, self.device, cfg=self.model_config)
        self.model = ReferenceModel(self.model_config, weights)
        self.chunks = ChunkRegistry("chunkwise.reference.Engine")

    def register_chunk(self, prompt, pin: bool = False) -> Chunk:
        """A handle to `prompt` (text, tokenized without special tokens, or token ids) for composite prompts;
        nothing is computed or kept (no cache here), so `pin` only marks it for `unpin`."""
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        chunk = self.chunks.issue(self.chunks.chunk_ids(prompt, self.tokenizer, self.model_config.vocab_size))
        if pin:
            self.chunks.pinned[chunk.chunk_id] = True
        return chunk

    def unpin(self, chunk: Chunk) -> None:
        self.chunks.check_pinned(chunk)
        del self.chunks.pinned[chunk.chunk_id]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 at every position of `token_ids`."""
        return self.model.forward(torch.tensor(token_ids, device=self.device))[0]

    def _requests(self, prompts, sampling_params, chunk_sizes, reuse="exact"):
        return validate_requests(self.model_config, self.tokenizer, self.max_model_len, prompts, sampling_params,
                                 chunk_sizes, reuse, self.chunks)

    def generate(self, prompts, sampling_params=None, chunk_sizes=None, use_tqdm=None,
                 reuse="exact") -> list[RequestOutput]:
        """One output per prompt, in order; `use_tqdm` is accepted for interface parity (no progress bar)."""
        requests = self._requests(prompts, sampling_params, chunk_sizes, reuse)
        return [self._generate_one(i, r.prompt_token_ids, r.params, r.pieces) for i, r in enumerate(requests)]

    def _generate_one(self, request_id: int, prompt: list[int], params: SamplingParams,
                      pieces=None) -> RequestOutput:
        out = RequestOutput(request_id, list(prompt), logprobs=[] if params.logprobs is not None else None,
                            chunk_reuse=reuse_report(pieces, 0))
        generator = make_generator(params, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
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

    def prefill_kv(self, prompt, chunk_sizes=None, reuse="exact") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer for one prompt as a cache would hold them (after k-norm and RoPE):
        each [num_layers, num_tokens, num_kv_heads, head_dim] in the engine's dtype."""
        request = self._requests(single_prompt(prompt), SamplingParams(max_tokens=1), [chunk_sizes], reuse)[0]
        _, k, v = self.model.forward(torch.tensor(request.prompt_token_ids, device=self.device))
        return k, v
