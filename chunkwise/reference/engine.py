"""chunkwise.reference.Engine: the interface both engines share, over a model that recomputes everything.

Each generated token costs a full forward pass over the prompt and every token generated so far: slow,
and obviously free of cache bugs. It takes the same `EngineConfig` fields as the optimized engine and
validates them alike; the paging and batching ones (`REFERENCE_IGNORED`: page_size, num_pages, ...) and
`chunk_sizes` are then ignored, since there are no pages and no chunks here. Registered chunks are handles
only: in exact mode every prompt, composite or not, is recomputed in full, and its `chunk_reuse` says so. In
blend mode (reuse="blend" or a Blend) the prompt's cache is built by chunkwise/reference/blend.py from the
chunks' variants' K/V (each computed on demand after its context and kept per (context, chunk ids): they depend
on those only), and generated tokens are decoded over that cache with `ReferenceModel.extend`, one token a step.
"""
from __future__ import annotations

import torch

from chunkwise.chunks import Blend, Chunk, ChunkContext, ChunkRegistry, reuse_report
from chunkwise.engine_config import REFERENCE_IGNORED, EngineConfig
from chunkwise.open_config import open_config
from chunkwise.requests import single_prompt, validate_requests
from chunkwise.sampling import RequestOutput, SamplingParams, make_generator, sample, token_logprobs
from chunkwise.tokenizer import decode, load_tokenizer
from chunkwise.weights import load_weights
from chunkwise.reference.blend import BlendResult, blend_prefill, variant_forward
from chunkwise.reference.model import ReferenceModel


class Engine:
    ignored_fields = REFERENCE_IGNORED

    def __init__(self, model, **kwargs):
        """`kwargs`: EngineConfig's fields; those in `ignored_fields` are validated, then ignored."""
        self.engine_config = config = open_config(EngineConfig(model, **kwargs))
        self.model_config, self.tokenizer = config.model_config, load_tokenizer(config.path)
        self.dtype, self.device, self.max_model_len = config.dtype, config.device, config.max_model_len
        weights = load_weights(config.path, self.dtype, self.device, cfg=self.model_config)
        self.model = ReferenceModel(self.model_config, weights)
        self.chunks = ChunkRegistry("chunkwise.reference.Engine")
        # blend mode's variants' K/V, per (context ids, chunk ids)
        self.variant_kvs: dict[tuple[tuple, tuple], tuple[torch.Tensor, torch.Tensor]] = {}

    def register_chunk(self, prompt, pin: bool = False, after=None) -> Chunk:
        """A handle to `prompt` (text, tokenized without special tokens, or token ids) for composite prompts, as
        computed after the context `after` (None, or ids as a composite prompt gives them: chunkwise/chunks.py);
        nothing is computed or kept here (blend mode computes a variant on demand), so `pin` only marks it for
        `unpin`."""
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        vocab = self.model_config.vocab_size
        ids = self.chunks.chunk_ids(prompt, self.tokenizer, vocab)
        context = self.chunks.context(after, self.tokenizer, vocab)
        try:   # context and chunk fit the model
            validate_requests(self.model_config, self.tokenizer, self.max_model_len, [list(context.token_ids) + ids],
                              SamplingParams(max_tokens=1, ignore_eos=True))
        except ValueError as e:
            if not context.token_ids:
                raise
            raise ValueError(f"after ({len(context)} tokens) and the chunk: {e}") from None
        chunk = self.chunks.issue(ids, context)
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
        return [self._generate_one(i, r.prompt_token_ids, r.params, r.pieces, r.reuse)
                for i, r in enumerate(requests)]

    def _variant_kv(self, chunk: Chunk, context: ChunkContext) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's K/V computed after `context`, at positions len(context).., each [layers, n, K, D]."""
        key = (context.token_ids, chunk.token_ids)
        if key not in self.variant_kvs:
            self.variant_kvs[key] = variant_forward(self.model, chunk, context)
        return self.variant_kvs[key]

    def _blend(self, prompt: list[int], pieces, blend: Blend) -> BlendResult:
        return blend_prefill(self.model, prompt, pieces, blend, variant_kv=self._variant_kv,
                             page_size=self.engine_config.page_size)

    def _generate_one(self, request_id: int, prompt: list[int], params: SamplingParams,
                      pieces=None, reuse="exact") -> RequestOutput:
        blended = self._blend(prompt, pieces, reuse) if isinstance(reuse, Blend) else None
        out = RequestOutput(request_id, list(prompt), logprobs=[] if params.logprobs is not None else None,
                            chunk_reuse=reuse_report(pieces, 0) if blended is None or pieces is None
                            else blended.chunk_reuse)
        generator = make_generator(params, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        cache = None if blended is None else (blended.k, blended.v)   # blend mode: the prompt's, then the tokens'
        while out.finish_reason is None:
            if blended is None:
                row = self.logits(prompt + out.token_ids)[-1]
            elif not out.token_ids:
                row = blended.logits
            else:   # the last token after the blended prompt's cache and the generated tokens' K/V
                logits, *cache = self.model.extend(torch.tensor(out.token_ids[-1:], device=self.device),
                                                   len(prompt) + len(out.token_ids) - 1, *cache)
                row = logits[-1]
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
        if isinstance(request.reuse, Blend):
            blended = self._blend(request.prompt_token_ids, request.pieces, request.reuse)
            return blended.k, blended.v
        _, k, v = self.model.forward(torch.tensor(request.prompt_token_ids, device=self.device))
        return k, v
