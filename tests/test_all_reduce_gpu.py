"""The custom all-reduce's kernel on one GPU, its ranks simulated: each rank's buffers are plain device tensors and
each rank's call runs on its own stream, concurrently, as on separate GPUs (chunkwise/kernels/all_reduce.py).

Properties: every rank gets its twin's bits (a rank-order float32 sum; with the norm, `add_rms_norm` of that sum)
over many calls with changing inputs and row counts, also queued back to back with no host wait (the alternating
receive slots keep consecutive calls apart); a call whose peer never comes ends when aborted or timed out, marks
it, and from then on no call of any rank waits.
"""
import time

import pytest
import torch

from chunkwise.kernels import add_rms_norm
from chunkwise.kernels.all_reduce import PeerBuffers, push_all_reduce, push_all_reduce_ref

pytestmark = [pytest.mark.gpu, pytest.mark.correctness]

PROGRAMS = 8   # few, so every simulated rank's programs are resident at once


def _group(world, hidden, dtype, cap_rows=64, timeout_s=10.0):
    cap = cap_rows * hidden
    recv = [torch.zeros(2 * world * cap, dtype=dtype, device="cuda") for _ in range(world)]
    flags = [torch.zeros(world * (PROGRAMS + 1), dtype=torch.int64, device="cuda") for _ in range(world)]
    group = [PeerBuffers(r, world, hidden, dtype, torch.device("cuda"), [t.data_ptr() for t in recv],
                         [t.data_ptr() for t in flags], cap, PROGRAMS, timeout_s) for r in range(world)]
    for b in group:
        b.memory = recv, flags   # the simulated peers' buffers live as long as the group
    return group


STREAMS = {}


def _together(group, fn):
    """fn(rank, buffers) on every rank, each on its own stream, all launched before any is waited for. fn must
    not allocate: the caching allocator may synchronize, and rank 0's call cannot end before rank 1's starts."""
    torch.cuda.synchronize()
    outs = []
    for r, b in enumerate(group):
        with torch.cuda.stream(STREAMS.setdefault(r, torch.cuda.Stream())):
            outs.append(fn(r, b))
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("world, hidden, dtype", [(2, 4096, torch.bfloat16), (2, 1024, torch.float16),
                                                  (3, 896, torch.float32)])
def test_every_rank_gets_the_rank_order_sum_call_after_call(world, hidden, dtype):
    group = _group(world, hidden, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for call, rows in enumerate([1, 64, 7, 64, 33, 2, 17, 64] * 3):   # more rows than programs, and fewer
        parts = [torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=gen) for _ in range(world)]
        ref = push_all_reduce_ref(parts)
        outs = _together(group, lambda r, b: push_all_reduce(parts[r], b))
        for r, out in enumerate(outs):
            assert torch.equal(out, ref), f"call {call}, {rows} rows: rank {r} differs from the rank-order sum"
    assert not any(b.gave_up() for b in group)


@pytest.mark.parametrize("read_delay_us", [0, 200])
def test_back_to_back_calls_never_read_a_slot_the_next_call_is_writing(read_delay_us):
    """Calls queued on each rank's stream with no host wait between them: a rank that finishes call e pushes call
    e + 1 while its peer may still read call e's parts, which alternating slots keep apart. Rank 1's reads are
    also held back 200 us after its wait, so rank 0's next push surely lands while they are pending."""
    world, hidden, dtype, calls = 2, 4096, torch.bfloat16, 32
    group = _group(world, hidden, dtype)
    group[1].read_delay_ns = read_delay_us * 1000
    gen = torch.Generator(device="cuda").manual_seed(2)
    parts = [[torch.randn(64, hidden, device="cuda", dtype=dtype, generator=gen) for _ in range(world)]
             for _ in range(calls)]
    refs = [push_all_reduce_ref(p) for p in parts]
    _together(group, lambda r, b: [push_all_reduce(parts[c][r], b) for c in range(calls)])
    assert not any(b.gave_up() for b in group), "a call gave up waiting for its peer"
    for c in range(calls):
        for r in range(world):
            assert torch.equal(parts[c][r], refs[c]), f"call {c}: rank {r} differs from the rank-order sum"


