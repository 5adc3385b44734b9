"""One-shot all-reduce through peer memory, optionally fused with the residual add and RMSNorm that follow it.

For the small all-reduces of tensor-parallel decode steps (o_proj and down_proj outputs, [rows, hidden]), where it
is faster than PyTorch's symmetric-memory one-shot all-reduce and NCCL (docs/BENCHMARKS.md, "Behind the code:
all_reduce"). Large ones (prefill) stay on NCCL, which is as fast there.

Layouts (N = world size, P = programs, fixed per set of buffers; cap = elements per rank's region):
    x, out, residual, residual_out:  [rows, hidden], contiguous, rows * hidden <= cap
    weight:                          [hidden]
    recv (each rank's, mapped into every rank's process): [2 slots, N ranks, cap] of x's dtype; rank r writes
                                     only region r
    flags (each rank's, mapped likewise): int64 [N * P + N]: flags[r * P + s] = the last call whose share s rank r
                                     delivered; flags[N * P + r] = 1 once rank r gave up a call (sticky)
    tickets (this rank's device):    int64 [1]: programs started over all calls
    control (this rank's pinned host memory): int64 [5]: [abort asked, a call gave up, and of a program that gave
                                     up while waiting (each that does writes them): its call, the peer it waited
                                     for, the last call that peer had delivered to its share]

A program starts by drawing a ticket t: it serves call e = t // P + 1 and owns share s = t % P, row blocks s, s + P,
... (every call starts P programs, after the last call's ended). It
  1. pushes its rows of x into every peer's recv[e % 2, this rank];
  2. after a CTA barrier, releases e into every peer's flags[this rank, s] (system scope: the barrier orders the
     block's pushes before the release, as in PyTorch's symmetric-memory and vLLM's custom all-reduce kernels);
  3. waits (acquire) until its own flags[r, s] >= e for every peer r; every 1024 reads it polls the clock, and
     once the wait has lasted host_poll_after_ns the abort word too, and gives up when asked to or after
     timeout_ns, so a dead or stuck peer never hangs the GPU. Not the abort word from the start: a read of host
     memory can take milliseconds, and a waiter inside one sees its peer's flag that much late; it then reaches
     the next call late, where its peer waits and polls in turn, and the ranks took turns waiting a poll's
     length at every call for as long as steps ran back to back (the stall of issue 51, reproduced with this
     kernel alone by benchmarks/all_reduce_idle.py; docs/BENCHMARKS.md, Tensor parallelism).
     A call that gives up marks control[1] and every rank's give-up word for its rank; from then on no call of
     any rank waits (each reads its give-up words first) and each marks its control[1]: the host, which reads it
     after every step, raises instead of using sums that a rank computed without its peers' parts;
  4. sums its rows over the ranks in rank order in float32 (the same bits on every rank; for two ranks NCCL's),
     rounds to x's dtype and writes the sum, or (NORM) adds the residual and normalizes exactly as `add_rms_norm`.
Slot e % 2 is free at step 1: at call e - 1 share s saw each peer's share s reach call e - 1, which it does after
reading slot e % 2 in call e - 2. This needs the same rows in the same share on every call, hence the fixed grid and
fixed BLOCK_R; the tickets live in device memory, so CUDA-graph replays count too.
Shares go by ticket, not program id, so the shares a rank has started are always its first ones, in whatever order
(and however partially, as while a module load in its process waits for the GPU to go idle) the GPU starts programs:
the shares both ranks started complete, and the rank that started fewer then goes idle and resumes. By program id, a
TP=2 engine at one program per SM hung in 2 of 4 cold builds on two H200s, rank 0 waiting in a call whose program 0
rank 1 had not started (the dispatch order that allows this is inferred, not observed); by ticket, in none of about
a dozen.
"""
import torch
import triton
import triton.language as tl

from chunkwise.kernels.fused_norm import add_residual, add_rms_norm_ref, store_norm
from chunkwise.kernels.tiling import block_rows, cast, next_power_of_2, num_warps_for

