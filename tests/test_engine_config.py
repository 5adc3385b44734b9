"""EngineConfig is a description: building one opens no file, builds or converts no checkpoint and imports no
kernel. The engines' constructors open it (`chunkwise.open_config`), and it is there that a checkpoint which is
not there is refused."""
import re

import pytest

import chunkwise.reference
from chunkwise.engine import Engine
from chunkwise.engine_config import EngineConfig
from chunkwise.model_config import ModelConfig
from chunkwise.open_config import open_config
from tests.test_layers import ROOT, import_graph

CHECKPOINT_CODE = {"chunkwise.checkpoints", "chunkwise.real_checkpoints", "chunkwise.checkpoint_cache"}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def test_a_config_of_a_checkpoint_not_there_yet_is_accepted_and_both_engines_refuse_it_by_name(tmp_path):
    later = tmp_path / "not-yet"
    config = EngineConfig(later, page_size=4, max_model_len=64, split_size=64)
    assert (config.model, config.path, config.model_config, config.max_model_len) == (later, None, None, 64)
    assert not later.exists()
    for engine in (Engine, chunkwise.reference.Engine):
        with pytest.raises(ValueError, match=f"model {re.escape(repr(str(later)))} is neither a checkpoint "
                                             f"directory nor a built-in name"):
            engine(later, page_size=4)


def test_a_built_in_name_is_built_when_the_config_is_opened_not_when_it_is_made(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CHUNKWISE_CACHE", str(cache))
    config = EngineConfig("tiny-qwen3", page_size=4)
    assert config.path is None and config.split_size is None and not cache.exists()
    opened = open_config(config)
    assert opened.path.is_relative_to(cache) and (opened.path / "config.json").is_file()
    assert opened.model_config == ModelConfig.from_dir(opened.path)
    assert opened.max_model_len == opened.model_config.max_position_embeddings and opened.split_size == 512
    assert open_config(opened) == opened
    assert EngineConfig("tiny-qwen3", page_size=4) == config, "opening changed the description it was given"


def test_building_a_config_imports_no_kernel_and_no_checkpoint_code_and_opening_it_does():
    graph = import_graph(ROOT / "chunkwise")
    described, opened = reachable(graph, "chunkwise.engine_config"), reachable(graph, "chunkwise.open_config")
    assert not {m for m in described if m.startswith("chunkwise.kernels")} | (described & CHECKPOINT_CODE), described
    assert {"chunkwise.kernels.split_kv", "chunkwise.kernels.fa3", "chunkwise.checkpoints"} <= opened
