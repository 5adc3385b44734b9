"""How ranks hand each other the file descriptors of their peer-memory allocations
(chunkwise/engine/distributed/peer_memory.py): every rank gets every other rank's descriptor, of the right rank, as a
working descriptor of its own, for two and three ranks (CPU processes over gloo; mapping the allocations themselves
needs GPUs: tests/test_all_reduce_gpu.py)."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkwise.engine.distributed.peer_memory import exchange_fds

pytestmark = pytest.mark.correctness


def _rank(rank: int, size: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

    def all_gather(x):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        return torch.stack(parts)
    fd = os.memfd_create(f"rank{rank}")
    os.write(fd, f"rank {rank}".encode())
    fds = exchange_fds(rank, size, fd, all_gather, torch.device("cpu"), 60.0)
    got = {q: os.pread(f, 64, 0).decode() for q, f in fds.items()}
    for f in fds.values():
        os.close(f)
    os.close(fd)
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(repr(sorted(got.items())))
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_receives_every_peers_descriptor(size, tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))   # served here, for the ranks' group
    mp.spawn(_rank, args=(size, store.port, str(tmp_path)), nprocs=size)
    for rank in range(size):
        got = (tmp_path / f"{rank}.txt").read_text()
        assert got == repr([(q, f"rank {q}") for q in range(size) if q != rank]), f"rank {rank} got {got}"


def test_a_datagram_not_from_the_named_peer_is_ignored():
    """Any process of the network namespace can send to a rank's socket: a message claiming a peer's rank from
    another address is dropped (its descriptor closed), and the peer's own is taken. One process plays rank 0,
    a socket bound under a made-up process id plays rank 1."""
    import array
    import socket

    from chunkwise.engine.distributed.peer_memory import _socket_name
    fake_pid = 2 ** 22 + 12345   # above Linux's pid_max: no real process has it
    real, bogus = os.memfd_create("peer"), os.memfd_create("bogus")
    os.write(real, b"peer's buffer")
    os.write(bogus, b"bogus")
    rights = lambda fd: [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]  # noqa: E731
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as peer, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
        peer.bind(_socket_name(fake_pid))

        def all_gather(x):   # rank 0 has bound its socket by now: the stranger's message arrives first
            stranger.sendmsg([(1).to_bytes(4, "little")], rights(bogus), 0, _socket_name(os.getpid()))
            peer.sendmsg([(1).to_bytes(4, "little")], rights(real), 0, _socket_name(os.getpid()))
            return torch.tensor([[os.getpid()], [fake_pid]])
        own = os.memfd_create("own")
        fds = exchange_fds(0, 2, own, all_gather, torch.device("cpu"), 10.0)
        _, sent, _, _ = socket.recv_fds(peer, 4, 1)
    assert list(fds) == [1] and os.pread(fds[1], 64, 0) == b"peer's buffer"
    assert os.fstat(sent[0]).st_ino == os.fstat(own).st_ino, "rank 0 did not send its own descriptor to the peer"
    for fd in (*fds.values(), *sent, real, bogus, own):
        os.close(fd)
