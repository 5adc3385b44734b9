"""Output text on both engines, with a byte-level tokenizer covering every id of the tiny model (so text is never
empty, and characters split across byte tokens occur): the engines' texts are equal, and a streamed request's
pieces (StepOutput.new_text, from chunkwise.tokenizer.TextStream) join to its output's text, each split character
arriving whole; special tokens (an EOS the request stopped on) give no text, whole or streamed. Text prompts are
the tokenizer's own ids with the special tokens it adds; text pieces of a composite prompt and text chunks are its ids
without them."""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import chunkwise.reference
from chunkwise.checkpoints import TINY_VOCAB_SIZE as VOCAB
from chunkwise.chunks import ChunkRegistry
from chunkwise.engine import Engine, SamplingParams
from chunkwise.model_config import ModelConfig
from chunkwise.tokenizer import TextStream, decode, encode_prompts, load_tokenizer

pytestmark = pytest.mark.correctness

BYTE0 = 3                               # id of byte 0x00 in `byte_level_tokenizer`
EURO = [BYTE0 + b for b in "€".encode()]            # one character as three byte tokens
SMILE = [BYTE0 + b for b in "😀".encode()]          # four
PROMPTS = [[5, 9, 14, 3, 22, 8, 17], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [200, 150, 300]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
EOS = 2                                 # the tiny checkpoints' eos_token_id: `byte_level_tokenizer`'s "</s>"
STOPS_ON_EOS = [3, 5]                   # greedy on the tiny Qwen3 draws two byte tokens, then EOS


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt_with_byte_tokenizer):
    return load_tokenizer(tiny_ckpt_with_byte_tokenizer)


def partial_utf8(tokenizer, ids) -> bool:
    """Whether some id is a single byte that starts a multi-byte UTF-8 character (decoding to U+FFFD alone)."""
    return any(BYTE0 + 0xC2 <= i < BYTE0 + 0xF5 for i in ids)


def test_the_byte_tokenizer_gives_every_id_of_the_tiny_vocabulary_text(tokenizer):
    assert len(tokenizer) == VOCAB
    assert all(decode(tokenizer, [i]) for i in range(BYTE0, VOCAB)), "an id decodes to no text"
    assert decode(tokenizer, EURO) == "€" and decode(tokenizer, EURO[:2]) == "\ufffd"


@settings(max_examples=5 * settings().max_examples)
@example(groups=[EURO[:1], EURO[1:2], EURO[2:]])                       # a character over three steps
@example(groups=[[BYTE0 + ord("a")] + SMILE[:2], SMILE[2:] + [BYTE0 + ord("b")]])
@example(groups=[[BYTE0 + 0x80], [BYTE0 + ord("x")], [BYTE0 + 0xE2], [2], [BYTE0 + 0x82]])   # stray bytes, EOS
@given(groups=st.lists(st.lists(st.integers(0, VOCAB - 1) | st.sampled_from(EURO + SMILE), max_size=4),
                       min_size=1, max_size=12))
def test_streamed_pieces_join_to_the_decoded_text_and_split_characters_arrive_whole(tokenizer, groups):
    text = decode(tokenizer, [t for g in groups for t in g])
    stream, pieces = TextStream(tokenizer), []
    for group in groups:
        pieces.append(stream.push(group))
        # What was sent is always a prefix of the whole text: a character split over tokens is never sent as
        # U+FFFD before its last byte arrives.
        assert text.startswith("".join(pieces)), f"sent {pieces!r}, the text is {text!r}"
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    if groups == [EURO[:1], EURO[1:2], EURO[2:]]:
        assert pieces == ["", "", "€", ""]


def test_special_tokens_decode_to_no_text_whole_or_streamed(tokenizer):
    ids = [1, BYTE0 + ord("a"), 0, *EURO, EOS]   # <s> a <pad> € </s>
    assert decode(tokenizer, ids) == "a€"
    stream = TextStream(tokenizer)
    assert "".join([stream.push([i]) for i in ids] + [stream.finish()]) == "a€"


