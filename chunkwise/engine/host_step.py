"""What one step hands from the runner's preparation to its forward and on to sampling: the step's inputs on the
host (`HostStep`, also what rank 0 sends a tensor-parallel worker) and the launched step (`Launched`).

A token sampled by the last launched step but not yet known on the host (a sequence's pending token) is fed to the
next step on the device: its input id is gathered from that step's tokens (`fill_pending`), so launching step k+1
never waits for step k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from chunkwise.kernels.cascade import CascadeGroups
from chunkwise.engine.page_changes import PageChanges
from chunkwise.engine.row_plan import HostRows

ALIGN = 16   # elements: each packed or static input starts 16-element aligned


@dataclass
class HostStep:
    """A step's inputs on the host (numpy), rows in flat-batch order: B = prefill rows then decode rows."""
    ids: np.ndarray              # int64 [T]
    positions: np.ndarray        # int64 [T]
    slots: np.ndarray            # int64 [T]
    logits_indices: np.ndarray   # int64 [N]
    rows: np.ndarray             # int64 [B], each sequence's row of PageTables
    seq_lens: np.ndarray         # int32 [B], tokens in the cache after this step
    query_start_loc: np.ndarray  # int32 [P + 1], prefill rows only
    num_prefill: int             # P
    cascade: CascadeGroups | None = None   # the decodes' shared splits (host tensors)
    page_changes: PageChanges = field(default_factory=PageChanges.none)   # the batch's, applied to PageTables
    # Whether a row samples from the logits or asks for logprobs (SamplingParams.needs_logits): only then does
    # the host read the logits (so the step cannot overlap the next), and under tensor parallelism only then are
    # they gathered whole (each rank's argmax is enough for greedy tokens).
    needs_logits: bool = False
    # Tokens still pending (ids -1 here): their rows in the flat batch, and the rows of the last launched
    # step's sampled tokens that hold them.
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # int64 [M]
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # int64 [M]
    row_plan: HostRows | None = None   # the step's row plan (chunkwise/engine/row_plan.py); rows above are layer 0's


@dataclass
class Launched:
    """A step whose forward is launched: the sequences that sample (in logits-row order), their logits, and
    the copy to the host of their greedy tokens (complete once `ready` has passed)."""
    seqs: list
    logits: torch.Tensor | None   # [N, vocab] as Model.forward gives them; a graph step's last until the next replay;
                                  # None under tensor parallelism when no row samples from them (see HostStep)
    host_tokens: torch.Tensor     # int64 [N], argmax of each row (pinned on GPU)
    ready: torch.cuda.Event | None
    needs_logits: bool            # HostStep's: a row's token or logprobs come from the logits on the host
    # The step's row plan and the rows (layer-0 layout) its last layer computed: on the host, complete once `ready`
    # has passed, as `host_tokens` are.
    row_plan: tuple[HostRows, torch.Tensor] | None = None


def fill_pending(ids: torch.Tensor, pending: torch.Tensor, src: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """ids[pending] = last_tokens[src], on the device (no wait for the step that sampled them)."""
    if len(pending):
        ids.index_copy_(0, pending, last_tokens.index_select(0, src))


def synthetic_step(chunks: list[int], num_decodes: int) -> HostStep:
    """A step of fresh prefills (chunk lengths) and decodes at position 0 that stores nothing (slot -1)."""
    lens = np.array(chunks + [1] * num_decodes, np.int64)
    ends = np.cumsum(lens)
    pos = np.arange(int(ends[-1])) - np.repeat(ends - lens, lens)
    return HostStep(ids=np.ones(len(pos), np.int64), positions=pos, slots=np.full(len(pos), -1, np.int64),
                    logits_indices=ends - 1, rows=np.zeros(len(lens), np.int64), seq_lens=lens.astype(np.int32),
                    query_start_loc=np.concatenate(([0], ends[:len(chunks)])).astype(np.int32),
                    num_prefill=len(chunks))
