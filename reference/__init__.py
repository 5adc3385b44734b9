"""The full-context reference engine: every step recomputes the whole sequence; the oracle for `optimized`."""
from chunkwise.sampling import RequestOutput, SamplingParams
from reference.engine import Engine

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
