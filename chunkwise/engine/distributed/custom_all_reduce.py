"""A tensor-parallel group's one-shot all-reduce through peer memory (chunkwise/kernels/all_reduce.py), as vLLM's custom
all-reduce: for the all-reduces that fit its buffers (a decode step's [rows, hidden], up to MAX_BYTES a rank), NCCL
for the rest.

Each rank owns one buffer (receive slots, then flags) that every rank maps (chunkwise/engine/distributed/peer_memory.py).

Building it is collective: every rank builds it at the same point, and only conditions that are the same on every
rank decide whether it is used, so every call takes the same path on all ranks.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch

from chunkwise.kernels.all_reduce import PeerBuffers, push_all_reduce
from chunkwise.engine.distributed.peer_memory import PeerMemory, native_atomics

MAX_BYTES = 8 << 20   # per rank and call; above a few MB NCCL's ring is as fast (docs/BENCHMARKS.md)
MAX_WORLD = 8         # one NVLink domain's GPUs


def unusable(rank: int, size: int, device: torch.device) -> str | None:
    """Why the custom all-reduce cannot serve ranks 0..size-1 on consecutive CUDA devices (rank `rank` on
    `device`), or None. The same answer on every rank: it depends on the machine only."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not 2 <= size <= MAX_WORLD:
        return f"tensor_parallel_size={size} is outside 2..{MAX_WORLD}"
    devices = range(device.index - rank, device.index - rank + size)
    for a in devices:
        for b in devices:
            if a == b:
                continue
            if not torch.cuda.can_device_access_peer(a, b):
                return f"cuda:{a} cannot access cuda:{b}'s memory (no peer access)"
            if not native_atomics(a, b):
                return f"cuda:{a} has no native atomics on cuda:{b}'s memory (peer access not over NVLink)"
    return None


class CustomAllReduce:
    """This rank's handle: `all_reduce(x)` and `add_rms_norm(...)` for tensors that `fits`; `abort()` (any
    thread) ends every call waiting for a peer; `stopped()` is the error to raise once a call gave up (and where it
    stood); `close()` unmaps every rank's buffer here (each lives until no process maps it)."""

    def __init__(self, rank: int, size: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 timeout: timedelta, programs: int, all_gather: Callable[[torch.Tensor], torch.Tensor],
                 barrier: Callable[[], None]):
        self.timeout = timeout
        cap = MAX_BYTES // dtype.itemsize // hidden * hidden
        recv_bytes = -(-2 * size * cap * dtype.itemsize // 256) * 256
        flag_bytes = size * (programs + 1) * 8
        self.memory = PeerMemory(rank, size, recv_bytes + flag_bytes, device, all_gather, timeout.total_seconds())
        self.memory.zero(rank, recv_bytes, flag_bytes)
        bases = [self.memory.ptrs[r] for r in range(size)]
        self.buffers = PeerBuffers(rank, size, hidden, dtype, device, bases, [b + recv_bytes for b in bases], cap,
                                   programs, timeout.total_seconds())
        barrier()   # every rank's flags are zero before any rank's first call

    def fits(self, x: torch.Tensor) -> bool:
        return self.buffers.fits(x)

    @property
    def max_rows(self) -> int:
        """The most rows of `hidden` that `fits`: more go to NCCL."""
        return self.buffers.cap // self.buffers.hidden

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        return push_all_reduce(x, self.buffers)

    def add_rms_norm(self, x, residual, weight, eps, plus_one) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm(sum of x over the ranks, residual, weight)` in the all-reduce's kernel."""
        return push_all_reduce(x, self.buffers, residual=residual, weight=weight, eps=eps, plus_one=plus_one)

    def abort(self) -> None:
        self.buffers.abort()

    def stopped(self) -> str | None:
        """None while no call of this rank gave up; else why this rank's sums cannot be used (read without touching
        the GPU, which may be stuck)."""
        why = self.buffers.gave_up()
        if why is None:
            return None
        return (f"rank {self.buffers.rank}'s custom all-reduce stopped (a call waits at most {self.timeout} for its "
                f"peers, unless aborted): {why}")

    def close(self) -> None:
        self.memory.close()