POLL_EVERY = tl.constexpr(1024)   # flag reads between polls of the clock (and, in long waits, the abort word)
HOST_POLL_AFTER_NS = 20_000_000   # a wait polls the abort word in host memory only after this long (docstring)


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["rows", "rank", "read_delay_ns", "host_poll_after_ns"])   # one binary for all
def _all_reduce_kernel(
    x_ptr,            # [rows, hidden] this rank's partial sums
    res_ptr,          # [rows, hidden] residual stream, read if NORM
    w_ptr,            # [hidden] norm weight, read if NORM
    out_ptr,          # [rows, hidden] the sum, or norm(sum + residual) if NORM (may be x)
    res_out_ptr,      # [rows, hidden] sum + residual, written if NORM
    peer_recv_ptr,    # int64 [WORLD] every rank's receive buffer ([2, WORLD, cap]) address in this process
    peer_flags_ptr,   # int64 [WORLD] every rank's flags ([WORLD * PROGRAMS + WORLD]) address in this process
    tickets_ptr,      # int64 [1]: programs started, over all calls
    control_ptr,      # int64 [5] pinned host memory: [abort asked, gave up, call, peer, peer's call]
    rows, hidden, cap, rank, eps, timeout_ns,
    host_poll_after_ns,   # a wait reads the abort word (host memory) only once it has lasted this long
    read_delay_ns,    # 0; tests hold one rank's reads back, as a descheduled peer would be (an argument, not a
                      # constexpr: a second binary compiled while a simulated peer spins on the same GPU stalls it)
    WORLD: tl.constexpr, PROGRAMS: tl.constexpr, NORM: tl.constexpr, PLUS_ONE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    recv_ptr = tl.load(peer_recv_ptr + rank).to(tl.pointer_type(dtype))
    flags_ptr = tl.load(peer_flags_ptr + rank).to(tl.pointer_type(tl.int64))
    # A program's share of the rows is the ticket it draws on starting, not its id (see the module docstring).
    ticket = tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    share = ticket % PROGRAMS
    e = ticket // PROGRAMS + 1
    slot = e % 2
    row0 = tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_N)[None, :]
    col_ok = col < hidden
    blocks = tl.cdiv(rows, BLOCK_R)
    for r in tl.static_range(WORLD):
        if r != rank:
            dst = tl.load(peer_recv_ptr + r).to(tl.pointer_type(dtype)) + (slot * WORLD + rank) * cap
            for b in range(share, blocks, PROGRAMS):
                row = b * BLOCK_R + row0
                mask = (row < rows) & col_ok
                offs = row.to(tl.int64) * hidden + col
                tl.store(dst + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(peer_flags_ptr + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + rank * PROGRAMS + share, e, sem="release", scope="sys")
    failed_ptr = flags_ptr + WORLD * PROGRAMS   # [WORLD] give-up words
    stop = tl.program_id(0) * 0
    for q in tl.static_range(WORLD):
        stop = stop | (tl.load(failed_ptr + q, volatile=True) != 0).to(tl.int32)
    start = _clock_ns()
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(flags_ptr + r * PROGRAMS + share, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < e) & (stop == 0):
                spins += 1
                if spins % POLL_EVERY == 0:
                    waited = _clock_ns() - start
                    aborted = waited < 0   # False
                    if waited >= host_poll_after_ns:   # see the module docstring: host reads stall a short wait
                        aborted = tl.load(control_ptr, volatile=True) != 0
                    stop = (aborted | (waited > timeout_ns)).to(tl.int32)
                    if stop != 0:   # giving up: every rank learns it, the host where it stood
                        for q in tl.static_range(WORLD):
                            peer_flags = tl.load(peer_flags_ptr + q).to(tl.pointer_type(tl.int64))
                            tl.atomic_xchg(peer_flags + WORLD * PROGRAMS + rank, 1, sem="release", scope="sys")
                        tl.store(control_ptr + 2, e)
                        tl.store(control_ptr + 3, r)
                        tl.store(control_ptr + 4, seen)
                seen = tl.atomic_add(flags_ptr + r * PROGRAMS + share, 0, sem="acquire", scope="sys")
    if stop != 0:
        tl.store(control_ptr + 1, 1)
    if read_delay_ns > 0:
        held = _clock_ns()
        while _clock_ns() - held < read_delay_ns:
            stop += 0
    tl.debug_barrier()
    for b in range(share, blocks, PROGRAMS):
        row = b * BLOCK_R + row0
        mask = (row < rows) & col_ok
        offs = row.to(tl.int64) * hidden + col
        acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        for r in tl.static_range(WORLD):
            if r == rank:
                acc += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:   # .cg: the peers wrote it into this GPU's L2; the SM's L1 may hold a stale line of it
                acc += tl.load(recv_ptr + (slot * WORLD + r) * cap + offs, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
        s = cast(acc, dtype)
        if NORM:   # as fused_norm's kernel with a residual: s rounded, plus the residual, rounded, normalized
            xf = add_residual(s.to(tl.float32), res_ptr, res_out_ptr, offs, mask)
            store_norm(xf, w_ptr, out_ptr, offs, mask, col, col_ok, hidden, eps, PLUS_ONE)
        else:
            tl.store(out_ptr + offs, s, mask=mask)


class PeerBuffers:
    """One rank's view of the buffers of one all-reduce group (see the module docstring for each): every rank's
    receive buffer and flags as addresses in this process (peers' mapped in by
    chunkwise/engine/distributed/peer_memory.py, or plain tensors of one device when every rank is simulated on it),
    `cap` elements per rank region, and this rank's ticket counter and control words (`abort()`, `gave_up()`). Every
    rank's flags must be zero before any rank's first call."""

    def __init__(self, rank: int, world: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 recv_ptrs: list[int], flag_ptrs: list[int], cap: int, programs: int, timeout_s: float):
        if len(recv_ptrs) != world or len(flag_ptrs) != world:
            raise ValueError(f"need {world} receive buffers and flags, got {len(recv_ptrs)} and {len(flag_ptrs)}")
        self.rank, self.world, self.hidden, self.dtype, self.programs = rank, world, hidden, dtype, programs
        self.cap = cap
        self.control = torch.zeros(5, dtype=torch.int64).pin_memory()   # read and written while kernels run
        self._control = self.control.numpy()   # the same memory, read each step without torch's indexing
        self.recv_ptrs = torch.tensor(recv_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_ptrs, dtype=torch.int64, device=device)
        self.tickets = torch.zeros(1, dtype=torch.int64, device=device)
        self.timeout_ns = int(timeout_s * 1e9)
        self.block_n = next_power_of_2(hidden)
        self.block_r = block_rows(self.block_n, device)   # fixed (the slot argument); fused_norm's, so its bits
        self.num_warps = num_warps_for(self.block_r * self.block_n)
        self.host_poll_after_ns = HOST_POLL_AFTER_NS   # 0: every poll reads the abort word (the stall's setting)
        self.read_delay_ns = 0   # tests only: this rank waits so long between its flags and its reads

    def abort(self) -> None:
        """Ends every call of this rank waiting for a peer, now and later (any thread)."""
        self._control[0] = 1

    def gave_up(self) -> str | None:
        """None while no call of this rank gave up; else what it knows of why (read without touching the GPU)."""
        if not self._control[1]:
            return None
        call, peer, seen = self._control[2:].tolist()
        if not call:
            return "a call stopped without waiting: another rank had given up first"
        return f"call {call} gave up waiting for rank {peer}, which had delivered its call {seen}"

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[1] == self.hidden and x.numel() <= self.cap and x.is_contiguous()
                and x.dtype == self.dtype)


def push_all_reduce(x: torch.Tensor, buffers: PeerBuffers, out: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, weight: torch.Tensor | None = None, eps: float = 0.0,
                    plus_one: bool = False, residual_out: torch.Tensor | None = None):
    """x [rows, hidden] summed over the ranks into `out` (x itself if None); with `residual` and `weight`, returns
    (norm(sum + residual), sum + residual) as `add_rms_norm` would from the sum, into (out, residual_out)."""
    if not buffers.fits(x):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit the all-reduce buffers ({buffers.dtype}, "
                         f"hidden {buffers.hidden}, at most {buffers.cap} elements, contiguous)")
    norm = residual is not None
    out = x if out is None and not norm else (torch.empty_like(x) if out is None else out)
    if norm:
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
    b = buffers
    _all_reduce_kernel[(b.programs,)](
        x, residual if norm else x, weight if norm else x, out, residual_out if norm else out,
        b.recv_ptrs, b.flag_ptrs, b.tickets, b.control,
        x.shape[0], x.shape[1], b.cap, b.rank, eps, b.timeout_ns, b.host_poll_after_ns, b.read_delay_ns,
        WORLD=b.world, PROGRAMS=b.programs, NORM=norm, PLUS_ONE=plus_one, BLOCK_R=b.block_r, BLOCK_N=b.block_n,
        num_warps=b.num_warps, enable_fp_fusion=False,
    )
    return (out, residual_out) if norm else out


def push_all_reduce_ref(parts: list[torch.Tensor], residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0, plus_one: bool = False):
    """PyTorch twin of `push_all_reduce` given every rank's x (in rank order)."""
    s = sum((p.float() for p in parts[1:]), parts[0].float()).to(parts[0].dtype)
    if residual is None:
        return s
    return add_rms_norm_ref(s, residual, weight, eps, plus_one)
