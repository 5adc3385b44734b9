"""Rank 0's sampling of a launched step: greedy tokens as the device took them, other tokens (and logprobs) from
the step's logits, each request drawing from its own generator.

A step with non-greedy or logprobs requests is sampled before the next one is launched: its logits are read here,
and the next step cannot feed a token that is drawn only here.
"""
from __future__ import annotations

import torch

from chunkwise.sampling import make_generator, sample, token_logprobs
from chunkwise.engine.host_step import Launched


class Sampler:
    """Samples launched steps; holds each sampling request's generator until `release`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generators: dict[int, torch.Generator | None] = {}

    def sample(self, step: Launched) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
        """Tokens (and requested logprobs) per seq_id of a launched step, waiting for its greedy tokens.
        Sequences that ended since the launch are skipped."""
        if step.ready is not None:
            step.ready.synchronize()
        greedy = step.host_tokens.tolist()
        logits = step.logits
        tokens, logprobs = {}, {}
        for row, seq in enumerate(step.seqs):
            if seq.is_finished:
                continue
            params = seq.sampling_params
            if params.greedy:
                token = greedy[row]
            else:
                if seq.seq_id not in self.generators:
                    self.generators[seq.seq_id] = make_generator(params, self.device)
                token = sample(logits[row], params, self.generators[seq.seq_id])
            tokens[seq.seq_id] = token
            if params.logprobs is not None:
                logprobs[seq.seq_id] = token_logprobs(logits[row], token, params.logprobs)
        return tokens, logprobs

    def release(self, seq_id: int) -> None:
        """Forgets a finished request's generator."""
        self.generators.pop(seq_id, None)
