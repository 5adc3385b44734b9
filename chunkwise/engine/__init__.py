"""The paged, chunked-prefill engine: page pool, prefix cache, scheduler, Triton kernels, CUDA graphs."""
from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.engine.llm_engine import Engine, StepOutput

__all__ = ["Engine", "RequestOutput", "SamplingParams", "StepOutput"]
