"""The full-context reference engine: every step recomputes the whole sequence; the oracle for `chunkwise.engine`."""
from chunkwise.sampling import RequestOutput, SamplingParams
from chunkwise.reference.engine import Engine

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
