"""chunkwise.reference.Engine's interface: sampling, stopping, logprobs, ignored knobs, and the errors it raises."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from chunkwise.checkpoints import tiny_checkpoint
from chunkwise.reference import Engine, SamplingParams

pytestmark = pytest.mark.correctness

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eng(reference_engine):
    return reference_engine("qwen3")


@pytest.fixture(scope="module")
def prompt(eng, random_prompt):
    return random_prompt(12, eng.model_config.vocab_size)


def sampled(eng, prompt, seed):
    return eng.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=seed,
                                               ignore_eos=True))[0].token_ids


def test_seeded_sampling_is_reproducible_and_seeds_differ(eng, prompt):
    assert sampled(eng, prompt, 1) == sampled(eng, prompt, 1)
    assert sampled(eng, prompt, 1) != sampled(eng, prompt, 2)
    assert len(sampled(eng, prompt, 1)) == 16


def test_batch_outputs_equal_single_prompt_outputs(eng, prompt, random_prompt):
    other = random_prompt(7, eng.model_config.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]
    batch = eng.generate([prompt, other], params)
    assert [o.token_ids for o in batch] == [eng.generate(p, s)[0].token_ids for p, s in zip([prompt, other], params)]
    assert [o.prompt_token_ids for o in batch] == [prompt, other]
    assert [len(o.token_ids) for o in batch] == [6, 4] and all(o.finish_reason == "length" for o in batch)


def test_logprobs_hold_the_chosen_token_and_the_top_k(eng, prompt):
    out = eng.generate(prompt, SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    row = torch.log_softmax(eng.logits(prompt), -1)[-1]
    first = out.logprobs[0]
    assert set(first) == set(torch.topk(row, 3).indices.tolist())     # greedy: the chosen is the top-1
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and lp[token] == max(lp.values())
    assert first[out.token_ids[0]] == pytest.approx(float(row.max()), abs=1e-6)


def test_stops_at_eos_unless_ignored(eng, prompt, tmp_path):
    free = eng.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    eos = free[3]
    ckpt = tmp_path / "eos"
    shutil.copytree(tiny_checkpoint("qwen3"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, eos_token_id=[eos])))
    with_eos = Engine(ckpt)
    stopped = with_eos.generate(prompt, SamplingParams(max_tokens=8))[0]
    assert stopped.token_ids == free[:free.index(eos) + 1] and stopped.finish_reason == "stop"
    ignored = with_eos.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_stop_token_ids_end_the_request(eng, prompt):
    free = eng.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    out = eng.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(free[2],)))[0]
    assert out.token_ids == free[:free.index(free[2]) + 1] and out.finish_reason == "stop"


def test_chunk_sizes_and_page_size_do_not_change_the_output(eng, prompt):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    base = eng.generate(prompt, params)[0].token_ids
    assert eng.generate(prompt, params, chunk_sizes=[1, 5, 6])[0].token_ids == base
    assert eng.generate([prompt], params, chunk_sizes=5)[0].token_ids == base
    k, v = eng.prefill_kv(prompt)
    k2, v2 = Engine(tiny_checkpoint("qwen3"), device="cpu", page_size=3).prefill_kv(prompt, chunk_sizes=[4, 8])
    assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([], {}, "prompts"),
    ([[]], {}, "prompt 0 is empty"),
    ([[5], [3, 384]], {}, "prompt 1 holds token id 384"),
    ([[5], [-1]], {}, "token id -1"),
    ("some text", {}, "no tokenizer"),
    ([[5] * 1000], {"sampling_params": SamplingParams(max_tokens=30)}, "max_model_len 1024"),
    ([[5] * 8], {"chunk_sizes": [[3, 4]]}, "sum to 7"),
    ([[5] * 8], {"chunk_sizes": [3, 4]}, r"2 entries for 1 prompt .*pass \[\[3, 4\]\]"),
    ([[5] * 8], {"chunk_sizes": [[8, 0]]}, "chunk size 0"),
    ([[5] * 8], {"chunk_sizes": 0}, "chunk size 0"),
    ([[5] * 8, [6] * 3], {"chunk_sizes": [[8]]}, "1 entries for 2 prompts"),
    ([[5] * 8, [6] * 3], {"sampling_params": [SamplingParams()]}, "1 entries for 2 prompts"),
])
def test_bad_requests_raise_value_error(eng, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        eng.generate(prompts, **kwargs)


@pytest.mark.parametrize("prompts, message", [
    (42, "prompts must be .* got int 42"),
    (None, "prompts must be .* got NoneType None"),
    ([3.5], "prompt 0 must be a string or a list of token ids, got float 3.5"),
    ([[5], [5, 4.0]], "prompt 1 holds float 4.0, which is not an integer token id"),
])
def test_wrong_prompt_types_raise_type_error_naming_the_value(eng, prompts, message):
    with pytest.raises(TypeError, match=message):
        eng.generate(prompts)


def test_max_tokens_below_one_is_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"page_size": 0}, "page_size"), ({"max_model_len": 4096}, "max_model_len"), ({"dtype": "int8"}, "int8")])
def test_bad_engine_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine("tiny-qwen3", **kwargs)


def test_unknown_family_and_broken_weights_fail_at_load(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(ValueError, match="gpt2"):
        Engine(ckpt)
    (ckpt / "config.json").write_text(json.dumps(config))
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match="model.safetensors"):
        Engine(ckpt)


def test_no_top_level_package_of_ours_shadows_another_library():
    """Everything this project installs lives under `chunkwise`: a top-level `kernels` of ours was taken by
    transformers for the Hub kernels library."""
    from transformers.utils.import_utils import is_kernels_available

    for name in ("kernels", "optimized", "reference"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not Path(spec.origin).is_relative_to(REPO), f"{name} resolves into this repo"
    assert is_kernels_available() is False
