"""Sampling parameters, the sampler both engines use, and the output type both engines return."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 is greedy
    top_k: int = 0                    # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None           # per request: the same seed gives the same tokens
    logprobs: int | None = None       # top-k logprobs per generated token, besides the chosen token's
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestOutput:
    request_id: int | str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # one dict per generated token: {token_id: logprob} holding the chosen token and the top `logprobs`
    logprobs: list[dict[int, float]] | None = None
    # "stop" (EOS or a stop token), "length" (max_tokens), "abort", "error" (the step running it raised)
    finish_reason: str | None = None
    num_cached_tokens: int = 0        # prompt tokens whose K/V came from the prefix cache
    error: str | None = None          # the exception that ended the request, with finish_reason "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator, so its samples do not depend on what else runs beside it."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row of logits [vocab]; greedy takes the first maximum."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The chosen token's logprob and the top-k, from a row of logits [vocab]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {int(token): float(lp[token])}
    if k:
        top = torch.topk(lp, k)
        out.update({int(i): float(v) for i, v in zip(top.indices, top.values)})
    return out
