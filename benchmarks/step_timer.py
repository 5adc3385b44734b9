"""Step-time breakdown of a chunkwise.Engine: schedule / prepare / forward / sample / postprocess per step.

Wraps the engine's own methods on the instance (nothing in the engine changes). With device_sync (for a
synchronous engine) it synchronises the device after the forward, so the forward's GPU time is its own and
not charged to sampling; the breakdown then says where a step's time goes. Without it (for an engine with
overlap scheduling) every phase is host time, the forward only its launch, and `sample` includes the wait
for the step in flight: then host time (step - wait) against the step's wall time says how well it hides.
A `_step` call launches one step and postprocesses the one before it under overlap: phases and wall time
are per call, classed by the step it launches.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.roofline import Ceilings, ModelCost

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


class StepTimer:
    def __init__(self, engine, device_sync: bool = True):
        self.engine = engine
        self.steps: list[dict] = []
        self._current: dict = {}
        self._wrapped: list = []
        executor, sched = engine.executor, engine.scheduler
        self._wrap(sched, "schedule", "schedule")
        self._wrap(executor.runner, "prepare", "prepare")
        self._wrap(executor.runner, "forward", "forward", sync=device_sync, inspect=self._inspect)
        self._wrap(executor, "sample", "sample")
        self._wrap(sched, "postprocess", "postprocess")
        self._wrap(engine.core, "step", "step", new_step=True)

    def _wrap(self, obj, name, phase, sync=False, inspect=None, new_step=False):
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            if new_step:
                self._current = {"at": time.perf_counter()}   # when the step began (any process's clock)
            if inspect is not None:
                inspect(*args)
            start = time.perf_counter()
            out = real(*args, **kwargs)
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - start
            if new_step and "forward" in self._current:
                # the runner's launches by (kind, path) so far: a window's difference says how its steps ran
                self._current["launches"] = dict(self.engine.executor.runner.launches)
                self.steps.append(self._current)
            return out
        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def detach(self) -> None:
        """The engine's own methods back (the wrappers are attributes of the instances)."""
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped.clear()

    def _inspect(self, host):
        # Decode-only: every sequence computes one token (a row plan's rows are not its tokens). Not
        # num_prefill == 0: short decodes take paged_attention's rows, counted there, on CPU (split_kv_threshold 256)
        # and in deterministic mode (no split-KV).
        decode_only = host.row_plan is None and len(host.ids) == len(host.seq_lens)
        self._current.update(tokens=len(host.ids), decode_only=decode_only, batch=len(host.seq_lens),
                             context_lens=np.asarray(host.seq_lens, np.int64))

    def summary(self, cost: ModelCost, ceilings: Ceilings) -> dict:
        """Mean ms per phase for decode-only and mixed steps; decode forwards against their memory roofline."""
        out = {}
        for kind, steps in (("decode", [s for s in self.steps if s["decode_only"]]),
                            ("mixed", [s for s in self.steps if not s["decode_only"]])):
            if not steps:
                continue
            row = {p: 1e3 * float(np.mean([s.get(p, 0.0) for s in steps])) for p in PHASES}
            row["other"] = 1e3 * float(np.mean([s["step"] - sum(s.get(p, 0.0) for p in PHASES) for s in steps]))
            row["step"] = 1e3 * float(np.mean([s["step"] for s in steps]))
            row.update(steps=len(steps), tokens=float(np.mean([s["tokens"] for s in steps])))
            if kind == "decode":
                roof = [cost.decode_step(s["context_lens"])[0] / ceilings.copy_bytes_per_s for s in steps]
                row["mem_roofline_ms"] = 1e3 * float(np.mean(roof))
                row["forward_over_roofline"] = float(np.sum([s["forward"] for s in steps]) / np.sum(roof))
                row["step_over_roofline"] = float(np.sum([s["step"] for s in steps]) / np.sum(roof))
            out[kind] = row
        return out


def format_summary(name: str, summary: dict) -> str:
    lines = []
    for kind, r in summary.items():
        phases = " ".join(f"{p} {r[p]:.3f}" for p in (*PHASES, "other"))
        line = (f"{name} {kind}: {r['steps']} steps, {r['tokens']:.0f} tokens/step; ms/step: {phases}; "
                f"wall {r['step']:.3f}")
        if "mem_roofline_ms" in r:
            line += (f"; vs the step's memory roofline {r['mem_roofline_ms']:.3f} ms: forward "
                     f"{r['forward_over_roofline']:.2f}x, wall {r['step_over_roofline']:.2f}x")
        lines.append(line)
    return "\n".join(lines)
