"""The tensor-parallel stall, reproduced with the all-reduce kernel alone: two processes, one GPU each, replaying a
CUDA graph shaped like a TP=2 decode step (64 calls of [rows, hidden] bf16, each after a GEMM), with every call's
start and end stamped on the GPU (%globaltimer), in phases that each start the step a different way:

  steady        back to back after warm replays
  idle S        after both GPUs idled S seconds (host asleep)
  busy S        after S seconds of GEMMs instead of idling (clocks kept up, no idle GPU)
  host-spin S   after S seconds idle with the host spinning, not asleep
  profiler      the first replays under torch.profiler (both ranks' traces written)

for the custom all-reduce, the same with every poll of its wait reading the abort word in host memory (as before
issue 51's fix: host_poll_after_ns=0) and NCCL, in the same slot. Per phase and rank: each call's time (its
kernel's wait for the peer included), the calls over STALL_US, and the SM clock (NVML) before and after.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD python -m benchmarks.all_reduce_idle --out out/idle
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

from chunkwise.engine.distributed.custom_all_reduce import CustomAllReduce
from chunkwise.kernels.all_reduce import HOST_POLL_AFTER_NS, _clock_ns

HIDDEN, ROWS, CALLS = 4096, 256, 64
STALL_US = 500.0
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@triton.jit
def _stamp_kernel(out_ptr, i):
    tl.store(out_ptr + i, _clock_ns())


def _sm_clock(index: int) -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    except Exception:
        return -1


def _rank_main(rank: int, size: int, port: int, out: str, phases: list, modes: list) -> None:
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120), device_id=dev)

    def all_gather(x):
        o = torch.empty(size * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(o, x)
        return o.view(size, *x.shape)
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    car = CustomAllReduce(rank, size, HIDDEN, torch.bfloat16, dev, timedelta(seconds=60), programs, all_gather,
                          dist.barrier)
    gen = torch.Generator(device=dev).manual_seed(rank)
    w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) * 0.01
    h = torch.randn(ROWS, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    stamps = torch.zeros(2 * CALLS, dtype=torch.int64, device=dev)
    results = {}
    for mode in modes:
        car.buffers.host_poll_after_ns = 0 if mode == "custom-host-poll" else HOST_POLL_AFTER_NS
        def step():
            x = h
            for c in range(CALLS):
                y = x @ w
                _stamp_kernel[(1,)](stamps, 2 * c)
                if mode != "nccl":
                    car.all_reduce(y)
                else:
                    dist.all_reduce(y)
                _stamp_kernel[(1,)](stamps, 2 * c + 1)
                x = y
        for _ in range(3):   # compile and warm eagerly, together
            step()
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        dist.barrier()

        raw = []

        def replays(n):
            rows = []
            for _ in range(n):
                graph.replay()
                torch.cuda.synchronize()
                s = stamps.tolist()
                raw.append(s)
                rows.append([(s[2 * c + 1] - s[2 * c]) / 1e3 for c in range(CALLS)])
            return rows
        replays(20)
        for name, seconds in phases:
            dist.barrier()
            torch.cuda.synchronize()
            clock0 = _sm_clock(rank)
            if name == "idle":
                time.sleep(seconds)
            elif name == "host-spin":
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
            elif name == "busy":
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    for _ in range(50):
                        h @ w
                    torch.cuda.synchronize()
            clock1 = _sm_clock(rank)
            if name == "profiler" and mode != "nccl":
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    rows = replays(3)
                prof.export_chrome_trace(f"{out}/trace_{mode}_rank{rank}.json")
            else:
                rows = replays(3)
            clock2 = _sm_clock(rank)
            label = f"{name} {seconds}" if seconds else name
            if rank == 0 and name == "profiler" and mode != "nccl":   # which processes hold a context on each GPU
                import subprocess
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                                       "--format=csv"], capture_output=True, text=True).stdout
                results.setdefault("apps", {})[mode] = apps
            results.setdefault(mode, {})[label] = dict(
                clocks=[clock0, clock1, clock2], step_us=[sum(r) for r in rows], calls_us=rows,
                stalls=[sum(v > STALL_US for v in r) for r in rows], first_stamps_ns=raw[-len(rows)])
        del graph
    Path(out, f"idle_rank{rank}.json").write_text(json.dumps(results))
    car.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/idle")
    p.add_argument("--idle", type=float, nargs="*", default=[0.1, 2.0])
    p.add_argument("--modes", nargs="*", default=["custom-host-poll", "custom", "nccl"])
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    phases = ([("steady", 0)] + [("idle", s) for s in a.idle] + [("busy", max(a.idle)), ("host-spin", max(a.idle)),
                                                                  ("profiler", 0)])
    mp.spawn(_rank_main, args=(2, 29511, a.out, phases, a.modes), nprocs=2, join=True)
    ranks = [json.loads(Path(a.out, f"idle_rank{r}.json").read_text()) for r in range(2)]
    print("compute apps after the profiler phase:", ranks[0].pop("apps", None))
    for mode in ranks[0]:
        print(f"\n{mode}: per phase, each rank's 3 steps: step ms, calls over {STALL_US:.0f} us; SM MHz before idle, "
              "after it, after the steps")
        for label in ranks[0][mode]:
            cells = []
            for r, res in enumerate(ranks):
                x = res[mode][label]
                cells.append(f"r{r} " + " ".join(f"{s / 1e3:.2f}({n})" for s, n in zip(x["step_us"], x["stalls"]))
                             + f" clk {x['clocks']}")
            print(f"  {label:14} " + " | ".join(cells))
        for label in ranks[0][mode]:   # the first step's long calls, both ranks, in call order
            first = [[round(v) for v in res[mode][label]["calls_us"][0]] for res in ranks]
            long = [(c, first[0][c], first[1][c]) for c in range(CALLS) if max(first[0][c], first[1][c]) > STALL_US]
            if long:
                print(f"  {label}: first step's long calls (call, rank 0 us, rank 1 us): {long}")
                # when each rank entered each long call, from its first stamp of that step (its own clock)
                for r, res in enumerate(ranks):
                    s = res[mode][label]["first_stamps_ns"]
                    print(f"    rank {r} enters them at us: {[round((s[2 * c] - s[0]) / 1e3) for c, _, _ in long]}")


if __name__ == "__main__":
    main()
