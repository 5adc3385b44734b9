"""Text prompts through the checkpoint's HF tokenizer: encoding, decoded output text, chat templates."""
import pytest

from chunkwise.model_config import ModelConfig
from chunkwise.tokenizer import chat_prompt, encode_prompts, load_tokenizer
from chunkwise.reference import Engine, SamplingParams

pytestmark = pytest.mark.correctness


def test_text_prompt_equals_its_token_ids_and_output_is_decoded(tiny_ckpt_with_tokenizer):
    eng = Engine(tiny_ckpt_with_tokenizer)
    ids = eng.tokenizer.encode("the quick brown fox")
    assert ids == [3, 4, 5, 6]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    by_text, by_ids = eng.generate(["the quick brown fox", ids], params)
    assert by_text.prompt_token_ids == ids and by_text.token_ids == by_ids.token_ids
    assert by_text.text == by_ids.text == eng.tokenizer.decode(by_ids.token_ids, skip_special_tokens=True)


def test_chat_template_renders_through_the_tokenizer(tiny_ckpt_with_tokenizer):
    tok = load_tokenizer(tiny_ckpt_with_tokenizer)
    assert chat_prompt(tok, [{"role": "user", "content": "the lazy dog"}]) == tok.encode("user the lazy dog")


def test_checkpoint_without_tokenizer_has_none_and_no_chat_template(tiny_ckpt):
    path = tiny_ckpt("llama")
    assert load_tokenizer(path) is None
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(None, [{"role": "user", "content": "hi"}])


def test_empty_text_prompt_is_named(tiny_ckpt_with_tokenizer):
    eng = Engine(tiny_ckpt_with_tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(["the dog", ""], eng.tokenizer, eng.model_config)


def test_lone_surrogate_in_a_text_prompt_is_named(tiny_ckpt_with_tokenizer):
    tok = load_tokenizer(tiny_ckpt_with_tokenizer)
    cfg = ModelConfig.from_dir(tiny_ckpt_with_tokenizer)
    with pytest.raises(ValueError, match=r"prompt 1 is not valid Unicode text: .* character 4 \('\\udc80'\)"):
        encode_prompts(["the dog", "the \udc80 dog"], tok, cfg)
