"""EngineConfig: every engine argument in one frozen dataclass, validated once.

Both engines build it from `Engine(model, **kwargs)`; an unknown keyword is a TypeError naming it (the
dataclass's own), a bad value a ValueError naming the field and the value. Building one is a description
only: it opens no file, converts no checkpoint and imports no kernel. The engines' constructors then open it
(`chunkwise.open_config`: the checkpoint, and the checks that depend on the model or the kernels). The
optimized engine hands the opened config to its runner, scheduler and page pool; the reference engine
validates the same fields and ignores the paging ones (`REFERENCE_IGNORED`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chunkwise.limits import LIMIT
from chunkwise.model_config import ModelConfig
from chunkwise.tokenizer import is_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE_TYPES = ("cpu", "cuda")
# The Triton interpreter runs a split-KV decode (split + merge programs) slower than a one-pass decode for short
# contexts; on CPU only long sequences take it by default. On GPU every decode does, which is also what the decode
# CUDA graphs capture.
CPU_SPLIT_KV_THRESHOLD = 256
ATTENTION_BACKENDS = ("triton", "fa3")
# A step holding blended prefills counts against max_num_batched_tokens only their computed rows (each layer's,
# averaged), so it may hold more rows than that at layer 0, where their placed K/V are copied in: up to this many
# budgets' worth (or one whole prompt), what its activations and blend graphs are sized for.
BLENDED_ROWS_PER_BUDGET = 4

# Fields that only the optimized engine's paging, batching and kernels use.
REFERENCE_IGNORED = ("page_size", "num_pages", "gpu_memory_utilization", "max_num_batched_tokens",
                     "max_prefill_tokens_with_decodes", "max_num_seqs",
                     "enable_prefix_caching", "enforce_eager", "split_kv_threshold", "split_size", "cascade_attention",
                     "deterministic", "attention_backend", "tensor_parallel_size", "custom_all_reduce",
                     "async_scheduling", "max_pinned_fraction", "max_graph_tokens")


def _bounded_int(name: str, value) -> None:
    """`value` an integer inside its row of chunkwise.limits (a lower bound alone); else ValueError naming both."""
    limit = LIMIT[name]
    if not is_int(value) or not limit.admits(value):
        raise ValueError(f"{name} must be an integer >= {limit.lower}, got {value!r}")


def _bounded_number(name: str, value) -> None:
    limit = LIMIT[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not limit.admits(value):
        raise ValueError(f"{name} must be a number in {limit.interval()}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine arguments. After construction `dtype` is a torch.dtype and `device` a torch.device; `path` and
    `model_config` are None, and `max_model_len` and `split_size` may be, until `opened` binds the checkpoint
    (`chunkwise.open_config.open_config`, in both engines' constructors)."""
    model: str | os.PathLike
    dtype: str | torch.dtype = "float32"
    device: str | torch.device | None = None
    page_size: int = 16
    max_model_len: int | None = None
    num_pages: int | None = None             # KV pages in the pool; None: sized from memory
    gpu_memory_utilization: float = 0.9      # share of GPU memory the engine may fill (GPU only)
    max_num_batched_tokens: int = 512        # tokens computed per step
    max_prefill_tokens_with_decodes: int | None = None   # prefill tokens a step that also decodes may compute
                                             # (every decoding user waits for it: a smaller step, a shorter
                                             # inter-token gap); None: max_num_batched_tokens
    max_num_seqs: int = 64                   # running sequences per step
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5         # share of the pool that pinned chunks (register_chunk(pin=True)) may hold
    enforce_eager: bool = False              # no CUDA graphs
    max_graph_tokens: int = 512              # mixed and prefill steps of up to this many tokens replay CUDA graphs
                                             # (one device); 0: decode-only steps alone
    split_kv_threshold: int | None = None    # decodes of longer sequences take split-KV; None: 0 on GPU, 256 on CPU
    split_size: int | None = None            # split-KV split length in tokens (a multiple of the split-KV tile);
                                             # None: the kernels' default
    cascade_attention: bool = True           # decodes sharing prefix splits read them once per step
    deterministic: bool = False              # batch-invariant: a token's bits independent of batch, chunks, pages
                                             # (no split-KV then, so split_kv_threshold/split_size/cascade do not apply)
    attention_backend: str = "triton"        # prefill attention: "triton" (chunkwise's kernels) or "fa3" (vLLM's
                                             # FlashAttention-3, where installed, on Hopper; not with
                                             # deterministic=True). Decodes and blends keep chunkwise's kernels.
    tensor_parallel_size: int = 1            # ranks (one process and device each) sharding the model, Megatron-style
    custom_all_reduce: bool = True           # tensor parallel on NVLink GPUs: small all-reduces through peer
                                             # memory, NCCL above its size limit; off where it cannot run
                                             # (docs/ENGINE.md, Several GPUs); False: NCCL for every one
    async_scheduling: bool | None = None     # overlap: prepare step k+1 while the device runs step k; None: on
                                             # with CUDA (on CPU the host is the device: nothing to overlap)
    path: Path | None = field(default=None, init=False, repr=False)                 # the checkpoint directory
    model_config: ModelConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        set_ = object.__setattr__.__get__(self)
        set_("dtype", _resolve_dtype(self.dtype))
        set_("device", _resolve_device(self.device))
        _bounded_int("page_size", self.page_size)
        for name in ("enable_prefix_caching", "enforce_eager", "cascade_attention", "deterministic",
                     "custom_all_reduce", "async_scheduling"):
            if not isinstance(getattr(self, name), bool) and (name != "async_scheduling" or self.async_scheduling
                                                              is not None):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _bounded_number("gpu_memory_utilization", self.gpu_memory_utilization)
        _bounded_number("max_pinned_fraction", self.max_pinned_fraction)
        if self.num_pages is not None:
            _bounded_int("num_pages", self.num_pages)
        _bounded_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _bounded_int("max_num_seqs", self.max_num_seqs)
        if self.max_prefill_tokens_with_decodes is not None:
            _bounded_int("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes)
        _bounded_int("max_graph_tokens", self.max_graph_tokens)
        if self.split_kv_threshold is not None:
            _bounded_int("split_kv_threshold", self.split_kv_threshold)
        _check_tensor_parallel(self)
        _check_attention_backend(self)
        if self.split_kv_threshold is None:
            set_("split_kv_threshold", 0 if self.device.type == "cuda" else CPU_SPLIT_KV_THRESHOLD)
        if self.async_scheduling is None:
            set_("async_scheduling", self.device.type == "cuda")

    def opened(self, path: Path, model_config: ModelConfig, max_model_len: int, split_size: int) -> EngineConfig:
        """This description bound to its checkpoint, with the values `open_config` resolved and checked."""
        config = dataclasses.replace(self, max_model_len=max_model_len, split_size=split_size)
        object.__setattr__(config, "path", path)
        object.__setattr__(config, "model_config", model_config)
        return config

    def blend_refusal(self) -> str | None:
        """What keeps an engine of this config from blending, in words that follow "reuse=...", or None."""
        if not self.enable_prefix_caching:
            return "needs enable_prefix_caching=True: a chunk's own K/V are kept in the prefix cache"
        if self.tensor_parallel_size > 1:
            return (f"is not supported with tensor_parallel_size={self.tensor_parallel_size} (blended prefills run "
                    f"on one device)")
        return None

    @property
    def max_blended_rows(self) -> int:
        """The most rows, placed ones included, a step holding blended prefills takes at layer 0 (decodes too)."""
        return max(self.max_model_len, BLENDED_ROWS_PER_BUDGET * self.max_num_batched_tokens)

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)


