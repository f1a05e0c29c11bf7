"""What a prompt is made of: a chat given in a config (``messages``) as `Message` objects, and the token ids of a
plain-text prompt or of a chat awaiting its reply (``mtune run generate``)."""

from __future__ import annotations

from collections.abc import Iterable

from mtune.config.errors import ConfigError
from mtune.tokenizers.base import ROLES, Message, Tokenizer

__all__ = ["chat_messages", "prompt_tokens"]


def chat_messages(messages: Iterable) -> list[Message]:
    """The config's ``messages`` as `Message` objects; a turn that is not ``{role, content}`` with a known role and
    text content is refused in one line naming it (``messages[1].role``)."""
    chat = []
    for i, turn in enumerate(messages):
        if not hasattr(turn, "keys") or set(turn.keys()) != {"role", "content"}:
            raise ConfigError(f"messages[{i}]: expected {{role: ..., content: ...}}, got {turn!r}")
        if turn["role"] not in ROLES:
            raise ConfigError(f"messages[{i}].role: {turn['role']!r} is not a chat role; use one of "
                              f"{', '.join(ROLES)}")
        if not isinstance(turn["content"], str):
            raise ConfigError(f"messages[{i}].content: expected text, got {type(turn['content']).__name__} "
                              f"{turn['content']!r} (quote it)")
        chat.append(Message(role=turn["role"], content=turn["content"]))
    return chat


def prompt_tokens(tokenizer: Tokenizer, prompt: str | None, messages: Iterable | None) -> list[int]:
    """Token ids of a plain-text prompt (BOS where the family has one, no EOS) or of a chat awaiting its reply.
    A prompt longer than the tokenizer's ``max_seq_len`` is refused: cut, it would be another prompt (a chat cut
    inside its last header is answered as garbage)."""
    whole = 1 << 62  # no cut: the prompt as written
    if messages is not None:
        ids = tokenizer.tokenize_messages(chat_messages(messages), max_seq_len=whole, add_generation_prompt=True).tokens
    else:
        ids = tokenizer.encode_with_truncation(prompt, add_bos=True, add_eos=False, max_seq_len=whole).tokens
    limit = tokenizer.max_seq_len
    if limit is not None and len(ids) > limit:
        raise ConfigError(f"the prompt is {len(ids)} tokens, more than tokenizer.max_seq_len={limit}: raise "
                          "tokenizer.max_seq_len (null: no limit) or shorten the prompt")
    return ids
