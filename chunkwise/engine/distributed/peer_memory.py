"""Device memory one rank allocates and every rank of its group maps into its own process, through CUDA's virtual
memory API, as NCCL and torch's symmetric memory map their peers' buffers.

Each rank creates its allocation with cuMemCreate, exports it as a POSIX file descriptor and sends the descriptor
to every peer over an abstract Unix datagram socket (SCM_RIGHTS); each imports its peers' allocations and maps
them with access for its own device only. Not CUDA IPC handles (cudaIpcOpenMemHandle): those enable peer access
for the whole context and give each process a context on its peers' devices; with them a 28-layer TP=2 engine
hung in its warm-up on two H200s, both GPUs busy, whether CUDA loaded kernels lazily or eagerly, while the same
kernel over torch's symmetric memory (this API) ran. Not torch's symmetric memory itself: its rendezvous keys come
from a per-process counter, so a second engine in a process (fresh workers, counters at 0) waits forever.
"""
from __future__ import annotations

import array
import ctypes
import functools
import os
import socket
from typing import Callable

import torch

# CUDA driver API enums
_PINNED = 1                # CU_MEM_ALLOCATION_TYPE_PINNED
_POSIX_FD = 1              # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_DEVICE = 1                # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3            # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_RECOMMENDED = 1           # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_P2P_NATIVE_ATOMICS = 3    # CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, once torch has initialised CUDA (every driver call needs cuInit)."""
    torch.cuda.init()
    return ctypes.CDLL("libcuda.so.1")


def native_atomics(a: int, b: int) -> bool:
    """Whether CUDA device a's atomics on device b's memory are native (NVLink: yes; PCIe: usually not), which
    the all-reduce's flags, released into peers' memory, need."""
    cu = _driver()
    da, db, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for err in (cu.cuDeviceGet(ctypes.byref(da), a), cu.cuDeviceGet(ctypes.byref(db), b),
                cu.cuDeviceGetP2PAttribute(ctypes.byref(value), _P2P_NATIVE_ATOMICS, da, db)):
        if err:
            return False
    return value.value == 1


def _socket_name(pid: int) -> bytes:
    return b"\0chunkwise-peer-memory-%d" % pid


