"""`python -m chunkwise`: tiny built-ins run (with --prompt-ids or a seeded random prompt, said so), a live
token counter, times that include loading, one-line errors with a non-zero exit, and --help listing the
built-in names and dtypes."""
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
from chunkwise.engine_config import DTYPES

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


def test_module_entry_point_exits_non_zero_without_a_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "chunkwise", "--model", str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"python -m chunkwise: error: ValueError: checkpoint directory {tmp_path} has no config.json"]


def test_bad_prompt_ids_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--prompt-ids", "1,x"])
    assert exit_.value.code == 2 and "expected comma-separated token ids like 1,2,3, got '1,x'" in capsys.readouterr().err


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
