"""Megatron-style tensor parallelism: the slice of each weight a rank holds, and the collectives of its forward.

Rank r of N holds (H query heads, KV key/value heads, I = intermediate_size, V = vocab_size, P = ceil(V / N)):
  q_proj (and its bias)       rows of query heads [r*H/N, (r+1)*H/N)                          column-parallel
  k_proj, v_proj (and biases) rows of KV heads [r*KV/N, (r+1)*KV/N) when N divides KV; else   column-parallel
                              (KV divides N) the one KV head r*KV//N, replicated on N/KV ranks
  o_proj                      columns of its query heads; the partial outputs are summed by one all_reduce and
                              the bias added once, after it                                   row-parallel
  gate_proj, up_proj          rows [r*I/N, (r+1)*I/N) each (fused as gate then up, as on one device)
  down_proj                   those columns, then one all_reduce                               row-parallel
  embed_tokens, lm_head       vocabulary rows [r*P, min((r+1)*P, V)): a rank embeds the ids in its slice and zeros
                              the others, and an all_reduce adds the one non-zero row of each token; lm_head gives
                              the rank its slice of the logits (padded to P rows): greedy tokens come from the
                              slices' row maxima, the whole logits are gathered only when a row samples
  norms, q_norm, k_norm       whole (replicated)
A rank's query heads all read its own KV heads in the same order as on one device (local query head j reads local
KV head j // group), so the attention kernels run unchanged on the shard, and each rank's paged KV cache holds
only its KV heads, with the same pages and page tables on every rank.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from chunkwise.model_config import ModelConfig
from chunkwise.engine.distributed.custom_all_reduce import CustomAllReduce, unusable

# torch >= 2.12 names all_gather_into_tensor all_gather_single (the old name warns there); same arguments.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


ISSUE_WAIT_S = 60


class CollectiveGuard:
    """Rank 0's eager collectives and its watcher's abort, kept apart. After NCCL's communicators are aborted, a
    collective issued from the host waits for the lost rank instead of failing (seen on two H200s: an all-gather
    issued after a worker was killed hung its step), so the watcher marks the group lost and aborts it under the
    lock that each collective holds while it checks the mark and enqueues itself (a decode graph's replay, holding
    NCCL kernels, counts as one): none is issued after the abort."""

    def __init__(self):
        self._lock = threading.Lock()
        self.lost: str | None = None

    @contextmanager
    def issuing(self) -> Iterator[None]:
        """Held while one collective (or a graph replay holding collectives) is enqueued."""
        if not self._lock.acquire(timeout=ISSUE_WAIT_S):   # only an abort stuck in its own call holds it so long
            raise RuntimeError(f"no collective is issued: the watcher's abort has held the group for {ISSUE_WAIT_S} s")
        try:
            if self.lost is not None:
                raise RuntimeError(f"no collective is issued once {self.lost}")
            yield
        finally:
            self._lock.release()

    def stop(self, why: str, abort: Callable[[], None], wait_s: float = 1.0) -> None:
        """Marks the group lost, then aborts it. A collective still enqueueing gets `wait_s` to finish first; one
        that blocks longer (its host call waiting for the lost rank) is aborted under it."""
        held = self._lock.acquire(timeout=wait_s)
        try:
            self.lost = why
            abort()
        finally:
            if held:
                self._lock.release()


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` on `device`, over torch.distributed's default process group; `custom` serves the
    all-reduces that fit it (see `with_custom_all_reduce`), NCCL or gloo the others."""
    rank: int
    size: int
    cfg: ModelConfig
    device: torch.device
    custom: CustomAllReduce | None = field(default=None, compare=False)
    guard: CollectiveGuard | None = field(default=None, compare=False)   # rank 0's, when it has a watcher

    # ---- what this rank holds ----------------------------------------------------------------------
    @property
    def q_heads(self) -> range:
        n = self.cfg.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        kv = self.cfg.num_kv_heads
        if kv >= self.size:
            n = kv // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank * kv // self.size   # replicated: this rank's query heads all map to this KV head
        return range(first, first + 1)

    @property
    def vocab_rows(self) -> int:
        """P: rows of every rank's (padded) lm_head slice."""
        return math.ceil(self.cfg.vocab_size / self.size)

    @property
    def vocab(self) -> range:
        p = self.vocab_rows
        return range(min(self.rank * p, self.cfg.vocab_size), min((self.rank + 1) * p, self.cfg.vocab_size))

    def shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (HF names; a copy, so the whole can be freed)."""
        d, inter = self.cfg.head_dim, self.cfg.intermediate_size // self.size
        q, kv = self.q_heads, self.kv_heads
        kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = w[self.vocab.start:self.vocab.stop]
        elif kind == "q_proj":
            w = w[q.start * d:q.stop * d]
        elif kind in ("k_proj", "v_proj"):
            w = w[kv.start * d:kv.stop * d]
        elif kind == "o_proj" and name.endswith(".weight"):
            w = w[:, q.start * d:q.stop * d]
        elif kind in ("gate_proj", "up_proj"):
            w = w[self.rank * inter:(self.rank + 1) * inter]
        elif kind == "down_proj":
            w = w[:, self.rank * inter:(self.rank + 1) * inter]
        return w.clone(memory_format=torch.contiguous_format)

    def with_custom_all_reduce(self, dtype: torch.dtype, timeout: timedelta) -> TensorParallel:
        """This rank with the custom all-reduce for `dtype` activations built (collective: every rank calls it),
        or as it is where the machine cannot run it: on CUDA devices a warning says why; off CUDA (gloo) it is
        never expected, so nothing is said."""
        reason = unusable(self.rank, self.size, self.device)
        if reason is not None:
            if self.device.type == "cuda":   # on by default: say why these GPUs do without it
                warnings.warn(f"custom all-reduce off, NCCL serves every all-reduce: {reason}", stacklevel=2)
            return self
        programs = self.min(torch.cuda.get_device_properties(self.device).multi_processor_count)
        return replace(self, custom=CustomAllReduce(self.rank, self.size, self.cfg.hidden_size, dtype, self.device,
                                                    timeout, programs, self.all_gather, lambda: self.min(0)))

    # ---- collectives (every rank calls them in the same order) ---------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        if self.custom is not None and self.custom.fits(x):
            return self.custom.all_reduce(x)
        with self.issuing():
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        out = torch.empty(self.size * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
        with self.issuing():
            _all_gather_flat(out, x)   # concatenated along dim 0 (gloo insists on that layout)
        return out.view(self.size, *x.shape)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] from each rank's [N, P] slice (padding columns dropped)."""
        parts = self.all_gather(logits)                       # [size, N, P]
        return parts.permute(1, 0, 2).reshape(logits.shape[0], self.size * logits.shape[1])[:, :self.cfg.vocab_size]

    def argmax_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [N], the same on every rank: each row's argmax over the whole vocabulary, from this rank's [N, P]
        slice of the logits (as `Model.forward` leaves them). The slices' row maxima and their first
        positions are gathered ([N, 2] a rank, not [N, P]) and the first rank holding the largest wins, so equal
        maxima go to the lowest id, as in torch.argmax over the gathered logits. Padding columns never count."""
        valid = len(self.vocab)   # this rank's real columns; the rest of its P pad the last slice
        pair = torch.full((logits.shape[0], 2), -math.inf, dtype=torch.float64, device=logits.device)
        if valid:   # float64 holds every bf16/fp32 logit and every token id exactly
            top, idx = logits[:, :valid].max(dim=-1)
            pair[:, 0], pair[:, 1] = top, idx + self.vocab.start
        parts = self.all_gather(pair)                                # [size, N, 2]
        best = parts[..., 0].argmax(dim=0, keepdim=True)             # the first rank of the largest maximum
        return parts[..., 1].gather(0, best)[0].long()

    def gather_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., num_kv_heads, head_dim] from each rank's [..., local_kv_heads, head_dim]: the KV heads in order,
        each once (a replicated head is taken from the first rank that holds it)."""
        parts = self.all_gather(x)
        kv = self.cfg.num_kv_heads
        ranks = range(self.size) if kv >= self.size else [h * self.size // kv for h in range(kv)]
        return torch.cat([parts[r] for r in ranks], dim=-2)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        with self.issuing():
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def stopped(self) -> str | None:
        """Why this rank's sums cannot be used (its custom all-reduce gave up a call), or None."""
        return self.custom.stopped() if self.custom is not None else None

    def issuing(self):
        """The context in which to enqueue collectives of this rank: see CollectiveGuard (a no-op without one)."""
        return self.guard.issuing() if self.guard is not None else nullcontext()
