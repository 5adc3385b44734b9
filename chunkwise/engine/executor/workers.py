"""The worker processes of a tensor-parallel engine, and rank 0's handle on them (`Workers`).

Rank 0 is the engine's own process: it schedules, samples and postprocesses as on one device. Ranks 1..N-1 are
processes it starts (torch.multiprocessing, spawn), each on its own device (the CUDA device N places after the
engine's, or the CPU) with its shard of the checkpoint and its own ModelRunner. All ranks join torch.distributed's
default process group (NCCL on CUDA, gloo on CPU) through a TCPStore that rank 0 serves on a free localhost port.
Each step rank 0 sends every worker one message over its pipe (`StepMessage`: the step's HostStep, page-table
writes included), then runs its own forward; the collectives inside the forward keep the ranks in step. The
executor (executor.py) decides what to send; this module moves it and watches the processes.

Failures (the engine cannot contain a failure once a step is in the ranks' hands: their caches may disagree
from there, so the engine closes and raises `TensorParallelError` rather than run on):
- a worker that raises reports the error over its pipe and exits; rank 0 watches the workers' processes. Its
  collective then fails (gloo: the dead peer's socket closes; NCCL: the watcher aborts the process group and the
  custom all-reduce, whose kernels then stop waiting), or the next step's liveness check does; the error names
  the rank, its exit code and its exception. A custom all-reduce call that gave up (aborted or timed out) fails
  the step on every rank: rank 0 checks it after each step, a worker before each command.
- an exception or KeyboardInterrupt on rank 0 between sending a step and the end of its forward: the workers may
  wait in a collective rank 0 will not join; they are terminated and the exception goes on (an Exception as
  TensorParallelError). Before the send (preparing the step) and after the forward (sampling) the ranks are in
  step, and the engine contains a failure as on one device.
- a collective (NCCL or custom) waits at most COLLECTIVE_TIMEOUT; a worker waiting for its next step waits on
  its pipe, untimed.
- workers ignore SIGINT (Ctrl-C reaches the whole process group; rank 0 decides) and exit when rank 0's process
  does. `close()` (the engine's close, its garbage collection, or interpreter exit: weakref.finalize) sends them
  `Close()` and terminates any that have not exited after CLOSE_GRACE_S.
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkwise.engine_config import EngineConfig
from chunkwise.weights import load_weights
from chunkwise.engine.host_step import HostStep
from chunkwise.engine.model_runner import ModelRunner
from chunkwise.engine.page_changes import PageChanges
from chunkwise.engine.distributed.tensor_parallel import CollectiveGuard, TensorParallel

COLLECTIVE_TIMEOUT = timedelta(minutes=10)   # one collective, and the start-up rendezvous
CLOSE_GRACE_S = 10.0                         # a worker's time to exit after Close() before it is terminated
EXIT_GRACE_S = 2.0                           # after a failed collective, time for a dying worker's exit to show
HOST = "127.0.0.1"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died; the engine is closed."""


# What rank 0 sends a worker over its pipe, one message per command.
@dataclass(frozen=True)
class StepMessage:
    """Run this step (its page-table writes, then the forward) as rank 0 does."""
    host: HostStep


@dataclass(frozen=True)
class ApplyPageChanges:
    """Apply these page changes alone: rank 0's page tables took them, but the step carrying them failed before it
    was sent (the ranks' tables must take the same changes in the same order, or their rows drift apart)."""
    changes: PageChanges


@dataclass(frozen=True)
class GatherKV:
    """Join rank 0's gathering of the K/V at these cache slots (int64 [n])."""
    slots: np.ndarray


