"""What both engines share: model config, weights, tokenizer, sampling and output types, checkpoints."""
from chunkwise.config import ModelConfig, RopeConfig
from chunkwise.sampling import RequestOutput, SamplingParams

__all__ = ["ModelConfig", "RopeConfig", "RequestOutput", "SamplingParams"]
