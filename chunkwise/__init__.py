"""chunkwise: a paged, chunked-prefill LLM inference engine in Triton, and its full-context reference.

    from chunkwise import Engine, SamplingParams      # the fast engine (chunkwise.engine)
    from chunkwise.reference import Engine            # the oracle: same signature, recomputes everything

Subpackages: `engine` (page pool, scheduler, runner, CUDA graphs, tensor parallelism), `reference`,
`kernels` (Triton kernels beside their PyTorch twins). The modules at this level are what both engines
share: model and engine configs, weights, tokenizer, requests, sampling and output types, checkpoints.
"""
import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported: CPU-only users get the interpreter, which runs the
# same kernels. Every import of the project passes here first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from chunkwise.chunks import Blend, Chunk, ChunkReuse  # noqa: E402
from chunkwise.engine import Engine, StepOutput  # noqa: E402
from chunkwise.model_config import ModelConfig, RopeConfig  # noqa: E402
from chunkwise.sampling import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["Blend", "Chunk", "ChunkReuse", "Engine", "ModelConfig", "RequestOutput", "RopeConfig", "SamplingParams", "StepOutput"]
