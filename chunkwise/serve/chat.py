"""Chat messages with chunk parts, as a composite prompt: the chat template's text around registered chunks' ids.

A message's content may hold `{"type": "chunk", "chunk": "chunk-<n>"}` parts beside its text parts. The template
is rendered with a unique placeholder string where each chunk part stands; the rendered text is split on the
placeholders, each text segment tokenized as `apply_chat_template` tokenizes a whole conversation (without adding
special tokens: the template writes its own), and each placeholder replaced by its chunk's handle. So a chunk's
ids go in exactly as registered and are never re-tokenized with the text around them; where the tokenizer splits
at the chunk's edges anyway, the ids equal those of the conversation with the chunk's text inlined.

Bad parts are 400s naming the part (`messages[i].content[j]`): an unknown chunk, a chunk in a tool message (a
tool's output is the tool's, not a registered chunk), and a chunk in a system message when the template has no
system role (it refuses system messages, or drops them).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from chunkwise.chunks import Chunk
from chunkwise.serve.protocol import ChatMessage, bad_request, chunk_name

SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation with chunk parts as the engine takes it: a composite prompt (lists of ids and Chunk handles,
    in order) and its number of tokens."""
    pieces: tuple[list[int] | Chunk, ...]
    num_tokens: int


def has_chunk_parts(messages: list[ChatMessage]) -> bool:
    return any(not isinstance(m.content, str) and any(p.type == "chunk" for p in m.content) for m in messages)


def splice_chat(tokenizer, messages: list[ChatMessage], chunks: dict[str, Chunk]) -> ChatPrompt:
    """The conversation's composite prompt: the template rendered around a placeholder per chunk part, its text
    segments tokenized, each placeholder replaced by its chunk. A 400 naming the part for a bad one."""
    nonce = uuid.uuid4().hex
    parts: list[tuple[Chunk, str, str]] = []   # (chunk, where, role) per placeholder, in the messages' order
    rendered_messages = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            rendered_messages.append({"role": m.role, "content": m.content})
            continue
        text = []
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text" and part.text is not None and part.chunk is None:
                text.append(part.text)
            elif part.type == "chunk" and isinstance(part.chunk, str) and part.text is None:
                if m.role == "tool":
                    raise bad_request(f"{where}: a tool message cannot hold a chunk (its content is the tool's "
                                      f"output); put chunk `{part.chunk}` in a user or system message", where)
                chunk = chunks.get(part.chunk)
                if chunk is None:
                    raise bad_request(f"{where}: the chunk `{part.chunk}` does not exist (register it with POST "
                                      f"/v1/chunks)", where + ".chunk")
                text.append(_placeholder(nonce, len(parts)))
                parts.append((chunk, where, m.role))
            else:
                raise bad_request(f'{where} must be {{"type": "text", "text": ...}} or {{"type": "chunk", "chunk": '
                                  f'"chunk-<n>"}}, got {part.model_dump(exclude_none=True)!r:.80}',
                                  where if part.type in ("text", "chunk") else where + ".type")
        rendered_messages.append({"role": m.role, "content": "".join(text)})
    rendered = _render(tokenizer, rendered_messages, parts)
    found = re.compile(re.escape(f"<|chunkwise-{nonce}:") + r"(\d+)" + re.escape("|>"))
    pieces: list[list[int] | Chunk] = []
    placed = set()
    start = 0
    for hit in found.finditer(rendered):
        _append_text(pieces, tokenizer, rendered[start:hit.start()])
        k = int(hit.group(1))
        pieces.append(parts[k][0])
        placed.add(k)
        start = hit.end()
    _append_text(pieces, tokenizer, rendered[start:])
    missing = next((k for k in range(len(parts)) if k not in placed), None)
    if missing is not None:
        chunk, where, role = parts[missing]
        if role in SYSTEM_ROLES:
            raise _no_system_role(where, chunk, "drops system messages")
        raise bad_request(f"{where}: the chat template left chunk `{chunk_name(chunk)}` out of the prompt", where)
    return ChatPrompt(tuple(pieces), sum(len(p) for p in pieces))


def _placeholder(nonce: str, k: int) -> str:
    """The k-th chunk part's stand-in in the rendered text (`found` in splice_chat matches it)."""
    return f"<|chunkwise-{nonce}:{k}|>"


def _render(tokenizer, messages: list[dict], parts: list[tuple[Chunk, str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:   # the template itself may refuse a conversation (roles out of order, no system role)
        system = next(((c, w) for c, w, role in parts if role in SYSTEM_ROLES), None)
        if system is not None and _refuses_system(tokenizer):
            raise _no_system_role(system[1], system[0], f"refuses system messages ({type(e).__name__}: {e})") from None
        raise bad_request(f"the chat template could not format these messages: {type(e).__name__}: {e}",
                          "messages") from None


def _refuses_system(tokenizer) -> bool:
    try:
        tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                      add_generation_prompt=True, tokenize=False)
    except Exception:
        return True
    return False


def _no_system_role(where: str, chunk: Chunk, how: str):
    return bad_request(f"{where}: the chat template has no system role (it {how}), so system chunk "
                       f"`{chunk_name(chunk)}` has no place in the prompt; put it in a user message", where)


def _append_text(pieces: list, tokenizer, text: str) -> None:
    """The ids of a text segment between chunks, as apply_chat_template tokenizes its whole rendering."""
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    if ids:
        pieces.append(list(ids))
