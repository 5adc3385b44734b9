"""Tiny checkpoint factory, the checkpoint cache, resolve_model, and safetensors loading with its errors."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chunkwise.checkpoint_cache import cached_dir
from chunkwise.checkpoints import resolve_model, tiny_checkpoint
from chunkwise.model_config import ModelConfig
from chunkwise.sampling import SamplingParams
from chunkwise.weights import expected_shapes, load_weights

pytestmark = pytest.mark.correctness

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@pytest.fixture
def llama_copy(tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    return dst


def test_factory_is_deterministic_per_seed_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKWISE_CACHE", str(tmp_path))
    a = tiny_checkpoint("qwen3", seed=3)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_checkpoint("qwen3", seed=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp          # reused, not rewritten
    assert (a / "model.safetensors").stat().st_mode & 0o777 == 0o644      # safetensors writes it 0600
    first = load_weights(a)
    shutil.rmtree(a)
    again = load_file(tiny_checkpoint("qwen3", seed=3) / "model.safetensors")
    other = load_file(tiny_checkpoint("qwen3", seed=4) / "model.safetensors")
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_overrides_reach_config_json(tiny_ckpt):
    path = tiny_ckpt("llama", num_key_value_heads=1, head_dim=96, tie_word_embeddings=True)
    cfg = ModelConfig.from_dir(path)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (1, 96, True)
    assert set(load_weights(path)) == set(expected_shapes(cfg))


@pytest.mark.parametrize("family", FAMILIES)
def test_final_norm_is_widened_and_greedy_output_varies(family, reference_engine, random_prompt):
    eng = reference_engine(family)
    plus_one = eng.model_config.norm_plus_one
    assert torch.all(eng.model.w["model.norm.weight"] == (7.0 if plus_one else 8.0))
    out = eng.generate(random_prompt(16, eng.model_config.vocab_size), SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(set(out[0].token_ids)) >= 8, out[0].token_ids


# --- the cache --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SLOW_BUILD = """
import sys, time
from pathlib import Path
from chunkwise.checkpoint_cache import cached_dir

def build(out):
    (out / "model.safetensors").write_bytes(b"half")
    print("building", flush=True)
    time.sleep(120)

cached_dir(Path(sys.argv[1]), "k1", build)
"""


def _write_config(out: Path):
    (out / "config.json").write_text("{}")


def test_temp_dir_of_a_build_killed_by_sigterm_is_swept_by_the_next_build(tmp_path):
    target = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(target)], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
        assert proc.stdout.readline() == "building\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    orphans = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp")]
    assert len(orphans) == 1                       # what the killed build left behind
    assert cached_dir(target, "k1", _write_config) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]


def test_cached_files_are_readable_like_their_directory(tmp_path):
    def private_build(out: Path):
        (out / "sub").mkdir(mode=0o700)
        for path in (out / "model.safetensors", out / "sub" / "tokenizer.json"):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    target = cached_dir(tmp_path / "ckpt", "k1", private_build)
    assert [oct(p.stat().st_mode & 0o777) for p in (target, target / "sub")] == ["0o755", "0o755"]
    for path in (target / "model.safetensors", target / "sub" / "tokenizer.json", target / "COMPLETE"):
        assert path.stat().st_mode & 0o444 == 0o444, path


def test_a_build_waiting_on_another_process_lock_says_so(tmp_path, capsys):
    target = tmp_path / "ckpt"
    with open(tmp_path / ".ckpt.lock", "w") as lock:   # another open file description: flock conflicts
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=cached_dir, args=(target, "k1", _write_config))
        waiter.start()
        err, deadline = "", time.monotonic() + 30
        try:
            while "waiting for another process" not in err and time.monotonic() < deadline:
                time.sleep(0.05)
                err += capsys.readouterr().err
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            waiter.join(timeout=30)
    assert f"waiting for another process to finish building {target}" in err
    assert (target / "config.json").is_file()


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError, match="gpt2"):
        tiny_checkpoint("gpt2")


def test_resolve_model_takes_names_and_directories(tmp_path):
    assert resolve_model("tiny-gemma3") == tiny_checkpoint("gemma3_text")
    assert resolve_model(str(tiny_checkpoint("llama"))) == tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)


def test_sharded_checkpoint_loads_like_the_single_file(llama_copy):
    single = load_weights(llama_copy)
    tensors = load_file(llama_copy / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, llama_copy / shard)
    index = {"weight_map": {n: shard for shard, ns in shards.items() for n in ns}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (llama_copy / "model.safetensors").unlink()
    sharded = load_weights(llama_copy, torch.float16)
    assert set(sharded) == set(single)
    assert all(t.dtype == torch.float16 and torch.equal(t, single[n].half()) for n, t in sharded.items())


def _rewrite(ckpt, edit):
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight' is missing"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}), "unexpected tensor 'model.layers.0.extra"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64)}),
     "'model.layers.0.self_attn.k_proj.weight' has shape \\(16, 64\\), expected \\(32, 64\\)"),
])
def test_bad_tensor_is_named(llama_copy, edit, message):
    _rewrite(llama_copy, edit)
    with pytest.raises(ValueError, match=message):
        load_weights(llama_copy)


def test_corrupt_or_absent_file_is_a_value_error(llama_copy):
    path = llama_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_weights(llama_copy)
    path.unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_weights(llama_copy)


def test_tied_checkpoint_accepts_lm_head_only_when_equal_to_embeddings(tmp_path):
    ckpt = tmp_path / "tied"
    shutil.copytree(tiny_checkpoint("gemma3_text"), ckpt)
    _rewrite(ckpt, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert "lm_head.weight" not in load_weights(ckpt)
    _rewrite(ckpt, lambda t: t["lm_head.weight"].mul_(2))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_weights(ckpt)
