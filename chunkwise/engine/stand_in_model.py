"""A stand-in for the model's forward, so that the engine's host work can be run and timed alone.

`HashLogitsModel` takes `Model`'s constructor and `forward` signatures but runs no layer and writes no K/V: the
logits of each sampled row are a hash of its token id and position over the vocabulary. Every step still schedules,
pages, builds its inputs, samples and appends tokens as with the real model, and a prompt gives the same tokens on
every run and device (no generator: a CUDA graph can capture it). An engine runs it when its class says so:

    class HostOnlyEngine(Engine):
        model_class = HashLogitsModel

(benchmarks/bench_host.py, the benchmarks' CPU tier). One device only: tensor parallelism refuses it.

A step with a row plan (a blend's, chunkwise/engine/row_plan.py) selects its rows as the model's check layers do
(`select_rows`, or `select_padded` over a blend graph's static inputs), with a deviation hashed from each row's id
and position instead of its K/V's, and leaves the rows kept in `plan.kept`: its report and the rows sampled are
then a real selection's. Placing K/V (`place`) writes nothing.
"""
from __future__ import annotations

import torch

from chunkwise.model_config import ModelConfig
from chunkwise.kernels.split_kv import DEFAULT_SPLIT_SIZE
from chunkwise.engine.kv_cache import LayerCaches
from chunkwise.engine.model import StepInputs
from chunkwise.engine.row_plan import RowInputs, select_padded, select_rows
from chunkwise.engine.distributed.tensor_parallel import TensorParallel

_MOD = 65521                     # a prime: every residue of a row's key gives a different argmax column
_ROW, _COLUMN = 40503, 2654435 % _MOD


class HashLogitsModel:
    """Model's interface with logits [N, vocab] float32 in [0, 1) hashed from each sampled row's id and position."""

    reduce_in_norm = False   # the runner's warm-up asks: no all-reduce here

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split_size: int = DEFAULT_SPLIT_SIZE,
                 deterministic: bool = False, tp: TensorParallel | None = None, fa3_prefill: bool = False):
        if tp is not None:
            raise ValueError(f"{type(self).__name__} runs on one device; got tensor parallelism over {tp.size} ranks")
        self.cfg = cfg
        device = weights["model.embed_tokens.weight"].device
        self.columns = torch.arange(cfg.vocab_size, dtype=torch.int64, device=device) * _COLUMN

    def forward(self, inp: StepInputs, kv_caches: LayerCaches, place: bool = True) -> torch.Tensor:
        ids, positions = inp.input_ids, inp.positions
        plan = inp.row_plan
        if plan is not None:   # the rows that reach the last layer (logits_indices count in them)
            kept, placed = torch.arange(ids.shape[0], device=ids.device), plan.placed
            for layer in sorted(plan.checks):
                deviation = ((ids[kept] % _MOD * _COLUMN + positions[kept]) % _MOD).to(torch.float32)
                check = plan.checks[layer]
                keep = (select_rows(check, deviation, placed) if check.padded is None
                        else select_padded(check.padded, deviation, placed))
                kept, placed = kept[keep], placed[keep]
            plan.kept = kept
            ids, positions = ids[kept], positions[kept]
        rows = inp.logits_indices
        key = (ids[rows] % _MOD * _ROW + positions[rows]) % _MOD
        return ((key[:, None] + self.columns[None, :]) % _MOD).to(torch.float32) / _MOD

    def place(self, plan: RowInputs, kv_caches: LayerCaches) -> None:
        """No K/V to place."""

    def warm_up_deterministic(self, max_rows: int) -> None:
        """Nothing to compile."""
