"""Tiny checkpoint factory, the checkpoint cache, resolve_model, and safetensors loading with its errors (shard
indexes, dtypes, ignored buffers, per-rank slices)."""
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


def test_a_directory_another_process_finished_while_we_waited_is_taken_as_it_is(tmp_path, capsys):
    """The waiter checks the marker again once it holds the lock: what the other process built is not rebuilt."""
    target, builds = tmp_path / "ckpt", []
    with open(tmp_path / ".ckpt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=cached_dir, args=(target, "k1", builds.append))
        waiter.start()
        deadline = time.monotonic() + 30
        while "waiting for another process" not in capsys.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.05)
        target.mkdir()   # the other process's build, marker last
        (target / "config.json").write_text("{}")
        (target / "COMPLETE").write_text("k1")
        fcntl.flock(lock, fcntl.LOCK_UN)
        waiter.join(timeout=30)
    assert builds == [] and sorted(p.name for p in target.iterdir()) == ["COMPLETE", "config.json"]


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


# --- the rest of the loader's branches: shard indexes, dtypes, ignored buffers, per-rank slices ------------------

def _shard(ckpt: Path, names_per_shard: dict[str, list[str]] | None = None) -> dict:
    """Splits the single file into two shards plus their index (names alternating); returns the index."""
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    shards = names_per_shard or {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, ckpt / shard)
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {n: shard for shard, ns in shards.items() for n in ns}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


@pytest.mark.parametrize("damage,message", [
    (lambda ckpt, index: (ckpt / "model.safetensors.index.json").write_text("{not json"), "not a valid shard index"),
    (lambda ckpt, index: (ckpt / "model.safetensors.index.json").write_text('{"metadata": {}}'),
     "not a valid shard index"),
    (lambda ckpt, index: (ckpt / "b.safetensors").unlink(), "mapped to b.safetensors, which is missing"),
    (lambda ckpt, index: (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**index["weight_map"], "model.norm.weight": "b.safetensors"}})),
     "'model.norm.weight' is listed for b.safetensors but that file lacks it"),
])
def test_a_bad_shard_index_is_a_value_error_naming_what_is_wrong(llama_copy, damage, message):
    index = _shard(llama_copy)
    assert index["weight_map"]["model.norm.weight"] == "a.safetensors"
    damage(llama_copy, index)
    with pytest.raises(ValueError, match=message):
        load_weights(llama_copy)


def test_a_saved_rotary_inv_freq_buffer_is_ignored(llama_copy):
    want = load_weights(llama_copy)
    _rewrite(llama_copy, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    got = load_weights(llama_copy)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), (torch.float16, torch.float16),
                                        ("float64", torch.float64)])
def test_weights_load_in_any_floating_dtype_by_name_or_dtype(dtype, want):
    ckpt = tiny_checkpoint("llama")
    weights = load_weights(ckpt, dtype)
    single = load_file(ckpt / "model.safetensors")
    assert all(t.dtype == want and torch.equal(t, single[n].to(want)) for n, t in weights.items())


@pytest.mark.parametrize("dtype", ["int8", "nonsense", "Tensor", "bool", torch.int8, torch.bool, torch.int64])
def test_a_dtype_that_is_not_floating_point_is_refused_naming_it(dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype!r} is not a torch floating-point dtype"):
        load_weights(tiny_checkpoint("llama"), dtype)


def test_a_shard_function_replaces_each_tensor_by_its_slice_as_it_is_read():
    ckpt = tiny_checkpoint("qwen2")
    full = load_weights(ckpt)
    seen = []

    def first_rows(name, t):
        seen.append(name)
        return t[:1].clone()
    sliced = load_weights(ckpt, shard=first_rows)
    assert sorted(seen) == sorted(full) and all(torch.equal(sliced[n], full[n][:1]) for n in full)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tiny_family_holds_exactly_the_tensors_its_config_implies(family):
    """The factory's checkpoints (written by transformers) against expected_shapes: biases only where the family has
    them (Qwen2's q/k/v, not o_proj), q/k norms for Qwen3 and Gemma 3, sandwich norms for Gemma 3, a tied head."""
    ckpt = tiny_checkpoint(family)
    cfg = ModelConfig.from_dir(ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected_shapes(cfg)
    names = set(tensors)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert ("model.layers.0.self_attn.k_norm.weight" in names) == (family in ("qwen3", "gemma3_text"))
    assert ("model.layers.1.pre_feedforward_layernorm.weight" in names) == (family == "gemma3_text")
    assert ("lm_head.weight" in names) == (family != "gemma3_text")
