"""Registered chunks and composite prompts, shared by both engines (the interface only; no model code).

A `Chunk` is a frozen handle to token ids registered with one engine (`Engine.register_chunk`). A composite
prompt is a `Chunk` or a list holding at least one `Chunk`, mixed with strings and lists of token ids (its
*pieces*); it stands for the concatenation of its pieces' ids, and is prefilled in the steps the token budget
gives the plain prompt of those ids (docs/ARCHITECTURE.md, lesson 1: a chunk's K/V are exact only at its global
positions, after everything before it, however the steps cut it). Piece boundaries matter to the prefix cache
and to the per-piece report, not to the steps. Text pieces are tokenized without special tokens, so the ids are
exactly the pieces' ids side by side; a BOS or chat-template ids go in an id piece or a chunk of their own.

`reuse` says how a request may reuse cached K/V: "exact" (the default; only through the prefix cache, so the
output equals generating the concatenated ids), or "blend" (== `DEFAULT_BLEND`, the one configuration the bare
string names) or a `Blend`: CacheBlend-style composition of chunks' own K/V at any position, recomputing a share of
the tokens (issue #28 §3).
`ChunkReuse` reports, per piece, what the cache supplied.

A chunk may be registered *after a context* (`register_chunk(prompt, after=...)`, issue #50 §1): its K/V are
computed once as the continuation of the context's ids, kept under (the context's hash chain, the chunk's tokens).
Each (context, chunk ids) pair is a *variant*; a chunk without a context is its isolated variant (`NO_CONTEXT`). A
request's chunk piece uses the variant of the longest registered context that the request opens with (and that ends
at or before the piece), else none: `Piece.context` says which, `ChunkReuse.context` which one blend mode placed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from chunkwise.limits import LIMIT
from chunkwise.tokenizer import all_ints

# A placed token's K/V deviation (sum of squared differences, fresh against placed) at or below this share of its fresh
# K/V's sum of squares is rounding noise, counted as 0 by both engines: a token its new context did not reach (past a
# sliding window, say) has the same K/V computed twice, and ranking such tokens by noise would differ between them.
DEVIATION_NOISE = 2.0 ** -30
REUSE_MODES = ("exact", "blend")           # the names a request may give; "blend" means DEFAULT_BLEND
BLEND_POLICIES = ("kv-deviation", "chunk-heads", "adaptive")

_engine_numbers = itertools.count()


@dataclass(frozen=True)
class ChunkContext:
    """The ids a chunk's K/V were computed after (a variant's context); empty: the chunk computed alone."""
    token_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"ChunkContext({len(self.token_ids)} tokens)"


NO_CONTEXT = ChunkContext()


@dataclass(frozen=True)
class Chunk:
    """Token ids registered with one engine; `engine` names it (another engine refuses the handle). `context`: the
    ids its K/V were computed after (`register_chunk(after=...)`; NO_CONTEXT: computed alone, from position 0)."""
    token_ids: tuple[int, ...]
    chunk_id: int
    engine: str
    context: ChunkContext = NO_CONTEXT

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        after = f", after {len(self.context)} tokens" if self.context.token_ids else ""
        return f"Chunk(id={self.chunk_id}, {len(self.token_ids)} tokens{after}, engine={self.engine!r})"


@dataclass(frozen=True)
class Blend:
    """Blend mode's parameters: recompute about `recompute_ratio` of the chunks' tokens, chosen by `policy`:
    "kv-deviation" (CacheBlend: the tokens whose fresh K/V deviate most from their reused ones, filtered
    gradually over the first layers), "chunk-heads" (EPIC: the first tokens of every chunk) or "adaptive"
    (kv-deviation's budget and layers, shared out among the chunks in proportion to how far each one's K/V moved,
    then its most deviating tokens: Cache-Craft's per-chunk decision). 0 reuses the chunks' K/V as they are
    (moved to their new positions); 1 recomputes everything (exact mode's output)."""
    recompute_ratio: float = 0.15
    policy: str = "kv-deviation"

    def __post_init__(self):
        r = self.recompute_ratio
        # bool is an int; NaN fails both comparisons
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not LIMIT["recompute_ratio"].admits(r):
            raise ValueError(f"Blend recompute_ratio must be a number in [0, 1], got {r!r}")
        if self.policy not in BLEND_POLICIES:
            raise ValueError(f"Blend policy must be one of {list(BLEND_POLICIES)}, got {self.policy!r}")


# What reuse="blend" (the bare string, the server's too) asks for: the smallest share measured within 2 points of
# exact mode on both real checkpoints (docs/BENCHMARKS.md, "a default a user can trust"). `Blend()` keeps
# CacheBlend's cheap 0.15 for those who ask for speed by name.
DEFAULT_BLEND = Blend(recompute_ratio=0.9, policy="kv-deviation")


@dataclass(frozen=True)
class ChunkReuse:
    """What one piece of a composite prompt reused: `exact + blended + recomputed == num_tokens`.

    `exact`: tokens whose K/V came from the prefix cache; `blended`: tokens whose K/V at some layer are a chunk's
    own K/V moved to a new position (blend mode); `recomputed`: tokens computed at every layer by this request.
    `context`: in blend mode, the context of the chunk's variant whose K/V were placed (NO_CONTEXT: its isolated
    K/V); None when no variant was (exact mode, a text or id piece, a chunk with no variant for this request)."""
    chunk: Chunk | None          # None for a piece of plain text or ids
    num_tokens: int
    exact: int
    blended: int
    recomputed: int
    context: ChunkContext | None = None


@dataclass(frozen=True)
class Piece:
    """One piece of a composite prompt: its chunk (None for text or ids), its number of tokens, and the context of
    the chunk's variant this prompt may use (`ChunkRegistry.variant`; NO_CONTEXT: its isolated K/V; None: no
    variant fits, so none is placed; ignored for text and ids)."""
    chunk: Chunk | None
    num_tokens: int
    context: ChunkContext | None = NO_CONTEXT


def is_composite(prompt) -> bool:
    """A Chunk, or a list or tuple holding at least one Chunk. Asked of every prompt, so of long id lists: the scan
    runs at C speed (a Chunk's type is Chunk itself: the dataclass is final in use)."""
    return isinstance(prompt, Chunk) or (isinstance(prompt, (list, tuple)) and Chunk in map(type, prompt))


def blend_params(reuse) -> Blend | None:
    """None for "exact", `DEFAULT_BLEND` for "blend", a `Blend` itself; else ValueError naming `reuse`."""
    if isinstance(reuse, Blend):
        return reuse
    if isinstance(reuse, str) and reuse in REUSE_MODES:
        return None if reuse == "exact" else DEFAULT_BLEND
    raise ValueError(f"reuse must be one of {list(REUSE_MODES)} or a Blend, got {reuse!r:.80}")


def check_reuse(reuse, index: int | None = None) -> str | Blend:
    """"exact", or the `Blend` that `reuse` asks for; else ValueError naming it (and the prompt)."""
    try:
        blend = blend_params(reuse)
    except ValueError as e:
        raise ValueError(e.args[0] if index is None else f"prompt {index}: {e.args[0]}") from None
    return "exact" if blend is None else blend


def reuse_report(pieces: tuple[Piece, ...] | None, num_cached_tokens: int) -> tuple[ChunkReuse, ...] | None:
    """Per piece, the tokens the prefix cache supplied (the prompt's first num_cached_tokens) and the rest."""
    if pieces is None:
        return None
    out, start = [], 0
    for p in pieces:
        exact = max(0, min(start + p.num_tokens, num_cached_tokens) - start)
        out.append(ChunkReuse(p.chunk, p.num_tokens, exact, 0, p.num_tokens - exact))
        start += p.num_tokens
    return tuple(out)


class ChunkRegistry:
    """One engine's chunks: the handles it issued and the pinned ones (each with what its engine keeps for it,
    e.g. the pinned pages)."""

    def __init__(self, kind: str, name: str | None = None):
        self.name = name or f"{kind}#{next(_engine_numbers)}"   # given: a mirror of another process's registry
        self.num_issued = 0
        self.pinned: dict[int, object] = {}   # chunk id -> the engine's pin (its pages, or True)
        self.variants: dict[tuple[int, ...], set[ChunkContext]] = {}   # a chunk's ids -> its registered contexts
        self.arrays: dict[int, np.ndarray] = {}   # chunk id -> its ids as a read-only int64 array, made once

    def issue(self, token_ids: list[int], context: ChunkContext = NO_CONTEXT) -> Chunk:
        chunk = Chunk(tuple(token_ids), self.num_issued, self.name, context)
        self.num_issued += 1
        self.variants.setdefault(chunk.token_ids, set()).add(context)
        return chunk

    def context(self, after, tokenizer, vocab_size: int) -> ChunkContext:
        """The context of `register_chunk(after=...)`: None (NO_CONTEXT), or ids given as a composite prompt's are
        (a Chunk of this engine, text, token ids, or a list of those: the concatenation of their ids; a Chunk
        stands for its own ids, as in a prompt); else TypeError/ValueError naming it."""
        if after is None:
            return NO_CONTEXT
        if hasattr(after, "tolist"):
            after = after.tolist()
        if isinstance(after, Chunk):
            after = [after]
        if isinstance(after, (list, tuple)) and after and not all_ints(after):
            ids: list = []
            for j, p in enumerate(after):
                ids += self._piece(p, tokenizer, f"after[{j}]")[0]
        else:
            ids = self._piece(after, tokenizer, "after")[0]
        limit = LIMIT["chunk_token_id"]
        bad = limit.first_outside(ids, vocab_size=vocab_size)
        if bad is not None:
            raise ValueError(f"after holds token id {bad!r}, outside the vocabulary "
                             f"{limit.interval(vocab_size=vocab_size)}")
        return ChunkContext(tuple(ids))

    def variant(self, chunk: Chunk, prompt_ids: list, start: int) -> ChunkContext | None:
        """The context of the registered variant of `chunk`'s ids that a prompt of `prompt_ids`, holding the chunk
        at `start`, may use: the longest context the prompt opens with, ending at or before `start` (NO_CONTEXT if
        the chunk was registered alone); None when no variant fits."""
        best = None
        for c in self.variants.get(chunk.token_ids, ()):
            n = len(c.token_ids)
            if n <= start and (best is None or n > len(best.token_ids)) and tuple(prompt_ids[:n]) == c.token_ids:
                best = c
        return best

    def check(self, chunk, what: str = "chunk") -> Chunk:
        """`chunk` if this registry issued it; else ValueError (TypeError for a non-Chunk) naming it."""
        if not isinstance(chunk, Chunk):
            raise TypeError(f"{what} must be a Chunk from register_chunk, got {type(chunk).__name__} {chunk!r:.80}")
        if chunk.engine != self.name:
            raise ValueError(f"{what} {chunk!r} belongs to another engine ({chunk.engine}), not this one "
                             f"({self.name}); register it here")
        if not 0 <= chunk.chunk_id < self.num_issued:
            raise ValueError(f"{what} {chunk!r} is unknown: this engine never registered it")
        return chunk

    def check_pinned(self, chunk) -> Chunk:
        """`chunk` if it is pinned here; else ValueError naming it."""
        self.check(chunk)
        if chunk.chunk_id not in self.pinned:
            raise ValueError(f"chunk {chunk!r} is not pinned (it was registered with pin=False or unpinned "
                             f"already)")
        return chunk

    def chunk_ids(self, prompt, tokenizer, vocab_size: int) -> list[int]:
        """The ids of a chunk to register: text (tokenized without special tokens) or token ids."""
        if isinstance(prompt, Chunk):
            raise TypeError(f"register_chunk takes text or a list of token ids, got {prompt!r}")
        ids, _ = self._piece(prompt, tokenizer, "the chunk")
        limit = LIMIT["chunk_token_id"]
        bad = limit.first_outside(ids, vocab_size=vocab_size)
        if bad is not None:
            raise ValueError(f"the chunk holds token id {bad!r}, outside the vocabulary "
                             f"{limit.interval(vocab_size=vocab_size)}")
        return ids

    def pieces(self, prompt, tokenizer, index: int) -> tuple[list, tuple[Piece, ...]]:
        """A composite prompt's concatenated ids (checked against the vocabulary by the caller) and its
        pieces; TypeError or ValueError naming the prompt and the piece."""
        ids: list = []
        found = []
        for j, p in enumerate([prompt] if isinstance(prompt, Chunk) else list(prompt)):
            if isinstance(p, Chunk):   # its tuple's ids as they are: one copy, into the prompt's list
                chunk = self.check(p, f"prompt {index} piece {j}")
                found.append((chunk, len(ids), len(chunk.token_ids)))
                ids += chunk.token_ids
                continue
            piece_ids, chunk = self._piece(p, tokenizer, f"prompt {index} piece {j}")
            found.append((chunk, len(ids), len(piece_ids)))
            ids += piece_ids
        pieces = tuple(Piece(c, n, None if c is None else self.variant(c, ids, start)) for c, start, n in found)
        return ids, pieces

    def ids_array(self, ids: list, pieces: tuple[Piece, ...]) -> np.ndarray:
        """A composite prompt's ids (`pieces`' result) as one int64 array: each chunk's array made once, when a
        prompt first holds it, and joined (a copy at memory speed); only the other pieces' ids are converted."""
        parts, start = [], 0
        for p in pieces:
            if p.chunk is None:
                parts.append(np.array(ids[start:start + p.num_tokens], np.int64))
            else:
                a = self.arrays.get(p.chunk.chunk_id)
                if a is None:
                    a = self.arrays[p.chunk.chunk_id] = np.array(p.chunk.token_ids, np.int64)
                    a.flags.writeable = False
                parts.append(a)
            start += p.num_tokens
        return np.concatenate(parts)

    def _piece(self, p, tokenizer, what: str) -> tuple[list, Chunk | None]:
        """One piece's ids and chunk (None for text or ids)."""
        if hasattr(p, "tolist"):
            p = p.tolist()
        if isinstance(p, Chunk):
            return list(self.check(p, what).token_ids), p
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"{what} is text but the checkpoint has no tokenizer; pass token ids")
            ids = list(tokenizer.encode(p, add_special_tokens=False))
        elif isinstance(p, (list, tuple)) and all_ints(p):
            ids = [int(t) for t in p]
        else:
            raise TypeError(f"{what} must be a Chunk, a string or a list of token ids, got {type(p).__name__} "
                            f"{p!r:.80}")
        if not ids:
            raise ValueError(f"{what} has no tokens: {p!r:.80}")
        return ids, None
