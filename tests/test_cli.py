"""`python -m chunkwise`: tiny built-ins run (with --prompt-ids or a seeded random prompt, said so), a live
token counter, times that include loading, one-line errors with exit status 1 (a bad argument's too, `serve`'s
alike), and --help listing the built-in names and dtypes; every option reaching what it sets (the sampling params
of both engines, the chunk size, `serve`'s engine and server options under their EngineConfig names), and with a
tokenizer the prompt's text."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm.auto import tqdm

import chunkwise.__main__ as cli
from chunkwise.checkpoints import REAL_NAMES, TINY_NAMES
from chunkwise.model_config import ModelConfig
import chunkwise.engine.llm_engine
from chunkwise.engine_config import DTYPES, EngineConfig
from chunkwise.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bars(monkeypatch):
    """The progress bars the CLI opens, kept to read their final counts, with every frame each one drew
    (`frames`; shown at once, not after the bar's usual delay)."""
    made = []

    class Recorded(tqdm):
        def __init__(self, *a, **kw):
            self.frames = []
            super().__init__(*a, **{**kw, "delay": 0})
            made.append(self)

        def display(self, msg=None, pos=None):
            if msg is None:   # a frame (closing the bar displays msg="" to clear the line)
                self.frames.append(str(self))
            return super().display(msg, pos)
    monkeypatch.setattr(cli, "tqdm", Recorded)
    monkeypatch.setattr(chunkwise.engine.llm_engine, "tqdm", Recorded)
    return made


def test_tiny_builtin_with_prompt_ids_runs_both_engines_and_counts_tokens(capsys, bars):
    assert cli.main(["--model", "tiny-qwen3", "--prompt-ids", "5,6,7", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "random" not in out and "identical: 4 tokens" in out
    assert out.count("load ") == 2 and out.count("+ generate") == 2      # times include loading
    assert [(b.desc, b.n) for b in bars] == [("chunkwise.Engine.generate", 1), ("chunkwise.reference.Engine", 4)]
    assert bars[0].postfix == "4 tokens generated"


def test_live_counter_last_frame_shows_every_generated_token(capsys, bars):
    """The frame left on screen when generation ends counts all tokens (it once showed the step before's)."""
    assert cli.main(["--model", "tiny-qwen3", "--prompt-ids", "5,6,7", "--max-tokens", "6", "--no-reference"]) == 0
    last = bars[0].frames[-1]
    assert "1/1" in last and "6 tokens generated" in last, bars[0].frames


def test_tiny_builtin_without_prompt_takes_a_seeded_random_prompt_and_says_so(capsys, tiny_ckpt):
    assert cli.main(["--model", "tiny-llama", "--max-tokens", "2", "--seed", "3", "--no-reference"]) == 0
    out = capsys.readouterr().out
    cfg = ModelConfig.from_dir(tiny_ckpt("llama"))
    ids = cli.random_prompt(cfg, 3)
    assert f"prompt: 16 random token ids (seed 3), as tiny-llama has no tokenizer: {ids}" in out
    assert cli.random_prompt(cfg, 3) == ids != cli.random_prompt(cfg, 4)
    assert not set(ids) & ({cfg.bos_token_id} | set(cfg.eos_token_ids))
    assert "chunkwise.reference.Engine" not in out


@pytest.mark.parametrize("argv,named", [
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "tiny-qwen3", "--prompt", "hello"], "--prompt-ids"),
    (["--model", "tiny-qwen3", "--temperature", "nan"], "temperature"),
    (["--model", "tiny-qwen3", "--prompt-ids", "1,2,99999"], "99999"),
    (["--model", "tiny-qwen3", "--page-size", "0"], "page_size"),
])
def test_errors_are_one_line_and_exit_non_zero(capsys, argv, named):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m chunkwise: error: ") and err.count("\n") == 1 and named in err, err


# argparse's own errors print the usage block and exit 2; here they are one line, exit status 1, as the others
@pytest.mark.parametrize("argv, named", [
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--max-tokens", "abc"], "argument --max-tokens: invalid int value: 'abc'"),
    (["--prompt-ids", ""], "argument --prompt-ids: expected comma-separated token ids like 1,2,3, got ''"),
    (["--prompt-ids", "1,x"], "argument --prompt-ids: expected comma-separated token ids like 1,2,3, got '1,x'"),
    (["--prompt", "hi", "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompt"),
    (["--top-p", "most"], "argument --top-p: invalid float value: 'most'"),
    (["--no-such-option", "1"], "unrecognized arguments: --no-such-option 1"),
    (["serve"], "the following arguments are required: --model"),
    (["serve", "--model", "tiny-qwen3", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["serve", "--model", "tiny-qwen3", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["serve", "--model", "tiny-qwen3", "--max-prefill-tokens-with-decodes", "lots"],
     "argument --max-prefill-tokens-with-decodes: expected an integer or none, got 'lots'"),
    (["serve", "--model", "tiny-qwen3", "--gpu-memory-utilization", "half"], "invalid float value: 'half'"),
    (["serve", "--model", "tiny-qwen3", "--attention-backend", "cudnn"], "invalid choice: 'cudnn'"),
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_status_1(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    prog = "python -m chunkwise serve" if argv[0] == "serve" else "python -m chunkwise"
    assert exit_.value.code == 1, err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize("argv", [["--max-tokens", "abc"], ["serve", "--model", "tiny-qwen3", "--port", "eighty"]])
def test_a_bad_argument_exits_the_process_with_status_1_and_one_line(argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "chunkwise", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and repr(argv[-1]) in proc.stderr, proc.stderr


def test_module_entry_point_exits_non_zero_without_a_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "chunkwise", "--model", str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m chunkwise: error: ValueError: checkpoint directory {tmp_path} has no config.json"]


def test_help_lists_builtin_names_and_dtypes(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())    # argparse wraps lines
    assert exit_.value.code == 0
    assert all(name in out for name in [*TINY_NAMES, *REAL_NAMES, *DTYPES, "--prompt-ids"])


def test_a_reference_output_that_is_a_strict_prefix_is_reported_different(capsys, monkeypatch):
    """One engine stopping early (e.g. on EOS) is a difference, not "identical"."""
    import argparse
    import types

    import chunkwise.__main__ as cli

    outs = {"chunkwise.engine": [5, 9, 2, 7], "chunkwise.reference": [5, 9]}
    monkeypatch.setattr(cli, "run_engine", lambda name, args, params, prompt=None: (
        None, [1, 2], types.SimpleNamespace(token_ids=outs[name]), 0.0, 0.0))
    monkeypatch.setattr(cli, "report", lambda *a, **k: None)
    args = argparse.Namespace(max_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=None, no_reference=False)
    cli.run(args)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "DIFFERENT: first divergence at generated token 2"
    outs["chunkwise.reference"] = [5, 9, 2, 7]
    cli.run(args)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "identical: 4 tokens"


# ---- argument handling: each option reaches what it sets ---------------------------------------------------------

def test_each_sampling_option_reaches_both_engines_params(monkeypatch):
    import types

    calls = []

    def fake_run_engine(kind, args, params, prompt=None):
        calls.append((kind, params, prompt, args.chunk_size, args.page_size, args.dtype, args.model))
        return None, [5, 6], types.SimpleNamespace(token_ids=[1]), 0.0, 0.0
    monkeypatch.setattr(cli, "run_engine", fake_run_engine)
    monkeypatch.setattr(cli, "report", lambda *a, **k: None)
    assert cli.main(["--model", "tiny-llama", "--prompt-ids", "5, 6", "--max-tokens", "5", "--temperature", "0.7",
                     "--top-k", "3", "--top-p", "0.9", "--seed", "4", "--chunk-size", "2", "--page-size", "8",
                     "--dtype", "bfloat16"]) == 0
    want = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, top_p=0.9, seed=4)
    assert calls == [("chunkwise.engine", want, None, 2, 8, "bfloat16", "tiny-llama"),
                     ("chunkwise.reference", want, [5, 6], 2, 8, "bfloat16", "tiny-llama")]
    assert cli.parser().parse_args(["--prompt-ids", "7"]).prompt_ids == [7]


def test_defaults_are_greedy_32_tokens_float32_pages_of_16_and_the_real_qwen():
    args = cli.parser().parse_args([])
    assert (args.model, args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed) == (
        "qwen2.5-coder-0.5b", 32, 0.0, 0, 1.0, 0)
    assert (args.dtype, args.page_size, args.chunk_size, args.no_reference) == ("float32", 16, None, False)


def test_chunk_size_prefills_the_prompt_in_chunks_of_that_size(capsys, monkeypatch):
    """--chunk-size reaches generate as the prompt's chunk length, on both engines, and the output is the same."""
    seen = []
    generate = chunkwise.engine.llm_engine.Engine.generate

    def spy(self, prompts, params=None, chunk_sizes=None, **kw):
        seen.append(chunk_sizes)
        return generate(self, prompts, params, chunk_sizes=chunk_sizes, **kw)
    monkeypatch.setattr(chunkwise.engine.llm_engine.Engine, "generate", spy)
    assert cli.main(["--model", "tiny-qwen3", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "3", "--chunk-size",
                     "2"]) == 0
    assert seen == [2] and "identical: 3 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv,prompt_text", [
    (["--prompt", "the quick brown"], "the quick brown"),
    (["--prompt-ids", ",".join(str(3 + b) for b in b"the quick")], "the quick"),   # byte tokens: 3 + the byte
    ([], cli.DEFAULT_PROMPT),
])
def test_with_a_tokenizer_the_report_prints_the_prompt_text_then_the_output_text(
        capsys, tiny_ckpt_with_byte_tokenizer, argv, prompt_text):
    """With a tokenizer: --prompt text, --prompt-ids decoded, or the default prompt text when neither is given, each
    followed by the generated text, for both engines."""
    assert cli.main(["--model", str(tiny_ckpt_with_byte_tokenizer), "--max-tokens", "2", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count(prompt_text) == 2 and "identical: 2 tokens" in out and "random" not in out


def test_an_interrupt_exits_130_in_one_line_and_traceback_shows_the_error(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["--model", "tiny-qwen3"]) == 130
    assert capsys.readouterr().err == "python -m chunkwise: interrupted\n"

    def failing(args):
        raise ValueError("bad\nvalue")
    monkeypatch.setattr(cli, "run", failing)
    assert cli.main(["--model", "tiny-qwen3"]) == 1
    assert capsys.readouterr().err == "python -m chunkwise: error: ValueError: bad value\n"
    with pytest.raises(ValueError, match="bad"):
        cli.main(["--model", "tiny-qwen3", "--traceback"])


# ---- `python -m chunkwise serve`: each option reaches the engine or the server -----------------------------------

@pytest.fixture
def served(monkeypatch):
    """Runs `serve` with the engine and the server replaced by recorders: what each was given."""
    import signal
    import types

    import chunkwise.engine
    import chunkwise.serve.cli as serve_cli

    got = {}

    class FakeEngine:   # --no-engine-process: an Engine here, stepped by an EngineLoop
        def __init__(self, model, **kw):
            got["engine"] = (model, kw)

        def close(self):
            got["closed"] = True

    class FakeCore:     # the default: an engine built in a process of its own
        def __init__(self, model, kw):
            got["engine"] = (model, kw)

        def start(self):
            got["process"] = True

        def close(self):
            got["closed"] = True

    class FakeLoop:
        def __init__(self, engine):
            self.engine = engine

        def start(self):
            got["thread"] = True

        def close(self):
            self.engine.close()

    def fake_make_server(loop, name, host, port, max_waiting, max_logprobs, log_level):
        got["server"] = (name, host, port, max_waiting, max_logprobs, log_level)
        return types.SimpleNamespace(run=lambda: None, started=True)
    monkeypatch.setattr(chunkwise.engine, "Engine", FakeEngine)
    monkeypatch.setattr(serve_cli, "EngineCore", FakeCore)
    monkeypatch.setattr(serve_cli, "EngineLoop", FakeLoop)
    monkeypatch.setattr(serve_cli, "make_server", fake_make_server)
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # not the test process's own handlers
    monkeypatch.setattr(serve_cli.logging, "basicConfig", lambda **kw: None)

    def run(*argv) -> dict:
        got.clear()
        assert cli.main(["serve", *argv]) == 0
        return dict(got)
    return run


def test_serve_passes_only_the_engine_options_given_its_serving_defaults_and_the_server_options(served):
    serving = {"max_prefill_tokens_with_decodes": 256}
    got = served("--model", "tiny-qwen3")
    assert got["engine"] == ("tiny-qwen3", serving) and got["closed"] and got["process"] and "thread" not in got
    got = served("--model", "tiny-qwen3", "--no-engine-process", "--page-size", "8")
    assert got["engine"] == ("tiny-qwen3", {**serving, "page_size": 8}) and got["closed"] and got["thread"]
    assert "process" not in got
    for text, value in (("none", None), ("None", None), ("64", 64)):
        got = served("--model", "tiny-qwen3", "--max-prefill-tokens-with-decodes", text)
        assert got["engine"][1] == {"max_prefill_tokens_with_decodes": value}
    assert got["server"] == ("tiny-qwen3", "127.0.0.1", 8000, 1024, 20, "info")
    got = served("--model", "tiny-qwen3", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "0",
                 "--max-waiting", "3", "--max-logprobs", "5", "--log-level", "warning")
    assert got["server"] == ("m", "0.0.0.0", 0, 3, 5, "warning")


def test_serve_passes_every_engine_option_under_its_engine_config_name(served):
    from chunkwise.serve.cli import ENGINE_OPTIONS

    argv = ["--dtype", "bfloat16", "--device", "cpu", "--page-size", "8", "--max-model-len", "64", "--num-pages", "9",
            "--max-num-batched-tokens", "32", "--max-prefill-tokens-with-decodes", "16", "--max-num-seqs", "4",
            "--tensor-parallel-size", "2",
            "--split-kv-threshold", "0", "--split-size", "128", "--max-graph-tokens", "64",
            "--gpu-memory-utilization", "0.5", "--attention-backend", "fa3",
            "--no-enable-prefix-caching", "--enforce-eager", "--no-cascade-attention", "--deterministic",
            "--async-scheduling", "--no-custom-all-reduce"]
    model, kw = served("--model", "tiny-llama", *argv)["engine"]
    assert model == "tiny-llama" and kw == {
        "dtype": "bfloat16", "device": "cpu", "page_size": 8, "max_model_len": 64, "num_pages": 9,
        "max_num_batched_tokens": 32, "max_prefill_tokens_with_decodes": 16, "max_num_seqs": 4,
        "tensor_parallel_size": 2, "split_kv_threshold": 0,
        "split_size": 128, "max_graph_tokens": 64, "gpu_memory_utilization": 0.5, "enable_prefix_caching": False,
        "enforce_eager": True,
        "cascade_attention": False, "deterministic": True, "attention_backend": "fa3", "async_scheduling": True,
        "custom_all_reduce": False}
    assert set(kw) == set(ENGINE_OPTIONS) and set(ENGINE_OPTIONS) <= set(EngineConfig.__dataclass_fields__)
