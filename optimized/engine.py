"""optimized.Engine: the paged, chunked-prefill engine behind the interface both engines share.

`generate` for batches; `add_request` / `step` / `abort` for streaming. Every request is validated in
full before any of it touches the scheduler, so a bad request never disturbs the others.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from chunkwise.requests import open_checkpoint, prepare_requests
from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.tokenizer import decode
from chunkwise.weights import load_weights
from optimized.block_manager import BlockManager
from optimized.model_runner import ModelRunner
from optimized.scheduler import Scheduler, SchedulerConfig
from optimized.sequence import Sequence

TQDM_MIN_PROMPTS = 16   # progress bars only for batches worth watching


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool


class Engine:
    """The shared interface (DESIGN.md) plus the paging knobs: `num_pages` (default: from free memory, on
    GPU `gpu_memory_utilization` of it), the per-step token budget and running-sequence cap, prefix caching,
    `enforce_eager` (no CUDA graphs) and `split_kv_threshold` (decodes of sequences holding more tokens use
    split-KV; default 0 on GPU, where decode graphs capture that path, 256 on CPU)."""

    def __init__(self, model, dtype="float32", device=None, page_size=16, max_model_len=None,
                 num_pages=None, gpu_memory_utilization=0.9, max_num_batched_tokens=512, max_num_seqs=64,
                 enable_prefix_caching=True, enforce_eager=False, split_kv_threshold=None):
        ckpt = open_checkpoint(model, dtype, device, page_size, max_model_len)
        self.checkpoint, self.config, self.tokenizer = ckpt, ckpt.config, ckpt.tokenizer
        self.dtype, self.device, self.max_model_len = ckpt.dtype, ckpt.device, ckpt.max_model_len
        sched_cfg = SchedulerConfig(max_num_batched_tokens, max_num_seqs)
        weights = load_weights(ckpt.path, self.dtype, self.device, cfg=self.config)
        self.runner = ModelRunner(
            self.config, weights, dtype=self.dtype, device=self.device, page_size=page_size, max_model_len=self.max_model_len, num_pages=num_pages,
            gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, split_kv_threshold=split_kv_threshold)
        self.page_size = page_size
        self.block_manager = BlockManager(self.runner.num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self.config.eos_token_ids)
        self.outputs: dict[int, RequestOutput] = {}
        self._seqs: dict[int, Sequence] = {}
        self._kv_wanted: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------
    def _prepare(self, prompts, sampling_params, chunk_sizes) -> list[Sequence]:
        """Validated sequences for a batch of prompts (nothing is scheduled yet)."""
        seqs = [Sequence(-1, r.prompt_token_ids, r.params, r.chunk_sizes)
                for r in prepare_requests(self.checkpoint, prompts, sampling_params, chunk_sizes)]
        for seq in seqs:   # the scheduler's own check, for the whole batch before any of it is added
            self.scheduler.check_fits(seq)
        return seqs

    def _submit(self, seq: Sequence) -> int:
        rid = next(self._ids)
        seq.seq_id = rid
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        self.outputs[rid] = RequestOutput(rid, list(seq.prompt_token_ids), token_ids=[],
                                          logprobs=[] if seq.sampling_params.logprobs is not None else None)
        return rid

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, chunk_sizes=None) -> int:
        """Queue one prompt; returns its request id. Tokens arrive through `step`."""
        return self._submit(self._prepare([prompt], sampling_params, chunk_sizes)[0])

    def abort(self, request_id: int) -> None:
        """Stop a request and free its pages; its output keeps the tokens so far, finish_reason "abort"."""
        if request_id not in self.outputs:
            raise ValueError(f"no request with id {request_id!r}")
        if self.scheduler.abort(request_id) is not None:
            self._finish(request_id, "abort")

    def _finish(self, rid: int, reason: str) -> None:
        out = self.outputs[rid]
        out.finish_reason = reason
        out.text = decode(self.tokenizer, out.token_ids)
        self._seqs.pop(rid, None)
        self.runner.release(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One scheduler step: a forward over the batch, sampling, bookkeeping. Returns tokens produced."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with unfinished requests queued")
            return []
        sampled, logits = self.runner.run(batch.seqs, batch.num_new_tokens)
        tokens, logprobs = self.runner.sample(sampled, logits)
        for seq in sampled:
            if seq.seq_id in self._kv_wanted and self._kv_wanted[seq.seq_id] is None:
                self._kv_wanted[seq.seq_id] = self.runner.gather_kv(seq, seq.num_prompt_tokens)
        finished = {s.seq_id for s in self.scheduler.postprocess(batch, tokens)}
        results = []
        for seq in sampled:
            out = self.outputs[seq.seq_id]
            if not out.token_ids:
                out.num_cached_tokens = seq.num_cached_tokens
            out.token_ids.append(tokens[seq.seq_id])
            if out.logprobs is not None:
                out.logprobs.append(logprobs[seq.seq_id])
            if seq.seq_id in finished:
                self._finish(seq.seq_id, seq.finish_reason)
            results.append(StepOutput(seq.seq_id, [tokens[seq.seq_id]], seq.seq_id in finished))
        return results

    def generate(self, prompts, sampling_params=None, chunk_sizes=None, use_tqdm=None) -> list[RequestOutput]:
        """Run prompts to completion (other queued requests advance too); outputs in prompt order."""
        rids = [self._submit(s) for s in self._prepare(prompts, sampling_params, chunk_sizes)]
        show = len(rids) >= TQDM_MIN_PROMPTS if use_tqdm is None else use_tqdm
        pending = set(rids)
        with tqdm(total=len(rids), desc="generate", disable=not show) as bar:
            while pending:
                for r in self.step():
                    if r.finished and r.request_id in pending:
                        pending.discard(r.request_id)
                        bar.update(1)
        return [self.outputs.pop(r) for r in rids]

    def prefill_kv(self, prompt, chunk_sizes=None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of the prompt as this engine cached them
        (after k-norm and RoPE), gathered from its own pages."""
        seq = self._prepare([prompt], SamplingParams(max_tokens=1, ignore_eos=True), chunk_sizes)[0]
        rid = self._submit(seq)
        self._kv_wanted[rid] = None
        try:
            while self._kv_wanted[rid] is None:
                self.step()
        finally:
            kv = self._kv_wanted.pop(rid)
            if rid in self._seqs:
                self.abort(rid)
            self.outputs.pop(rid, None)
        return kv