def _check_tensor_parallel(config: EngineConfig) -> None:
    """Refuses a tensor_parallel_size the machine cannot run (the model's shape is checked by `open_config`)."""
    n = config.tensor_parallel_size
    _bounded_int("tensor_parallel_size", n)
    if n == 1:
        return
    if config.deterministic and not LIMIT["deterministic_tensor_parallel_size"].admits(n):
        # Two ranks sum each element once (a + b, the same bits on both and for any message size); with
        # more, the collective's reduction order depends on the message size, i.e. on the batch.
        raise ValueError(f"deterministic=True supports tensor_parallel_size up to "
                         f"{LIMIT['deterministic_tensor_parallel_size'].upper}, got {n}")
    if config.device.type == "cuda":
        first = config.device.index
        if first + n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={n} needs CUDA devices {first}..{first + n - 1} (one per rank, "
                             f"from device {config.device}); only {torch.cuda.device_count()} visible")


def _check_attention_backend(config: EngineConfig) -> None:
    """Refuses an unknown backend, and FA3 with deterministic mode (whose decodes give the bits of chunkwise's
    prefill kernel); whether FA3 runs here for this model, `open_config` checks."""
    backend = config.attention_backend
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend != "fa3":
        return
    if config.deterministic:
        raise ValueError("attention_backend='fa3' does not combine with deterministic=True: deterministic decodes "
                         "give the bits of chunkwise's own prefill kernel")


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")


def _resolve_device(device) -> torch.device:
    if device is None:   # resolved like an explicit "cuda" (an index: tensor-parallel ranks count from it)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"device {device!r} is not supported; expected one of {list(DEVICE_TYPES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev

