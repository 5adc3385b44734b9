"""One request as the scheduler and the page pool see it: its tokens, its pages, how far it is computed."""
from __future__ import annotations

import enum
import itertools

import numpy as np

from chunkwise.requests import Request, expand_chunk_sizes
from chunkwise.sampling import SamplingParams
from chunkwise.tokenizer import all_ints, is_int

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """A request: prompt + generated tokens, its page table, and how many of its tokens have K/V in the cache.

    Invariant: tokens [0, num_computed_tokens) have K/V in the pages of page_table, in order; the last
    token of a decoding sequence (the one just sampled) is never computed yet.
    Under overlap scheduling a token may be sampled on the device but not yet known on the host: it is
    counted in num_pending (and in num_tokens), not in token_ids, until the engine postprocesses its step.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 chunk_sizes: list[int] | None = None):
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if not all_ints(prompt_token_ids) or min(prompt_token_ids) < 0:
            i, t = next((i, t) for i, t in enumerate(prompt_token_ids) if not is_int(t) or t < 0)
            raise ValueError(f"sequence {seq_id}: prompt token {i} is {t!r}, not a token id (an int >= 0)")
        if chunk_sizes is not None:   # the requests' own check (an explicit list here)
            chunk_sizes = expand_chunk_sizes(list(chunk_sizes), len(prompt_token_ids), seq_id)
        self._start(seq_id, prompt_token_ids, sampling_params, chunk_sizes)

    @classmethod
    def from_request(cls, request: Request) -> Sequence:
        """A new sequence (id -1 until it is submitted) of a request from `validate_requests`, which checked its
        tokens and chunk sizes into lists of its own: taken as they are. Checking a prompt of thousands of ids
        again cost as much host time as the rest of its admission."""
        seq = cls.__new__(cls)
        seq._start(-1, request.prompt_token_ids, request.params, request.chunk_sizes)
        seq.request = request
        return seq

    def _start(self, seq_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
               chunk_sizes: list[int] | None) -> None:
        self.seq_id = seq_id
        self.arrival = next(_arrivals)    # order of creation: "newest" for preemption is the largest
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.chunk_sizes = chunk_sizes
        self.token_ids = list(prompt_token_ids)   # the tokens known on the host
        self.num_pending = 0                      # tokens after them, sampled by steps not yet postprocessed
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.page_table: list[int] = []
        self.page_hashes: list[bytes] = []   # hash-chain value of each full page of page_table, in order
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = None   # one dict per generated token, when asked for
        self.error: str | None = None          # why the request failed (finish_reason "error")
        # The validated request it came from (its pieces and reuse mode), None for a sequence built from ids.
        self.request: Request | None = None
        self.prefill_only = False              # a prefix job (EngineCore.compute_prefix): computes its prompt, samples nothing

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"pages={self.page_table}, {self.status.name})")

    def id_array(self, lo: int, hi: int) -> np.ndarray:
        """int64 [hi - lo]: tokens lo..hi-1 (known on the host), a slice of the request's id array where they are
        its prompt's and it has one (a composite prompt's: no pass over its Python ints), else from token_ids."""
        ids = self.request.prompt_array if self.request is not None else None
        if ids is not None and hi <= len(ids):
            return ids[lo:hi]
        return np.fromiter(self.token_ids[lo:hi], np.int64)

    @property
    def pieces(self):
        """A composite prompt's pieces (chunkwise/chunks.py), for its report; None for a plain prompt."""
        return self.request.pieces if self.request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Generated tokens known on the host (pending ones not counted)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def pending_is_last(self) -> bool:
        """A pending token is the max_tokens-th: the sequence ends when it lands, whatever it is."""
        return self.num_pending > 0 and self.num_tokens - self.num_prompt_tokens >= self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def follows_chunk_sizes(self, computed: int | None = None) -> bool:
        """Whether the next step (from `computed` tokens, default num_computed_tokens) must end at one of
        the caller's chunk boundaries.

        After a preemption the caller's chunks no longer apply: the recompute is split by the budget.
        """
        computed = self.num_computed_tokens if computed is None else computed
        return self.chunk_sizes is not None and self.num_preemptions == 0 and computed < self.num_prompt_tokens

    def next_chunk_end(self, computed: int | None = None) -> int:
        """The first caller chunk boundary past `computed` tokens (default num_computed_tokens; a
        prefix-cache hit may end mid-chunk)."""
        computed = self.num_computed_tokens if computed is None else computed
        end = 0
        for c in self.chunk_sizes:
            end += c
            if end > computed:
                return end
        raise ValueError(f"sequence {self.seq_id}: no chunk left after {computed} tokens")