def stream_all(engine, prompts, params) -> dict[int, tuple[str, object]]:
    """Each prompt through add_request/step: (its new_text pieces joined, its output)."""
    rids = [engine.add_request(p, params) for p in prompts]
    pieces, outputs = {r: [] for r in rids}, {}
    while engine.has_unfinished():
        for r in engine.step():
            pieces[r.request_id].append(r.new_text)
            if r.finished:
                outputs[r.request_id] = r.output
    return [("".join(pieces[r]), outputs[r]) for r in rids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_both_engines_decode_the_same_nonempty_text_and_streamed_text_joins_to_it(
        tiny_ckpt_with_byte_tokenizer, tokenizer, overlap):
    ref = chunkwise.reference.Engine(tiny_ckpt_with_byte_tokenizer, max_model_len=64)
    eng = Engine(tiny_ckpt_with_byte_tokenizer, page_size=4, num_pages=32, max_model_len=64, async_scheduling=overlap)
    want = ref.generate(PROMPTS, PARAMS)
    got = eng.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert partial_utf8(tokenizer, [t for o in want for t in o.token_ids]), \
        "no generated id is a partial UTF-8 byte: the test lost its split characters"
    for o, w in zip(got, want):
        assert o.text and o.text == w.text == decode(tokenizer, w.token_ids)
    streamed = stream_all(eng, PROMPTS, PARAMS)
    for (joined, out), w in zip(streamed, want):
        assert out.token_ids == w.token_ids
        assert joined == out.text == w.text


def test_a_request_stopping_on_eos_has_no_eos_text_whole_or_streamed(tiny_ckpt_with_byte_tokenizer, tokenizer):
    """The EOS a request stops on ends its token ids on both engines but adds nothing to its text or its stream."""
    params = SamplingParams(max_tokens=8)
    ref = chunkwise.reference.Engine(tiny_ckpt_with_byte_tokenizer, max_model_len=32)
    eng = Engine(tiny_ckpt_with_byte_tokenizer, page_size=4, num_pages=16, max_model_len=32)
    want = ref.generate([STOPS_ON_EOS], params)[0]
    assert want.finish_reason == "stop" and want.token_ids[-1] == EOS and len(want.token_ids) > 1, \
        f"greedy on {STOPS_ON_EOS} gives {want.token_ids} ({want.finish_reason}): pick a prompt that stops on EOS"
    text = decode(tokenizer, want.token_ids[:-1])
    assert text and want.text == text
    got = eng.generate([STOPS_ON_EOS], params)[0]
    assert (got.token_ids, got.finish_reason, got.text) == (want.token_ids, "stop", text)
    [(joined, out)] = stream_all(eng, [STOPS_ON_EOS], params)
    assert out.token_ids == want.token_ids and joined == out.text == text


# ---- text prompts: the tokenizer's ids, special tokens where the tokenizer adds them and not in chunks -------------

@pytest.fixture(scope="module")
def bos_tokenizer(tiny_ckpt_with_byte_tokenizer):
    """The byte-level tokenizer made to open every encoded text with <s> (id 1), as Llama's and Gemma's do."""
    from tokenizers import processors

    tok = load_tokenizer(tiny_ckpt_with_byte_tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok("a").input_ids == [1, BYTE0 + ord("a")], "the fixture's tokenizer adds no BOS"
    return tok


@pytest.fixture(scope="module")
def qwen3_config(tiny_ckpt_with_byte_tokenizer):
    return ModelConfig.from_dir(tiny_ckpt_with_byte_tokenizer)


TEXTS = ["the cat", "é€ and 日本", " leading space", "a\nb"]


def test_a_text_prompt_is_the_tokenizers_own_ids_with_the_special_tokens_it_adds(bos_tokenizer, qwen3_config):
    assert encode_prompts(TEXTS, bos_tokenizer, qwen3_config) == [bos_tokenizer(t).input_ids for t in TEXTS]
    assert encode_prompts("the cat", bos_tokenizer, qwen3_config) == [bos_tokenizer("the cat").input_ids]
    assert encode_prompts(["the cat", [7, 8]], bos_tokenizer, qwen3_config)[1] == [7, 8]   # ids are taken as given


def test_a_text_piece_or_chunk_is_the_tokenizers_ids_without_special_tokens(bos_tokenizer):
    """A composite prompt's text pieces and a registered text chunk concatenate exactly: no BOS in the middle."""
    registry = ChunkRegistry("test")
    plain = [bos_tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    assert registry.chunk_ids(TEXTS[1], bos_tokenizer, VOCAB) == plain[1]
    chunk = registry.issue(registry.chunk_ids(TEXTS[0], bos_tokenizer, VOCAB))
    ids, pieces = registry.pieces([[1], chunk, TEXTS[1], [9, 10]], bos_tokenizer, 0)
    assert ids == [1] + plain[0] + plain[1] + [9, 10]
    assert [(p.chunk, p.num_tokens) for p in pieces] == [(None, 1), (chunk, len(plain[0])), (None, len(plain[1])),
                                                         (None, 2)]


def test_both_engines_take_a_text_prompt_as_the_tokenizers_ids(tiny_ckpt_with_byte_tokenizer):
    tok = load_tokenizer(tiny_ckpt_with_byte_tokenizer)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = chunkwise.reference.Engine(tiny_ckpt_with_byte_tokenizer, max_model_len=32)
    eng = Engine(tiny_ckpt_with_byte_tokenizer, page_size=4, num_pages=16, max_model_len=32)
    want = ref.generate([tok(TEXTS[1]).input_ids], params)[0]
    for engine in (ref, eng):
        out = engine.generate(TEXTS[1], params)[0]
        assert (out.prompt_token_ids, out.token_ids, out.text) == (want.prompt_token_ids, want.token_ids, want.text)
    rid = eng.add_request(TEXTS[1], params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert outs[-1].output.prompt_token_ids == want.prompt_token_ids
    assert "".join(o.new_text for o in outs) == want.text


@pytest.mark.parametrize("prompt,error,match", [
    ("", ValueError, "prompt 0 is empty"),
    (["the cat", ""], ValueError, "prompt 1 is empty"),
    ([[]], ValueError, "prompt 0 is empty"),
    (["ok", 3], TypeError, "prompt 1 must be a string or a list of token ids, got int 3"),
    ([[1, 2], [3, None]], TypeError, "prompt 1 holds NoneType None"),
    ([], ValueError, "non-empty list"),
])
def test_an_empty_or_ill_typed_prompt_is_refused_naming_its_index(tokenizer, qwen3_config, prompt, error, match):
    with pytest.raises(error, match=match):
        encode_prompts(prompt, tokenizer, qwen3_config)


def test_a_tensor_or_array_of_ids_is_one_prompt_or_a_batch_by_its_shape(qwen3_config):
    assert encode_prompts(torch.tensor([5, 6, 7]), None, qwen3_config) == [[5, 6, 7]]
    assert encode_prompts(np.array([[5, 6], [7, 8]]), None, qwen3_config) == [[5, 6], [7, 8]]
    assert encode_prompts([np.array([5, 6]), torch.tensor([7])], None, qwen3_config) == [[5, 6], [7]]
    ids, pieces = ChunkRegistry("test").pieces([np.array([5, 6]), [7]], None, 0)
    assert ids == [5, 6, 7] and [p.num_tokens for p in pieces] == [2, 1]


def test_a_text_prompt_without_a_tokenizer_is_refused_naming_the_prompt(qwen3_config):
    with pytest.raises(ValueError, match="prompt 1 is text but the checkpoint has no tokenizer"):
        encode_prompts([[5], "the cat"], None, qwen3_config)
    assert decode(None, [5, 6]) == ""
