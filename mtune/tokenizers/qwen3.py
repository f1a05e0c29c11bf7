"""Qwen3 tokenizer: Qwen2's byte-level BPE ``tokenizer.json`` and ChatML turns, with Qwen3's thinking block.

Qwen3's chat template adds no default system prompt and renders an assistant reply that comes after the last user
message with its reasoning in a thinking block (empty when the reply has none)::

    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{reply}<|im_end|>\\n

Replies before the last user message lose their reasoning (``<|im_start|>assistant\\n{reply}<|im_end|>``). A reply's
reasoning is written in its content as the template reads it: ``<think>\\n...\\n</think>\\n\\n`` before the answer.
``<think>`` and ``</think>`` are single tokens; the thinking block is part of the trained reply.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.qwen2 import Qwen2Tokenizer

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(content: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of an assistant message as Qwen3's template splits it (no ``</think>``: no
    reasoning)."""
    if THINK_END not in content:
        return "", content
    reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
    return reasoning, content.split(THINK_END)[-1].lstrip("\n")


class Qwen3Tokenizer(Qwen2Tokenizer):
    """Qwen3 ``tokenizer.json``: :class:`Qwen2Tokenizer`'s ids and turns, no default system prompt, and the
    thinking block of the module docstring. ``enable_thinking=False`` makes the generation prompt end with an empty
    thinking block, as the template's ``enable_thinking=false`` does (the model then answers without reasoning)."""

    family = "qwen3"

    def __init__(self, path: str | Path, max_seq_len: int | None = None, system_prompt: str | None = None,
                 enable_thinking: bool = True):
        super().__init__(path, max_seq_len, system_prompt=system_prompt)
        self.think_start_id = self._full.token_to_id(THINK_START)
        self.think_end_id = self._full.token_to_id(THINK_END)
        if self.think_start_id is None or self.think_end_id is None:
            raise TokenizerError(f"{path}: no {THINK_START} / {THINK_END} tokens; this does not look like a Qwen3 "
                                 "tokenizer.json")
        self.enable_thinking = enable_thinking

    def _fingerprint_extra(self) -> str:
        return f"{super()._fingerprint_extra()} enable_thinking={self.enable_thinking}"

    def _thinking_reply(self, reasoning: str, answer: str) -> tuple[list[int], list[bool]]:
        """``<|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>\\n``, trained from
        ``<think>`` to ``<|im_end|>``."""
        header = self.encode_text("assistant\n")
        body = ([self.think_start_id] + self.encode_text("\n" + reasoning.strip("\n") + "\n") + [self.think_end_id]
                + self.encode_text("\n\n" + answer.lstrip("\n")) + [self.im_end_id])
        newline = self.encode_text("\n")
        tokens = [self.im_start_id] + header + body + newline
        return tokens, [False] * (1 + len(header)) + [True] * len(body) + [False] * len(newline)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        if messages[0].role != "system" and self.system_prompt is not None:
            messages = [Message("system", self.system_prompt)] + list(messages)
        last_query = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
        tokens: list[int] = []
        trained: list[bool] = []
        for i, message in enumerate(messages):
            if message.role == "assistant":
                reasoning, answer = split_reasoning(message.content)
                if i > last_query and (i == len(messages) - 1 or reasoning):
                    ids, mask = self._thinking_reply(reasoning, answer)
                else:
                    ids, mask = self._turn("assistant", answer)
            else:
                ids, mask = self._turn(message.role, message.content)
            tokens += ids
            trained += mask
        if add_generation_prompt:
            ids, mask = self._turn("assistant", None)
            if not self.enable_thinking:
                ids = ids + [self.think_start_id] + self.encode_text("\n\n") + [self.think_end_id] + \
                    self.encode_text("\n\n")
                mask = [False] * len(ids)
            tokens += ids
            trained += mask
        return tokens, trained