@pytest.mark.parametrize("plus_one", [False, True])
def test_the_fused_norm_equals_add_rms_norm_of_the_sum(plus_one):
    world, hidden, dtype = 2, 4096, torch.bfloat16
    group = _group(world, hidden, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(hidden, device="cuda", dtype=dtype, generator=gen)
    for rows in (1, 64, 13, 64):
        parts = [torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=gen) for _ in range(world)]
        residual = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=gen)
        want = add_rms_norm(push_all_reduce_ref(parts), residual, weight, 1e-5, plus_one)
        outs = [(torch.empty_like(residual), torch.empty_like(residual)) for _ in range(world)]
        _together(group, lambda r, b: push_all_reduce(parts[r], b, out=outs[r][0], residual=residual, weight=weight,
                                                      eps=1e-5, plus_one=plus_one, residual_out=outs[r][1]))
        for r, (y, s) in enumerate(outs):
            assert torch.equal(s, want[1]), f"{rows} rows: rank {r}'s residual stream differs"
            assert torch.equal(y, want[0]), f"{rows} rows: rank {r}'s norm differs from add_rms_norm's"


# rank 0's first call, alone: it waited for rank 1, which had delivered no call
WAITED_FOR_RANK_1 = "call 1 gave up waiting for rank 1, which had delivered its call 0"


def _alone(b, rows=4):
    """Rank b's call with no peer calling: it can only end by giving up."""
    x = torch.ones(rows, b.hidden, device="cuda", dtype=b.dtype)
    push_all_reduce(x, b)
    return x


def test_an_abort_ends_a_call_waiting_for_a_dead_peer_and_later_calls_do_not_wait():
    group = _group(2, 1024, torch.float32)
    done = torch.cuda.Event()
    _alone(group[0])
    done.record()
    time.sleep(0.5)
    assert not done.query(), "the call ended with no peer and no abort"
    assert group[0].gave_up() is None
    group[0].abort()
    deadline = time.monotonic() + 10
    while not done.query():
        assert time.monotonic() < deadline, "the call did not end after the abort"
        time.sleep(0.01)
    assert group[0].gave_up() == WAITED_FOR_RANK_1, "an aborted call was not marked where it stood"
    group[0].control[0] = 0   # the give-up is sticky without the abort word: rank 0's next call does not wait
    _alone(group[0])
    torch.cuda.synchronize()
    _alone(group[1])   # and the peer, told by rank 0's give-up word, does not wait either
    torch.cuda.synchronize()
    assert group[1].gave_up() is not None and "another rank had given up" in group[1].gave_up(), \
        "the peer never learnt that rank 0 gave up"


def test_a_call_gives_up_after_its_timeout():
    group = _group(2, 1024, torch.float32, timeout_s=0.2)
    done = torch.cuda.Event()
    start = time.monotonic()
    _alone(group[0])
    done.record()
    while not done.query():   # polled, not synchronize(): a broken timeout fails here instead of hanging
        if time.monotonic() - start > 10:
            group[0].abort()
            pytest.fail("the call did not give up after its 0.2 s timeout (aborted after 10 s)")
        time.sleep(0.01)
    waited = time.monotonic() - start
    assert group[0].gave_up() == WAITED_FOR_RANK_1, "a timed-out call was not marked where it stood"
    assert 0.2 <= waited < 5, f"the call waited {waited:.2f} s for a 0.2 s timeout"


def test_a_short_wait_reads_no_abort_word_in_host_memory():
    """Rank 0 waits a few milliseconds for rank 1 (held back by a sleep on its stream), with the abort word already
    set: a wait shorter than host_poll_after_ns polls only the clock, so the call completes with the sum instead
    of giving up. (Polling the abort word from the first poll let a slow host read delay every waiter, the ranks
    taking turns: the stall of issue 51.)"""
    world, hidden, dtype = 2, 1024, torch.float32
    group = _group(world, hidden, dtype)
    assert group[0].host_poll_after_ns > 10_000_000
    parts = [torch.full((4, hidden), float(r + 1), device="cuda", dtype=dtype) for r in range(world)]
    torch.cuda._sleep(1)   # its module loaded now: a lazy load inside _together waits for rank 0's spinning call
    torch.cuda.synchronize()
    group[0].control[0] = 1   # abort asked: only a wait that reads it would give up
    _together(group, lambda r, b: (torch.cuda._sleep(5_000_000) if r == 1 else None, push_all_reduce(parts[r], b)))
    assert group[0].gave_up() is None, "a short wait read the abort word"
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in parts)
