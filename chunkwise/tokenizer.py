"""The checkpoint's HF tokenizer (when it has one) and prompt validation shared by both engines.

A prompt is a string (needs a tokenizer) or a list of token ids. Tiny test checkpoints have no
tokenizer; their prompts are token ids and their outputs have empty text.
"""
from __future__ import annotations

import numbers
from pathlib import Path

from chunkwise.limits import LIMIT
from chunkwise.model_config import ModelConfig

PROMPT_TOKEN_ID = LIMIT["prompt_token_id"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(ckpt_dir: str | Path):
    """HF's tokenizer from `ckpt_dir`, or None when the directory holds no tokenizer files."""
    ckpt_dir = Path(ckpt_dir)
    if not any((ckpt_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ckpt_dir))


def is_int(x) -> bool:
    """An integer that is not a bool (True is not a token id, a chunk size or a page size)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def all_ints(xs) -> bool:
    """Every element `is_int`. Prompts run to many thousands of ids, checked on the request path: a list of
    plain ints is recognised by their types at C speed, and only other lists (numpy ints, or a bad element)
    take the element-wise check."""
    return set(map(type, xs)) <= {int} or all(is_int(t) for t in xs)


def is_single_prompt(prompts) -> bool:
    """A string or one list of token ids (rather than a batch of prompts)."""
    if hasattr(prompts, "tolist"):  # a tensor or array of ids, one prompt or a batch
        prompts = prompts.tolist()
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                        and all_ints(prompts))


def as_prompt_list(prompts) -> list:
    """One prompt (a string or a list of ids) or a list of prompts, as a list of prompts. A wrong type is a
    TypeError, an empty batch a ValueError, each naming the value."""
    if hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__} {prompts!r:.80}")
    if len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those; got []")
    return list(prompts)


def check_vocabulary(i: int, ids, cfg: ModelConfig) -> None:
    """ValueError naming prompt i and the first of its ids (ints, or an int64 array) outside [0, vocab_size)."""
    bad = PROMPT_TOKEN_ID.first_outside(ids, vocab_size=cfg.vocab_size)
    if bad is not None:
        raise ValueError(f"prompt {i} holds token id {bad!r}, outside the vocabulary "
                         f"{PROMPT_TOKEN_ID.interval(vocab_size=cfg.vocab_size)}")


def encode_prompts(prompts, tokenizer, cfg: ModelConfig, arrays: dict | None = None) -> list[list[int]]:
    """Token ids of each prompt. ValueError names the prompt index for an empty prompt, a string
    without a tokenizer, or a token id outside [0, vocab_size); TypeError names it and the value for a
    prompt that is neither a string nor a list, or an id that is not an integer. `arrays`: prompt index -> the
    prompt's ids as an int64 array, for a list of plain ints made with one (a composite prompt's,
    chunkwise/chunks.py): taken as it is and checked against the vocabulary on the array, with no pass over the
    list."""
    out = []
    arrays = arrays or {}
    for i, p in enumerate(as_prompt_list(prompts)):
        if i in arrays:
            check_vocabulary(i, arrays[i], cfg)
            out.append(p)
            continue
        if hasattr(p, "tolist"):
            p = p.tolist()
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but the checkpoint has no tokenizer; pass token ids")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:   # e.g. a lone surrogate, which no tokenizer can encode
                raise ValueError(f"prompt {i} is not valid Unicode text: {e.reason} at character {e.start} "
                                 f"({p[e.start]!r})") from None
            ids = list(tokenizer.encode(p))
        elif isinstance(p, (list, tuple)):
            ids = list(p)
        else:
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__} {p!r:.80}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        # One pass over the types at C speed (prompts run to many thousands of ids): a list of plain ints is
        # used as it is; numpy ints become plain ints; anything else is refused by name.
        if not set(map(type, ids)) <= {int}:
            if not all_ints(ids):
                bad = next(t for t in ids if not is_int(t))
                raise TypeError(f"prompt {i} holds {type(bad).__name__} {bad!r}, which is not an integer token id")
            ids = list(map(int, ids))
        check_vocabulary(i, ids, cfg)
        out.append(ids)
    return out


def decode(tokenizer, token_ids: list[int]) -> str:
    """Text of generated tokens; empty without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class TextStream:
    """One request's generated text in pieces, as its tokens arrive (`push`), then the rest (`finish`): the pieces
    joined are exactly `decode(tokenizer, all its tokens)`.

    Each push decodes a short window, not every token so far: the tokens since the last piece, after the ones
    before that piece (their text is subtracted, so a decoder that treats a window's first token differently, e.g.
    dropping a leading space, does so on both sides). A piece is held back while the text ends in U+FFFD, the
    replacement for an incomplete UTF-8 sequence, so a character split across byte tokens arrives whole.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # the window's first token: the text of [prefix_offset, read_offset) was sent
        self.read_offset = 0     # tokens after it have not been sent yet
        self.num_chars = 0       # characters sent

    def push(self, token_ids: list[int]) -> str:
        """The text that `token_ids`, appended, complete; "" while a character is incomplete."""
        self.token_ids += token_ids
        sent = decode(self.tokenizer, self.token_ids[self.prefix_offset:self.read_offset])
        text = decode(self.tokenizer, self.token_ids[self.prefix_offset:])
        if len(text) <= len(sent) or text.endswith("\ufffd"):
            return ""
        piece = text[len(sent):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.num_chars += len(piece)
        return piece

    def finish(self) -> str:
        """The text not sent yet (a held-back incomplete character, as the whole text decodes it)."""
        return decode(self.tokenizer, self.token_ids)[self.num_chars:]


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat (`[{"role": ..., "content": ...}]`) through the checkpoint's chat template,
    ending with the assistant's turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("the checkpoint's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
