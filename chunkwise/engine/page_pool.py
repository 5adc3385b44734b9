"""The page pool: per-sequence page tables (a sequence's list of page ids, the field's usual name), reference counts, and the prefix cache of full pages.

A full page is cached under a hash chain over every token before it plus its own tokens, so a page is
reused only under exactly the same prefix (docs/ARCHITECTURE.md, lesson 2). Its key in the cache is its parent's
chain hash followed by its own token ids' bytes, so a lookup compares the tokens exactly and everything before them
by sha256; its own chain hash (sha256 over that key) is the parent part of its successors' keys. A probe thus
computes no hash: a prompt's pages are looked up by key alone, and only a page becoming full is hashed once.
A page is in exactly one of three states:
  in use      ref_count > 0 (shared when > 1; only cached full pages are ever shared)
  evictable   ref_count == 0, still cached; reusable until evicted in LRU order
  free        ref_count == 0, not cached
A pinned page (a registered chunk's, `pin`) is a cached page holding one reference per pin besides its
sequences': in use, so LRU eviction never takes it, until `unpin` gives the references back.

The pool also reports what it changed in sequences' page tables, for the runner's device copy of them
(`PageTables`): `take_changes` hands over, as a `PageChanges`, the pages each sequence took since the last
call (from which column of its table) and the sequences whose pages were freed since (finished, preempted,
aborted or failed: their rows are released). Nothing downstream compares page tables to find out.

A remembered chain (a registered chunk's pages, looked up once: chunkwise/engine/blend/blender.py) is checked with
`generation`, a number per page bumped whenever the page leaves the cache: the chain's pages are still the ones its
tokens were cached in while their generations are those stamped when it was resolved (one numpy comparison over
the chain, not a Python step per page). A prompt's bytes come from its request's id array when it has one (a
composite prompt's, joined from its chunks' arrays at validation), not from a pass over its Python ints.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from chunkwise.engine.page_changes import PageChanges
from chunkwise.engine.sequence import Sequence


TOKEN_FORMAT = "q"   # a token id in a page's key: int64
TOKEN_BYTES = array(TOKEN_FORMAT).itemsize


def token_bytes(token_ids) -> bytes:
    """Token ids as the bytes of a page's key."""
    return array(TOKEN_FORMAT, token_ids).tobytes()


