"""Sampling parameters, the sampler both engines use, and the output type both engines return."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from chunkwise.limits import LIMIT
from chunkwise.tokenizer import is_int

# Below this a temperature is greedy, as in vLLM: dividing float32 logits by a smaller one can overflow
# (5e-324 is a valid float and would reach the sampler as 0.0).
GREEDY_TEMPERATURE = 1e-5


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fail(name: str, value, expected: str, type_ok: bool):
    """TypeError for a value of the wrong type, ValueError for one out of range; both name the value."""
    error = ValueError if type_ok else TypeError
    raise error(f"SamplingParams.{name} must be {expected}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SamplingParams:
    """Checked in full at construction, so a bad value never reaches an engine's step. Numbers are
    normalised (temperature and top_p to float, stop_token_ids to a tuple of int)."""
    max_tokens: int = 16
    temperature: float = 0.0          # 0 (or anything below GREEDY_TEMPERATURE) is greedy
    top_k: int = 0                    # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None           # per request: the same seed gives the same tokens
    logprobs: int | None = None       # top-k logprobs per generated token, besides the chosen token's
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end the text before them (left out of it). The core never sees text: the caller's output
    # processor matches them (chunkwise/engine/outputs.py) and aborts the request in the core.
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        def check_int(name, optional=False):
            """The lower bound; an upper one depends on the model (requests.check_against_vocab)."""
            v, limit = getattr(self, name), LIMIT[name]
            if optional and v is None:
                return
            expected = f"{'None or ' if optional else ''}an integer >= {limit.lower}"
            if not is_int(v) or not limit.above_lower(v):
                _fail(name, v, expected, is_int(v))
            object.__setattr__(self, name, int(v))

        check_int("max_tokens")
        check_int("top_k")
        check_int("logprobs", optional=True)
        if self.seed is not None:
            if not is_int(self.seed):
                _fail("seed", self.seed, "None or an integer", False)
            object.__setattr__(self, "seed", int(self.seed))
        t = self.temperature
        if not _real(t) or not LIMIT["temperature"].admits(t):
            _fail("temperature", t, "a finite real number >= 0 (0 is greedy)", _real(t))
        object.__setattr__(self, "temperature", float(t))
        p = self.top_p
        if not _real(p) or not LIMIT["top_p"].admits(p):
            _fail("top_p", p, "a real number in (0, 1]", _real(p))
        object.__setattr__(self, "top_p", float(p))
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "a bool", False)
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes, dict)) or not hasattr(stops, "__iter__"):
            _fail("stop_token_ids", stops, "a list or tuple of token ids (one id is [id])", False)
        stops = tuple(stops)
        if not all(is_int(t) and LIMIT["stop_token_id"].above_lower(t) for t in stops):
            _fail("stop_token_ids", stops, "token ids, integers >= 0", all(is_int(t) for t in stops))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            _fail("stop", self.stop, "a string or a list of strings", False)
        if "" in stop:
            _fail("stop", self.stop, "non-empty strings", True)
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_logits(self) -> bool:
        """Whether its token or logprobs are computed from the logits on the host, not from the argmax alone."""
        return not self.greedy or self.logprobs is not None


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
    # A composite prompt's pieces in order, each a chunkwise.chunks.ChunkReuse (tokens reused exactly, by
    # blending, recomputed); None for a plain prompt.
    chunk_reuse: tuple | None = None

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


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [vocab] float32 a non-greedy request draws from, given a row of logits [vocab]:
    temperature, then top-k, then top-p, with the tie and boundary rules of HF transformers' logits
    warpers (and vLLM's sampler), so the same logits give the same distribution as there."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # every token tied with the k-th stays
    if params.top_p < 1.0:
        # Drop the least likely tokens while their mass stays <= 1 - top_p; the most likely always stays.
        # Ascending order decides which of several tied tokens at the cut go, as HF's warper does.
        sorted_logits, order = torch.sort(logits)
        drop = torch.softmax(sorted_logits, dim=-1).cumsum(-1) <= 1 - params.top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row of logits [vocab]; greedy takes the first maximum."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The chosen token's logprob and the top-k, from a row of logits [vocab]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {int(token): float(lp[token])}
    if k:
        top = torch.topk(lp, k)
        out.update({int(i): float(v) for i, v in zip(top.indices, top.values)})
    return out
