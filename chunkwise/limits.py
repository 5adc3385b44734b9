"""Every bound a request, a chunk, an engine's configuration or a server option is checked against, declared once, as
data: `LIMITS`, one row per bound (name, lower, upper, whether each end is inclusive, its layer, the entry points it
applies at).

Validators never compare a value against a bound themselves: they ask the row (`Limit.admits`,
`Limit.first_outside`) and write their own message, naming the value and the row's interval (`Limit.interval`). A
bound is a number, None (no bound on that side), or the name of a value known only where it is checked
("vocab_size", "max_model_len", ...), passed as a keyword. tests/test_limits_table.py holds the table to its
specification, sends every row's bounds (at, one step inside, one step outside) through every entry point the row
names, and scans the validators' modules for an ordering comparison written outside this table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Bound = int | float | str | None

LAYERS = ("request", "chunk", "config", "server")
ENTRY_POINTS = ("engine", "reference", "register_chunk", "server", "cli")


@dataclass(frozen=True)
class Limit:
    """lower <= value <= upper, each end strict where not inclusive; a str bound is looked up in the keywords."""
    name: str
    lower: Bound
    upper: Bound
    lower_inclusive: bool
    upper_inclusive: bool
    layer: str
    applies: tuple[str, ...]

    def bounds(self, **context) -> tuple[int | float | None, int | float | None]:
        """(lower, upper) as numbers (None where unbounded); KeyError naming a context value not given."""
        def resolve(bound: Bound):
            if isinstance(bound, str):
                if bound not in context:
                    raise KeyError(f"limit {self.name} needs {bound}=... to be checked")
                return context[bound]
            return bound
        return resolve(self.lower), resolve(self.upper)

    def admits(self, value, **context) -> bool:
        """Whether `value` (a number; NaN is never admitted) lies inside the bounds."""
        return self.above_lower(value, **context) and self.below_upper(value, **context)

    def above_lower(self, value, **context) -> bool:
        """Whether `value` passes the lower bound (where the upper one needs a value not known there)."""
        lo = self.bounds(**{**context, **self._unbounded("upper", context)})[0]
        if isinstance(value, float) and math.isnan(value):
            return False
        return lo is None or (lo <= value if self.lower_inclusive else lo < value)

    def below_upper(self, value, **context) -> bool:
        """Whether `value` passes the upper bound."""
        hi = self.bounds(**{**context, **self._unbounded("lower", context)})[1]
        if isinstance(value, float) and math.isnan(value):
            return False
        return hi is None or (value <= hi if self.upper_inclusive else value < hi)

    def _unbounded(self, side: str, context: dict) -> dict:
        """A stand-in for the other side's context value, when it is not given: that side is not asked."""
        bound = getattr(self, side)
        return {bound: None} if isinstance(bound, str) and bound not in context else {}

    def first_outside(self, values, **context):
        """The first of `values` (integers, or an int64 array) outside the bounds, or None. The min and max through
        numpy first:
        prompts run to many thousands of ids, and this is twice as fast as Python's min and max."""
        try:
            a = values if isinstance(values, np.ndarray) else np.fromiter(values, np.int64, len(values))
            if len(a) and self.admits(int(a.min()), **context) and self.admits(int(a.max()), **context):
                return None
        except OverflowError:   # beyond int64, so outside any bound here
            pass
        if isinstance(values, np.ndarray):
            values = values.tolist()
        return next((v for v in values if not self.admits(v, **context)), None)

    def interval(self, **context) -> str:
        """The bounds as an interval, "[0, 384)" ("[1, inf)" for no upper bound)."""
        lo, hi = self.bounds(**context)
        left = "(-inf" if lo is None else f"{'[' if self.lower_inclusive else '('}{lo}"
        right = "inf)" if hi is None else f"{hi}{']' if self.upper_inclusive else ')'}"
        return f"{left}, {right}"


def _row(name, lower, upper, layer, applies, lower_inclusive=True, upper_inclusive=True) -> Limit:
    return Limit(name, lower, upper, lower_inclusive, upper_inclusive, layer, tuple(applies.split()))


ENGINES = "engine reference"
LIMITS: tuple[Limit, ...] = (
    # ---- a request (chunkwise/requests.py, sampling.py, tokenizer.py) -------------------------------------------
    _row("prompt_token_id", 0, "vocab_size", "request", "engine reference server cli", upper_inclusive=False),
    _row("stop_token_id", 0, "vocab_size", "request", "engine reference server", upper_inclusive=False),
    _row("logprobs", 0, "vocab_size", "request", ENGINES),
    _row("top_k", 0, "vocab_size", "request", "engine reference cli"),
    _row("max_tokens", 1, None, "request", "engine reference server cli"),
    _row("request_tokens", None, "max_model_len", "request", "engine reference server cli"),   # prompt + max_tokens
    _row("chunk_size", 1, None, "request", "engine reference cli"),
    _row("temperature", 0, math.inf, "request", "engine reference server cli", upper_inclusive=False),
    _row("top_p", 0, 1, "request", "engine reference server cli", lower_inclusive=False),
    # ---- a chunk (chunkwise/chunks.py, the engines' register_chunk) ---------------------------------------------
    _row("chunk_token_id", 0, "vocab_size", "chunk", "register_chunk server", upper_inclusive=False),
    _row("pinned_pages", None, "pin_cap", "chunk", "register_chunk server"),   # pinned + new; pin_cap from below
    _row("recompute_ratio", 0, 1, "chunk", ENGINES),
    # ---- an engine's configuration (chunkwise/engine_config.py) ------------------------------------------------
    _row("page_size", 1, None, "config", "engine reference cli"),
    _row("num_pages", 1, None, "config", ENGINES),
    _row("max_num_batched_tokens", 1, None, "config", ENGINES),
    _row("max_num_seqs", 1, None, "config", ENGINES),
    _row("max_prefill_tokens_with_decodes", 1, None, "config", ENGINES),
    _row("max_graph_tokens", 0, None, "config", ENGINES),
    _row("split_kv_threshold", 0, None, "config", ENGINES),
    _row("split_size", "split_tile", None, "config", ENGINES),   # and a multiple of the split-KV tile
    _row("max_model_len", 2, "max_position_embeddings", "config", ENGINES),
    _row("gpu_memory_utilization", 0, 1, "config", ENGINES, lower_inclusive=False),
    _row("max_pinned_fraction", 0, 1, "config", ENGINES, upper_inclusive=False),
    _row("tensor_parallel_size", 1, None, "config", ENGINES),
    _row("deterministic_tensor_parallel_size", None, 2, "config", ENGINES),
    # ---- the server (chunkwise/serve/protocol.py, app.py, cli.py) ----------------------------------------------
    _row("n", 1, None, "server", "server"),
    _row("openai_top_k", -1, "vocab_size", "server", "server"),                # -1: every token, as vLLM's
    _row("server_logprobs", 0, "max_logprobs", "server", "server"),
    _row("waiting_requests", None, "max_waiting", "server", "server"),         # waiting + this request's samples
    _row("max_waiting", 1, None, "server", "server cli"),
    _row("max_logprobs", 0, None, "server", "server cli"),
)
LIMIT = {row.name: row for row in LIMITS}


def pin_cap(max_pinned_fraction: float, num_pages: int) -> int:
    """The most pages pinned chunks may hold in a pool of num_pages pages."""
    return int(max_pinned_fraction * num_pages)