def exchange_fds(rank: int, size: int, fd: int, all_gather: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device, timeout_s: float) -> dict[int, int]:
    """Collective: sends `fd` to every other rank and returns theirs, duplicated into this process, by rank.
    `all_gather(x)` gathers a tensor on `device` from every rank (the group's collective); it names the sockets, and
    every rank has bound its socket before it returns, so no send finds its peer missing. One exchange at a time
    per process (the socket is named by the process id)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(_socket_name(os.getpid()))
        sock.settimeout(timeout_s)
        pids = all_gather(torch.tensor([os.getpid()], dtype=torch.int64, device=device)).flatten().tolist()
        for r in range(size):
            if r != rank:
                # sendmsg, not socket.send_fds: Python 3.11's send_fds drops its address argument
                sock.sendmsg([rank.to_bytes(4, "little")], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                             array.array("i", [fd]))], 0, _socket_name(pids[r]))
        got = {}
        try:
            while len(got) < size - 1:
                msg, fds, _, sender = socket.recv_fds(sock, 8, 1, socket.MSG_CMSG_CLOEXEC)
                src = int.from_bytes(msg, "little") if len(msg) == 4 else -1
                if (len(fds) == 1 and 0 <= src < size and src != rank and src not in got
                        and sender == _socket_name(pids[src])):
                    got[src] = fds[0]
                else:   # not a peer's message (any process of this network namespace can send here)
                    for f in fds:
                        os.close(f)
        except BaseException:
            for f in got.values():
                os.close(f)
            raise
    return got


class PeerMemory:
    """`nbytes` (rounded up to the allocation granularity) of device memory per rank: `ptrs[r]` is rank r's, as an
    address this process's device reads and writes. Collective to build; `close()` unmaps and releases them (a
    peer's memory lives on until every process that maps it released it or exited)."""

    def __init__(self, rank: int, size: int, nbytes: int, device: torch.device,
                 all_gather: Callable[[torch.Tensor], torch.Tensor], timeout_s: float):
        torch.cuda.synchronize(device)   # torch has made the device's primary context: every driver call runs in it
        self.cu = _driver()
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.nbytes = nbytes
        self.handles: dict[int, int] = {}
        self.ptrs: dict[int, int] = {}
        self._dev, self.ctx = ctypes.c_int(), None
        self._check("cuDeviceGet", self.cu.cuDeviceGet(ctypes.byref(self._dev), self.device.index))
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._dev))
        self.ctx = ctx
        try:
            self._build(rank, size, all_gather, timeout_s)
        except BaseException:
            self.close()
            raise

    def _build(self, rank, size, all_gather, timeout_s) -> None:
        prop = _AllocationProp(type=_PINNED, requestedHandleTypes=_POSIX_FD,
                               location=_Location(_DEVICE, self.device.index))
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop), _RECOMMENDED)
        self.nbytes = -(-self.nbytes // granularity.value) * granularity.value
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(prop),
                   ctypes.c_ulonglong(0))
        self.handles[rank] = handle.value
        fd = ctypes.c_int()
        self._call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_uint64(handle.value), _POSIX_FD,
                   ctypes.c_ulonglong(0))
        try:
            fds = exchange_fds(rank, size, fd.value, all_gather, self.device, timeout_s)
        finally:
            os.close(fd.value)
        try:
            for r, peer_fd in sorted(fds.items()):
                handle = ctypes.c_uint64()
                self._call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(peer_fd),
                           _POSIX_FD)
                self.handles[r] = handle.value
        finally:
            for peer_fd in fds.values():
                os.close(peer_fd)
        for r in range(size):
            self._map(r, self.handles[r])

    def _call(self, name: str, *args) -> None:
        """The driver function `name` in this device's primary context (whichever device is current)."""
        self._check("cuCtxPushCurrent_v2", self.cu.cuCtxPushCurrent_v2(self.ctx))
        err = getattr(self.cu, name)(*args)
        popped = ctypes.c_void_p()
        pop_err = self.cu.cuCtxPopCurrent_v2(ctypes.byref(popped))
        self._check(name, err)
        self._check("cuCtxPopCurrent_v2", pop_err)

    def _check(self, name: str, err: int) -> None:
        if err:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(err, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed on {self.device}: {(msg.value or b'CUDA error %d' % err).decode()}")

    def _map(self, rank: int, handle: int) -> None:
        """Maps rank `rank`'s allocation into `ptrs[rank]`, read-write for this device."""
        ptr = ctypes.c_uint64()
        size = ctypes.c_size_t(self.nbytes)
        self._call("cuMemAddressReserve", ctypes.byref(ptr), size, ctypes.c_size_t(0), ctypes.c_uint64(0),
                   ctypes.c_ulonglong(0))
        try:
            self._call("cuMemMap", ctypes.c_uint64(ptr.value), size, ctypes.c_size_t(0), ctypes.c_uint64(handle),
                       ctypes.c_ulonglong(0))
        except BaseException:
            self._call("cuMemAddressFree", ctypes.c_uint64(ptr.value), size)
            raise
        self.ptrs[rank] = ptr.value   # mapped: close() undoes it from here on
        access = _AccessDesc(_Location(_DEVICE, self.device.index), _READ_WRITE)
        self._call("cuMemSetAccess", ctypes.c_uint64(ptr.value), size, ctypes.byref(access), ctypes.c_size_t(1))

    def zero(self, rank: int, offset: int, nbytes: int) -> None:
        """Zeroes bytes [offset, offset + nbytes) of rank `rank`'s memory and waits for it."""
        self._call("cuMemsetD8_v2", ctypes.c_uint64(self.ptrs[rank] + offset), ctypes.c_ubyte(0),
                   ctypes.c_size_t(nbytes))
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Unmaps and releases every rank's memory here, after this device's work; every step is tried, and the
        first error raised after all of them."""
        if self.ctx is None:
            return
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as exc:   # a sticky CUDA error must not keep the rest mapped
                errors.append(exc)
        attempt(torch.cuda.synchronize, self.device)
        size = ctypes.c_size_t(self.nbytes)
        for ptr in self.ptrs.values():
            attempt(self._call, "cuMemUnmap", ctypes.c_uint64(ptr), size)
            attempt(self._call, "cuMemAddressFree", ctypes.c_uint64(ptr), size)
        for handle in self.handles.values():
            attempt(self._call, "cuMemRelease", ctypes.c_uint64(handle))
        self.ptrs, self.handles = {}, {}
        attempt(self._check, "cuDevicePrimaryCtxRelease_v2", self.cu.cuDevicePrimaryCtxRelease_v2(self._dev))
        self.ctx = None
        if errors:
            raise errors[0]