def page_hash(parent: bytes, tokens: bytes) -> bytes:
    """Stable hash-chain link: sha256 over the parent page's hash and this page's `token_bytes`."""
    return hashlib.sha256(parent + tokens).digest()


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    hash: bytes | None = None                 # set while the page is in the prefix cache
    parent_hash: bytes = b""
    tokens: bytes = b""                       # its token ids' `token_bytes`, while cached

    @property
    def key(self) -> bytes:
        """Its key in the prefix cache: the parent's chain hash, then its own token bytes."""
        return self.parent_hash + self.tokens

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(array(TOKEN_FORMAT, self.tokens))


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an integer >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_page_ids: deque[int] = deque(range(num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self.cached: dict[bytes, int] = {}                        # parent_hash + tokens -> page id
        self.pins: dict[int, int] = {}                            # pinned page id -> pins holding it (>= 1)
        self.generation = np.zeros(num_pages, np.int64)           # bumped each time a page leaves the cache
        # What take_changes reports next: seq id -> (first column, pages taken since), and the seq ids freed since
        # (an ordered set).
        self._new: dict[int, tuple[int, list[int]]] = {}
        self._released: dict[int, None] = {}

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now: free ones plus evictable cached ones."""
        return len(self.free_page_ids) + len(self.evictable)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def probe_prefix(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """The cached full pages (page id, hash) that continue seq's hash chain; changes nothing.

        The last token is never taken from the cache, so every admission computes at least one token
        (its logits give the next token).
        """
        if seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already holds pages {seq.page_table}; a prefix is "
                             f"matched at admission only")
        found: list[tuple[int, bytes]] = []
        if not self.enable_prefix_caching:
            return found
        return self._walk(self.seq_bytes(seq, (seq.num_tokens - 1) // self.page_size * self.page_size))

    @staticmethod
    def seq_bytes(seq: Sequence, n: int, lo: int = 0) -> bytes:
        """`token_bytes` of seq's tokens lo..n-1 (TOKEN_FORMAT is int64, native order: an int64 array's bytes)."""
        return seq.id_array(lo, n).tobytes()

    def _walk(self, data: bytes) -> list[tuple[int, bytes]]:
        """The cached pages (page id, chain hash) continuing the chain of `data`, token bytes of whole pages, from
        the start. Prompts run to many thousands of tokens: their bytes are made in one pass and sliced per page."""
        found: list[tuple[int, bytes]] = []
        if not self.enable_prefix_caching:
            return found
        parent = b""
        step = TOKEN_BYTES * self.page_size
        for lo in range(0, len(data), step):
            page_id = self.cached.get(parent + data[lo:lo + step])
            if page_id is None:
                break
            parent = self.pages[page_id].hash
            found.append((page_id, parent))
        return found

    def chain_pages(self, token_ids) -> list[int]:
        """The cached pages continuing the hash chain of token_ids' full pages from the start; changes nothing."""
        return [page_id for page_id, _ in self.chain(token_ids)]

    def seq_chain_pages(self, seq: Sequence, n: int) -> list[int]:
        """`chain_pages` of seq's first n tokens (their bytes from `seq_bytes`)."""
        return [page_id for page_id, _ in self._walk(self.seq_bytes(seq, n // self.page_size * self.page_size))]

    def chain(self, token_ids) -> list[tuple[int, bytes]]:
        """`chain_pages` with each page's chain hash."""
        return self._walk(token_bytes(token_ids[:len(token_ids) // self.page_size * self.page_size]))

    def stamp(self, page_ids: np.ndarray) -> np.ndarray:
        """The generations of cached pages (int64 [n]), for `still_cached` to compare later."""
        return self.generation[page_ids]

    def still_cached(self, page_ids: np.ndarray, stamp: np.ndarray) -> bool:
        """Whether pages stamped while cached (`stamp`) have not left the cache since (an evicted page that is
        cached again, under its old tokens or others, has a new generation), so that a chain resolved from its
        tokens can be reused without them: one comparison over the chain."""
        return bool(np.array_equal(self.generation[page_ids], stamp))

    @property
    def num_pinned_pages(self) -> int:
        return len(self.pins)

    def pin(self, page_ids: list[int]) -> None:
        """One more reference on each cached page of page_ids, so eviction skips it until `unpin`."""
        bad = [p for p in page_ids if self.pages[p].hash is None]
        if bad:   # checked before changing anything
            raise ValueError(f"pages {bad} are not in the prefix cache; only cached pages are pinned")
        for page_id in page_ids:
            page = self.pages[page_id]
            if page.ref_count == 0:
                del self.evictable[page_id]
            page.ref_count += 1
            self.pins[page_id] = self.pins.get(page_id, 0) + 1

    def unpin(self, page_ids: list[int]) -> None:
        """Give back `pin`'s references, tail first (as `free`): a page no one holds becomes evictable."""
        bad = [p for p in page_ids if p not in self.pins]
        if bad:
            raise ValueError(f"pages {bad} are not pinned")
        for page_id in reversed(page_ids):
            page = self.pages[page_id]
            self.pins[page_id] -= 1
            if not self.pins[page_id]:
                del self.pins[page_id]
            page.ref_count -= 1
            if page.ref_count == 0:
                self.evictable[page_id] = None

    def can_admit(self, prefix: list[tuple[int, bytes]], num_new_tokens: int) -> bool:
        """Whether a sequence taking `prefix` (from probe_prefix) finds pages for num_new_tokens more."""
        need = self.pages_needed(len(prefix) * self.page_size + num_new_tokens) - len(prefix)
        taken_evictable = sum(1 for page_id, _ in prefix if self.pages[page_id].ref_count == 0)
        return need <= self.num_free_pages - taken_evictable

    def take_prefix(self, seq: Sequence, prefix: list[tuple[int, bytes]]) -> int:
        """Give seq the probed prefix pages (shared, ref-counted); returns the tokens they hold."""
        if seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already holds pages {seq.page_table}")
        for page_id, h in prefix:
            page = self.pages[page_id]
            if page.hash != h:
                raise ValueError(f"page {page_id} no longer holds the probed prefix of sequence {seq.seq_id}")
            if page.ref_count == 0:
                del self.evictable[page_id]
            page.ref_count += 1
            self._record(seq, page_id)
            seq.page_hashes.append(h)
        seq.num_computed_tokens = len(prefix) * self.page_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def match_prefix(self, seq: Sequence) -> int:
        """probe_prefix then take_prefix: seq takes every cached page continuing its chain."""
        return self.take_prefix(seq, self.probe_prefix(seq))

    def num_new_pages(self, seq: Sequence, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return max(0, self.pages_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.page_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_pages(seq, num_new_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend seq.page_table to cover num_computed_tokens + num_new_tokens tokens."""
        need = self.num_new_pages(seq, num_new_tokens)
        if need > self.num_free_pages:
            raise ValueError(f"sequence {seq.seq_id} needs {need} new pages for {num_new_tokens} tokens, "
                             f"only {self.num_free_pages} are free (call can_allocate first)")
        taken = [self._take_page() for _ in range(need)]   # in bulk: a long prompt takes hundreds of pages
        for page_id in taken:
            self.pages[page_id].ref_count = 1
        self._new.setdefault(seq.seq_id, (len(seq.page_table), []))[1].extend(taken)
        seq.page_table.extend(taken)

    def _record(self, seq: Sequence, page_id: int) -> None:
        """Append page_id to seq's page table, and to the pages take_changes reports next."""
        self._new.setdefault(seq.seq_id, (len(seq.page_table), []))[1].append(page_id)
        seq.page_table.append(page_id)

    def _take_page(self) -> int:
        """A free page if there is one, else the least recently used evictable page, dropped from the cache."""
        if self.free_page_ids:
            return self.free_page_ids.popleft()
        page_id, _ = self.evictable.popitem(last=False)
        page = self.pages[page_id]
        del self.cached[page.key]
        self.generation[page_id] += 1
        page.hash, page.parent_hash, page.tokens = None, b"", b""
        return page_id

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """After a step wrote K/V: cache the pages that became full of its first num_tokens tokens (default:
        every computed token; under overlap scheduling, those of the steps that completed)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = num_tokens // self.page_size
        if num_full > len(seq.page_table):
            raise ValueError(f"sequence {seq.seq_id} has {num_tokens} computed tokens but only "
                             f"{len(seq.page_table)} pages")
        first, ps = len(seq.page_hashes), self.page_size
        data = self.seq_bytes(seq, num_full * ps, first * ps)   # the new full pages' bytes, made at once
        step = TOKEN_BYTES * ps
        for i in range(first, num_full):
            parent = seq.page_hashes[-1] if seq.page_hashes else b""
            tokens = data[(i - first) * step:(i - first + 1) * step]
            h = page_hash(parent, tokens)
            seq.page_hashes.append(h)
            page = self.pages[seq.page_table[i]]
            # Another sequence may have cached the same content first: keep that one, this page stays private.
            key = parent + tokens
            if key not in self.cached:
                self.cached[key] = page.page_id
                page.hash, page.parent_hash, page.tokens = h, parent, tokens

    def free(self, seq: Sequence) -> None:
        """Give back seq's pages: cached ones become evictable, the rest free. Resets seq to no pages."""
        # Tail pages first, so that under LRU a prefix's later pages are evicted before its head.
        for page_id in reversed(seq.page_table):
            page = self.pages[page_id]
            if page.ref_count < 1:
                raise ValueError(f"page {page_id} of sequence {seq.seq_id} has ref_count {page.ref_count}")
            page.ref_count -= 1
            if page.ref_count == 0:
                if page.hash is not None:
                    self.evictable[page_id] = None
                else:
                    self.free_page_ids.append(page_id)
        if seq.page_table:
            self._new.pop(seq.seq_id, None)   # pages it took since the last changes are gone with the rest
            self._released[seq.seq_id] = None
        seq.page_table = []
        seq.page_hashes = []
        seq.num_computed_tokens = 0

    def take_changes(self) -> PageChanges:
        """The page-table changes since the last call (see `PageChanges`); the next call starts empty."""
        new, self._new = self._new, {}
        released, self._released = self._released, {}
        if not new and not released:
            return PageChanges.none()
        pages = [p for _, taken in new.values() for p in taken]
        return PageChanges(released=np.fromiter(released, np.int64, len(released)),
                           seq_ids=np.fromiter(new, np.int64, len(new)),
                           first_columns=np.array([first for first, _ in new.values()], np.int64),
                           num_new_pages=np.array([len(taken) for _, taken in new.values()], np.int64),
                           page_ids=np.array(pages, np.int64))

    def release_again(self, changes: PageChanges) -> None:
        """The tables may not have applied `changes` (the step carrying them failed): their releases go out
        again with the next changes. A release is idempotent and comes before any later write, so this is safe
        whether or not they were applied."""
        for seq_id in changes.released.tolist():
            self._released[seq_id] = None