@dataclass(frozen=True)
class Close:
    """Free the runner, leave the process group and exit."""


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    if config.device.type == "cuda":
        return torch.device("cuda", config.device.index + rank)
    return config.device


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Workers:
    """Ranks 1..N-1 of an engine with tensor_parallel_size N, seen from rank 0, and rank 0's runner, built beside
    theirs (`start`)."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError(f"tensor_parallel_size={config.tensor_parallel_size}: torch.distributed is already "
                               f"initialised in this process (another tensor-parallel Engine still open, or a "
                               f"launcher's process group); close() that engine first")
        self.config, self.size = config, config.tensor_parallel_size
        self.backend = _backend(config.device)
        self.guard = CollectiveGuard()   # rank 0's collectives, kept from running past the watcher's abort
        # Rank 0's; `start` puts in the one with the custom all-reduce, which is then aborted with NCCL and checked
        # each step.
        self.tp = TensorParallel(0, self.size, config.model_config, rank_device(config, 0), guard=self.guard)
        self.error: str | None = None      # why the workers were torn down, once a rank failed
        self._joined = self._closed = False
        self._runner: ModelRunner | None = None   # rank 0's (`start`), freed before the group is left
        self.procs, self.conns = [], []
        self.store = dist.TCPStore(HOST, 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        ctx = mp.get_context("spawn")
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)   # wakes the watcher on close()
        try:
            for rank in range(1, self.size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"chunkwise-tp-rank{rank}", daemon=True,
                                   args=(rank, config, self.store.port, _numerics(), theirs))
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="chunkwise-tp-watcher", daemon=True).start()

    # ---- start-up ----------------------------------------------------------------------------------
    def join(self) -> None:
        """Waits until every worker has loaded its shard, then joins the process group with them (a worker
        that fails first raises here, instead of leaving rank 0 in the rendezvous until it times out)."""
        loading = list(self.conns)
        while loading:
            ready = wait(loading + [p.sentinel for p in self.procs], timeout=COLLECTIVE_TIMEOUT.total_seconds())
            reason = None if ready else f"workers still loading their shards after {COLLECTIVE_TIMEOUT}"
            for conn in ready:
                if conn in loading and conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):   # it died: its exit code tells
                        continue
                    if msg[0] == "loaded":
                        loading.remove(conn)
                    else:
                        reason = self._describe(self.conns.index(conn), msg)
            reason = reason or self._failure()
            if reason is not None:
                self._break(reason)
                raise TensorParallelError(reason)
        dist.init_process_group(self.backend, store=self.store, rank=0, world_size=self.size,
                                timeout=COLLECTIVE_TIMEOUT)
        self._joined = True

    def start(self, build: Callable[[TensorParallel], ModelRunner]) -> ModelRunner:
        """Rank 0's runner, built by build(tp) while the workers build theirs: the custom all-reduce first when
        asked for, so every rank builds it at the same point. A failure tears the workers down and goes on as
        itself. The runner is closed on teardown before the process group is left (its CUDA graphs hold NCCL
        resources)."""
        def build_rank_0() -> ModelRunner:
            self.tp = with_configured_all_reduce(self.tp, self.config)
            return build(self.tp)
        self._runner = self.together(None, build_rank_0, wrap=False)
        return self._runner

    # ---- steps -------------------------------------------------------------------------------------
    def together(self, command, fn, wrap: bool = True):
        """Sends `command` (a StepMessage or GatherKV; None: nothing) to every worker, then returns fn(), rank 0's
        part of it.

        On a failure the workers are torn down: a worker's failure raises TensorParallelError naming it; rank 0's
        own exception is raised as TensorParallelError (wrap) or as itself; KeyboardInterrupt goes on as itself."""
        self.check()
        try:
            if command is not None:
                message = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)   # in-band, once for all
                for conn in self.conns:
                    conn.send_bytes(message)
            return fn()
        except BaseException as exc:
            reason = self._failure(grace=EXIT_GRACE_S)
            own = reason is None
            if own:
                reason = f"rank 0 raised {type(exc).__name__}: {exc}"
            self._break(reason)
            if isinstance(exc, Exception) and (wrap or not own):
                raise TensorParallelError(reason) from exc
            raise

    def check(self) -> None:
        """Raises TensorParallelError if the workers were torn down or one has died."""
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel workers were shut down after a failure: {self.error}")
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers are closed")
        reason = self._failure()
        if reason is None:
            reason = self.tp.stopped()
        if reason is not None:
            self._break(reason)
            raise TensorParallelError(reason)

    # ---- failure and shutdown ----------------------------------------------------------------------
    def _failure(self, grace: float = 0.0) -> str | None:
        """What went wrong with a worker (its error report, or its death), or None if all look well. With a
        grace period, first waits up to that long for a worker to exit (a collective fails as a peer dies)."""
        ended = set(wait([p.sentinel for p in self.procs], timeout=grace))
        for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
            if proc.sentinel in ended:   # exiting: its files close before it can be reaped, so wait for that
                proc.join()
            report = None
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        report = msg
            except (EOFError, OSError):
                pass
            if report is not None or proc.exitcode is not None:
                return self._describe(i, report)
        return None

    def _describe(self, i: int, report: tuple | None) -> str:
        """Worker i's failure: its error report (message and traceback), or how it exited."""
        proc = self.procs[i]
        head = f"tensor-parallel rank {i + 1} (pid {proc.pid})"
        if report is not None:
            return f"{head} failed: {report[1]}\n{report[2]}"
        if self._joined:
            return f"{head} died with exit code {proc.exitcode}"
        return (f"{head} died with exit code {proc.exitcode} while starting (its output above says why; a script "
                f"must create a tensor-parallel Engine under `if __name__ == \"__main__\":`, since each worker is "
                f"a spawned process that imports the script's main module)")

    def _break(self, reason: str) -> None:
        self.error = reason
        self.close()

    def _watch(self) -> None:
        """Aborts rank 0's NCCL communicators (and custom all-reduce) when a worker dies, so a collective waiting
        for it returns, and keeps rank 0 from issuing any after that (see CollectiveGuard)."""
        ready = wait([p.sentinel for p in self.procs] + [self._wake_r])
        if self._closed or self._wake_r in ready or not (self._joined and self.backend == "nccl"):
            return   # gloo notices a dead peer by itself (its socket closes)
        self.guard.stop("a tensor-parallel worker died", self._abort)

    def _abort(self) -> None:
        if self.tp.custom is not None:   # its kernels stop waiting; the step is then reported failed
            self.tp.custom.abort()
        try:   # torch's own helper where it has one, else the group's abort
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is None:
                abort = dist.distributed_c10d._get_default_group().abort
            abort()
        except Exception:   # best effort: the liveness check still reports the death
            pass

    def close(self) -> None:
        """Stops every worker (asked to exit, terminated if it does not) and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(None)
        graceful = self.error is None and self._joined   # else a worker may be inside a collective, or loading
        if not graceful and self.tp.custom is not None:   # rank 0's calls waiting for a worker end now
            self.tp.custom.abort()
        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(Close()))
                except OSError:
                    pass
        if self._runner is not None:
            self._runner.close()
        if self._joined:
            _leave_group(self.backend)
        for proc in self.procs:
            proc.join(CLOSE_GRACE_S if graceful else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self.tp.custom is not None:   # no worker maps rank 0's buffer any more
            self.tp.custom.close()
        self.store = None


def _leave_group(backend: str) -> None:
    """destroy_process_group, after this rank's CUDA graphs are gone (NCCL cannot free a communicator that a
    captured graph still uses) and its work is done; aborted if it has not returned after CLOSE_GRACE_S, so
    closing never hangs."""
    if backend == "nccl":
        torch.cuda.synchronize()
    left = threading.Event()

    def leave():
        try:
            dist.destroy_process_group()
        except Exception:   # a failed NCCL group may refuse; the process is leaving it either way
            pass
        left.set()
    threading.Thread(target=leave, name="chunkwise-tp-leave", daemon=True).start()
    if not left.wait(CLOSE_GRACE_S):
        try:
            dist.distributed_c10d._get_default_group().abort()
        except Exception:
            pass


def with_configured_all_reduce(tp: TensorParallel, config: EngineConfig) -> TensorParallel:
    """tp with the custom all-reduce unless the config opts out (custom_all_reduce=False) or the machine cannot
    run it (collective: every rank calls it, before its KV cache takes the free memory)."""
    return tp.with_custom_all_reduce(config.dtype, COLLECTIVE_TIMEOUT) if config.custom_all_reduce else tp


def _numerics() -> dict:
    """Process-wide settings that change a forward's numbers or speed, so every rank runs as rank 0 does."""
    return dict(num_threads=torch.get_num_threads(), matmul_precision=torch.get_float32_matmul_precision(),
                cuda_tf32=torch.backends.cuda.matmul.allow_tf32)


def _exit_with_parent() -> None:
    wait([mp.parent_process().sentinel])
    os._exit(1)


def _worker_main(rank: int, config: EngineConfig, port: int, numerics: dict, conn) -> None:
    """Rank `rank`: loads its shard, joins the group, builds its runner, then runs each step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        torch.set_num_threads(numerics["num_threads"])
        torch.set_float32_matmul_precision(numerics["matmul_precision"])
        torch.backends.cuda.matmul.allow_tf32 = numerics["cuda_tf32"]
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = TensorParallel(rank, config.tensor_parallel_size, config.model_config, device)
        weights = load_weights(config.path, config.dtype, device, cfg=config.model_config, shard=tp.shard)
        conn.send(("loaded", None))
        store = dist.TCPStore(HOST, port, tp.size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=tp.size,
                                timeout=COLLECTIVE_TIMEOUT)
        runner = ModelRunner(config, weights, tp=with_configured_all_reduce(tp, config))
        del weights
        while True:
            message = pickle.loads(conn.recv_bytes())
            stopped = runner.tp.stopped()
            if stopped is not None:
                raise TensorParallelError(stopped)
            if isinstance(message, StepMessage):
                runner.run_host(message.host)
            elif isinstance(message, ApplyPageChanges):
                runner.tables.apply(message.changes)
            elif isinstance(message, GatherKV):
                runner.kv.at(message.slots)
            elif isinstance(message, Close):
                break
            else:
                raise TypeError(f"rank 0 sent {message!r}, not a StepMessage, ApplyPageChanges, GatherKV or Close")
        runner.close()
        _leave_group(_backend(device))
    except EOFError:   # rank 0 closed its end of the pipe without Close(): it is gone
        os._exit(1)
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)   # not through the process group's teardown, which may wait for the other ranks
