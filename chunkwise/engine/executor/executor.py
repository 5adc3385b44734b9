"""What the engine runs its steps through: `Executor` on one device, `MultiprocExecutor` over tensor-parallel ranks.

The engine schedules and postprocesses; an executor launches a scheduled batch (`execute`), samples a launched step
(`sample`), reads a sequence's K/V back (`gather_kv`), forgets finished requests (`release`) and frees everything
(`close`). Both hold rank 0's ModelRunner (this process's device) and Sampler; MultiprocExecutor also holds the
worker processes (`Workers`) and sends them what each call needs, as vLLM's executors own the ranks while the
runner only prepares and runs.

Under tensor parallelism (see workers.py for the failures and what becomes of the workers): preparing a step runs
before anything is sent and sampling after every rank's forward, so the ranks are in step there and a failure is
contained as on one device; between the send and the end of rank 0's forward it is not (TensorParallelError). Each
step is confirmed after sampling (`Workers.check`): sampling waits for the logits, so for the whole step, and a rank
lost meanwhile (NCCL runs asynchronously: an aborted collective may have left rank 0 running on) voids the step,
also when it is why sampling failed.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from chunkwise.engine_config import EngineConfig
from chunkwise.weights import load_weights
from chunkwise.engine.host_step import HostStep, Launched
from chunkwise.engine.model import Model
from chunkwise.engine.model_runner import Forward, ModelRunner
from chunkwise.engine.executor.workers import ApplyPageChanges, GatherKV, StepMessage, Workers
from chunkwise.engine.sampler import Sampler

Sampled = tuple[dict[int, int], dict[int, dict[int, float]]]   # tokens and logprobs per seq_id


class Executor:
    """One device, in this process."""

    def __init__(self, config: EngineConfig, model_class: type = Model):
        weights = load_weights(config.path, config.dtype, config.device, cfg=config.model_config)
        self._hold(ModelRunner(config, weights, model_class=model_class))

    def _hold(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sampler = Sampler(runner.device)
        self.num_pages = runner.kv.num_pages

    @property
    def failure(self) -> str | None:
        """Why the ranks were torn down, once one failed (never, on one device)."""
        return None

    def execute(self, batch) -> Launched:
        """Launches a ScheduledBatch's forward (see ModelRunner.run)."""
        return self.runner.run(batch)

    def sample(self, step: Launched) -> Sampled:
        """Tokens (and requested logprobs) per seq_id of a launched step, waiting for its greedy tokens."""
        return self.sampler.sample(step)

    def gather_kv(self, seq, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_layers, num_tokens, kv_heads, head_dim] of a sequence's first tokens, from its pages."""
        return self.runner.kv.at(self.runner.kv.slots(seq.page_table, num_tokens))

    def release(self, seq_id: int) -> None:
        """Forgets a finished request's generator (its page-table row goes back through the next PageChanges)."""
        self.sampler.release(seq_id)

    def close(self) -> None:
        """Frees the KV cache, the CUDA graphs and the weights."""
        self.runner.close()


class MultiprocExecutor(Executor):
    """Ranks 0..N-1: rank 0 in this process, the others in worker processes that run what it sends them."""

    def __init__(self, config: EngineConfig, model_class: type = Model):
        if model_class is not Model:   # the workers build their own Model
            raise ValueError(f"model_class {model_class.__name__} is not supported with tensor_parallel_size="
                             f"{config.tensor_parallel_size}: a stand-in model runs on one device")
        self.workers = workers = Workers(config)   # they load their shards while this process loads its own
        try:
            weights = load_weights(config.path, config.dtype, config.device, cfg=config.model_config,
                                   shard=workers.tp.shard)
            workers.join()
            runner = workers.start(lambda tp: ModelRunner(config, weights, tp))
        except BaseException:
            workers.close()
            raise
        # Closed with the executor, when it is garbage collected, or at interpreter exit.
        self._stop_workers = weakref.finalize(self, workers.close)
        self._hold(runner)

    @property
    def failure(self) -> str | None:
        return self.workers.error

    def execute(self, batch) -> Launched:
        """As on one device, the prepared step sent to every worker before rank 0's forward. A step whose
        preparation fails (contained, as on one device) still sends the workers its page changes, which rank 0's
        page tables took first, so every rank's tables keep the same rows. (Changes that rank 0 refused as
        inconsistent fail the worker too: a broken pool cannot be served on.)"""
        sent = False

        def on_every_rank(host: HostStep, forward: Callable[[], Forward]) -> Forward:
            nonlocal sent
            sent = True
            return self.workers.together(StepMessage(host), forward)

        try:
            return self.runner.run(batch, on_every_rank)
        except Exception:
            if not sent:
                self.workers.together(ApplyPageChanges(batch.page_changes), lambda: None)
            raise

    def sample(self, step: Launched) -> Sampled:
        """As on one device, then the step confirmed (see the module's docstring)."""
        try:
            result = self.sampler.sample(step)
        except Exception:
            self.workers.check()
            raise
        self.workers.check()
        return result

    def gather_kv(self, seq, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every KV head, each from the rank that holds it; confirmed once complete, as a step is in `sample`."""
        slots: np.ndarray = self.runner.kv.slots(seq.page_table, num_tokens)
        kv = self.workers.together(GatherKV(slots), lambda: self.runner.kv.at(slots))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self.workers.check()
        return kv

    def close(self) -> None:
        """Stops the workers (rank 0's runner freed before the process group is left), then frees the runner."""
        self._stop_workers()
        self.runner.close()
