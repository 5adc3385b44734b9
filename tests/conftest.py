"""Fixtures shared by the tests: tiny checkpoints of every family, engines and HF models cached per session.

Checkpoints are written once per machine into $CHUNKWISE_CACHE (default ~/.cache/chunkwise); engines and
HF models are loaded once per test session and keyed by (family, overrides).
"""
from __future__ import annotations

import pytest
import torch

from chunkwise.checkpoints import tiny_checkpoint

# Tiny models are all per-op overhead; a second OpenMP thread only spins, and on a loaded 2-core machine
# that made the tiny reference forward 30x slower (measured: 130 ms vs 4 ms per 40-token pass).
if not torch.cuda.is_available():
    torch.set_num_threads(1)


def _per_checkpoint(load):
    """get(family, **overrides) -> load(tiny checkpoint), loaded once per (family, overrides) per session."""
    cache = {}

    def get(family: str, **overrides):
        key = family, repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = load(tiny_checkpoint(family, **overrides))
        return cache[key]
    return get


@pytest.fixture(scope="session")
def random_prompt():
    """random_prompt(length, vocab_size, seed=0) -> token ids from a fixed seed, avoiding the special
    ids 0..2 of tiny checkpoints."""
    def make(length: int, vocab_size: int, seed: int = 0) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab_size, (length,), generator=gen).tolist()
    return make


@pytest.fixture(scope="session")
def ckpt():
    """The tiny Qwen3 checkpoint most engine tests run: q/k-norm, GQA 4/2, two layers (so layer 1's K/V depend on
    attention). A test module needing another model defines its own `ckpt`."""
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_ckpt():
    """tiny_ckpt(family, seed=0, **overrides) -> checkpoint directory (see chunkwise.checkpoints)."""
    return tiny_checkpoint


@pytest.fixture(scope="session")
def reference_engine():
    """reference_engine(family, **overrides) -> a float32 CPU chunkwise.reference.Engine, loaded once per session."""
    from chunkwise.reference import Engine

    return _per_checkpoint(lambda path: Engine(path, dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(family, **overrides) -> HF transformers' model of the same checkpoint, eager, float32."""
    from transformers import AutoModelForCausalLM

    return _per_checkpoint(lambda path: AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval())


@pytest.fixture(scope="session")
def tiny_ckpt_with_tokenizer(tmp_path_factory):
    """The tiny Llama checkpoint plus a word-level HF tokenizer (ids 3.. are words) and a chat template,
    for tests of text prompts. Tiny checkpoints themselves carry no tokenizer."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the quick brown fox jumps over a lazy dog and then sleeps".split()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    path = tmp_path_factory.mktemp("tokenized") / "tiny-llama-words"
    shutil.copytree(tiny_checkpoint("llama"), path)
    tok.save_pretrained(path)
    return path


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's byte alphabet) of exactly vocab_size ids: 0..2 are <pad>, <s>, </s>,
    3..258 the 256 single bytes (so 128 of them are partial UTF-8 sequences, decoding to U+FFFD alone), and the
    rest merges spelling multi-byte characters and common ASCII pairs. Every id a tiny model can generate decodes
    to some text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{byte_char[b]: 3 + b for b in range(256)}}
    merges = []

    def spell(word: bytes) -> None:   # merges building the word left to right, one byte at a time
        sym = byte_char[word[0]]
        for b in word[1:]:
            if len(vocab) == vocab_size:
                return
            if sym + byte_char[b] not in vocab:
                merges.append((sym, byte_char[b]))
                vocab[sym + byte_char[b]] = len(vocab)
            sym += byte_char[b]

    for word in ["é", "ü", "ß", "€", "→", "日本", "中文", "😀", " the", " and", "ing"]:
        spell(word.encode())
    pairs = (a + b for a in "etaoinshr " for b in "etaoinshr .,")
    while len(vocab) < vocab_size:
        spell(next(pairs).encode())
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def tiny_ckpt_with_byte_tokenizer(tmp_path_factory):
    """The tiny Qwen3 checkpoint (the `ckpt` fixture's weights) plus `byte_level_tokenizer` over its whole
    vocabulary, saved beside it as tokenizer.json: its outputs have text, including characters split across
    tokens."""
    import shutil

    from chunkwise.checkpoints import TINY_VOCAB_SIZE

    path = tmp_path_factory.mktemp("tokenized") / "tiny-qwen3-bytes"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    byte_level_tokenizer(TINY_VOCAB_SIZE).save_pretrained(path)
    return path


SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def with_chat_template(checkpoint, tmp_path_factory, template: str):
    """A copy of `checkpoint` (one with a tokenizer) whose tokenizer carries the chat template `template`."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny-qwen3-chat"
    shutil.copytree(checkpoint, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_template_ckpt(tiny_ckpt_with_byte_tokenizer, tmp_path_factory):
    """chat_template_ckpt(template) -> the byte-tokenizer tiny Qwen3 whose tokenizer carries `template`."""
    return lambda template: with_chat_template(tiny_ckpt_with_byte_tokenizer, tmp_path_factory, template)


@pytest.fixture(scope="session")
def tiny_chat_ckpt(tiny_ckpt_with_byte_tokenizer, tmp_path_factory):
    """The byte-tokenizer tiny Qwen3 plus a simple chat template (a role line per message)."""
    return with_chat_template(tiny_ckpt_with_byte_tokenizer, tmp_path_factory, SIMPLE_CHAT_TEMPLATE)
