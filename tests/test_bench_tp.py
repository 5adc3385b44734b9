"""benchmarks/bench_tp.py's CPU-side parts: its random checkpoint (sharded safetensors with an index) loads in the
engine and has the shape asked for; its communication-free bound and which kernels it counts as communication;
without two GPUs its benchmarks are collected and skipped, not errors."""
import pytest
import torch
from child_pytest import run_pytest

from benchmarks.bench_tp import is_communication, random_checkpoint, speedup_without_communication
from benchmarks.roofline import ModelCost
from chunkwise.model_config import ModelConfig
from chunkwise.weights import INDEX_FILE, load_weights
from chunkwise.engine import Engine, SamplingParams

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)


def test_random_checkpoint_is_sharded_of_the_shape_and_runs(tmp_path):
    path = random_checkpoint(SHAPE, device="cpu", shard_bytes=40_000, root=tmp_path)
    assert random_checkpoint(SHAPE, device="cpu", shard_bytes=40_000, root=tmp_path) == path   # built once
    assert len(list(path.glob("model-*.safetensors"))) >= 3 and (path / INDEX_FILE).is_file()
    cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, torch.bfloat16, cfg=cfg)   # checks every name and shape against the config
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    emb = weights["model.embed_tokens.weight"].float()
    assert 0.015 < emb.std() < 0.025 and torch.equal(weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert ModelCost.of(cfg, path).weight_bytes == 2 * sum(w.numel() for w in weights.values())
    out = Engine(path, max_model_len=64, num_pages=16).generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3


def test_without_two_gpus_the_benchmarks_are_collected_and_skipped():
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the benchmarks run")
    proc = run_pytest("--benchmark-only", "benchmarks/bench_tp.py", "-q", "-rs")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 skipped" in proc.stdout, proc.stdout


def test_the_communication_free_bound_removes_the_communication_share_of_the_run():
    # 1.47x with communication taking 15.3% of the run: the same tokens in 84.7% of the time.
    assert speedup_without_communication(1.47, 0.153) == pytest.approx(1.47 / 0.847)
    assert speedup_without_communication(1.47, 0.0) == 1.47


def test_communication_kernels_are_nccls_and_the_custom_all_reduces():
    assert is_communication("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert is_communication("_all_reduce_kernel")
    assert not any(map(is_communication, ["_rms_norm_kernel", "_split_kernel", "nvjet_tst_128x64_64x8_2x1_v_bz"]))
