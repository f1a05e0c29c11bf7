"""Qwen3 tokenizer: Qwen2's byte-level BPE ``tokenizer.json`` and ChatML turns, with Qwen3's thinking block.

Qwen3's chat template adds no default system prompt and renders an assistant reply that comes after the last user
message with its reasoning in a thinking block (empty when the reply has none)::

    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{reply}<|im_end|>\\n

Replies before the last user message lose their reasoning (``<|im_start|>assistant\\n{reply}<|im_end|>``). A reply's
reasoning is read as the template reads it: from the message's own field (``Message.thinking``, the template's
``reasoning_content``), else from a ``<think>\\n...\\n</think>\\n\\n`` block before the answer in its content (the
content is searched for it only when the field is absent: with both, the content is written as it is after the
field's reasoning, its block included, whose tags are then text like any spelling in a message). ``<think>`` and
``</think>`` are single tokens; the thinking block is part of the trained reply. A user message that only wraps a
tool's output in ``<tool_response>...</tool_response>`` does not count as the last user message.

Tool calling (``tools``, an assistant message's ``tool_calls``, ``tool`` messages) is rendered as the template does,
see :mod:`mtune.tokenizers.qwen_tools`: the calls are trained with their reply, tool definitions and results are not.
"""

from __future__ import annotations

import re
from pathlib import Path

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.chat_builder import ChatBuilder
from mtune.tokenizers.qwen2 import Qwen2Tokenizer
from mtune.tokenizers.qwen_tools import (QWEN3_TOOLS_HEAD, QWEN3_TOOLS_TAIL, TOOL_TAGS, qwen3_calls, tool_results,
                                         tools_text)

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(content: str, thinking: str | None = None) -> tuple[str, str]:
    """``(reasoning, answer)`` of an assistant message as Qwen3's and Qwen3.5's templates find them: ``thinking``
    (the message's ``reasoning_content``) and the content untouched when it is given, else the content split at its
    ``</think>`` (no ``</think>``: no reasoning)."""
    if thinking is not None:
        return thinking, content
    if THINK_END not in content:
        return "", content
    reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
    return reasoning, content.split(THINK_END)[-1].lstrip("\n")


class Qwen3Tokenizer(Qwen2Tokenizer):
    """Qwen3 ``tokenizer.json``: :class:`Qwen2Tokenizer`'s ids and turns, no default system prompt, and the
    thinking block of the module docstring. ``enable_thinking=False`` makes the generation prompt end with an empty
    thinking block, as the template's ``enable_thinking=false`` does (the model then answers without reasoning)."""

    family = "qwen3"
    reads_thinking = True  # the template's reasoning_content
    reads_tools = True

    def __init__(self, path: str | Path, max_seq_len: int | None = None, system_prompt: str | None = None,
                 enable_thinking: bool = True):
        super().__init__(path, max_seq_len, system_prompt=system_prompt)
        self.think_start_id = self._full.token_to_id(THINK_START)
        self.think_end_id = self._full.token_to_id(THINK_END)
        if self.think_start_id is None or self.think_end_id is None:
            raise TokenizerError(f"{path}: no {THINK_START} / {THINK_END} tokens; this does not look like a Qwen3 "
                                 "tokenizer.json")
        self.enable_thinking = enable_thinking
        # the tool tags this tokenizer.json has as tokens (Qwen3's and Qwen3.5's all four; not special)
        ids = {tag: self._full.token_to_id(tag) for tag in TOOL_TAGS}
        self._tag_ids = {tag: i for tag, i in ids.items() if i is not None}
        self._tag_pattern = re.compile("(" + "|".join(map(re.escape, self._tag_ids)) + ")")

    def _fingerprint_extra(self) -> str:
        return f"{super()._fingerprint_extra()} enable_thinking={self.enable_thinking}"

    def _tagged(self, out: ChatBuilder, text: str, trained: bool = False) -> None:
        """Template text with the tool tags in it, each one this tokenizer's token where it has one."""
        for piece in self._tag_pattern.split(text) if self._tag_ids else [text]:
            if piece in self._tag_ids:
                out.token(self._tag_ids[piece], trained)
            else:
                out.text(piece, trained)

    def _plain_turn(self, out: ChatBuilder, role: str, content: str) -> None:
        """``<|im_start|>{role}\\n{content}<|im_end|>\\n``, not trained."""
        out.token(self.im_start_id), out.text(f"{role}\n{content}"), out.token(self.im_end_id), out.text("\n")

    def _reply(self, out: ChatBuilder, reasoning: str | None, answer: str) -> None:
        """An assistant turn's opening and text: ``<|im_start|>assistant\\n``, then (trained) the thinking block
        ``<think>\\n{reasoning}\\n</think>\\n\\n`` unless ``reasoning`` is None, and ``answer``."""
        out.token(self.im_start_id), out.text("assistant\n")
        if reasoning is not None:
            out.token(self.think_start_id, True), out.text(f"\n{reasoning}\n", True)
            out.token(self.think_end_id, True), out.text("\n\n", True)
        out.text(answer, True)

    def _end_reply(self, out: ChatBuilder) -> None:
        out.token(self.im_end_id, True), out.text("\n")

    def _render(self, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        if messages[0].role != "system" and self.system_prompt is not None:
            messages = [Message("system", self.system_prompt)] + list(messages)
        out = ChatBuilder(self)
        system = messages[0].content if messages[0].role == "system" else None
        if tools:
            out.token(self.im_start_id), out.text("system\n" + (system + "\n\n" if system is not None else ""))
            self._tagged(out, tools_text(QWEN3_TOOLS_HEAD, tools, QWEN3_TOOLS_TAIL))
            out.token(self.im_end_id), out.text("\n")
        elif system is not None:
            self._plain_turn(out, "system", system)
        # the last user query: a user message that only wraps a tool's output does not count, as in the template
        last_query = max((i for i, m in enumerate(messages) if m.role == "user" and not (
            m.content.startswith("<tool_response>") and m.content.endswith("</tool_response>"))),
            default=len(messages) - 1)
        for i, message in enumerate(messages):
            if i == 0 and system is not None:
                continue
            if message.role == "assistant":
                reasoning, answer = split_reasoning(message.content, message.thinking)
                if i > last_query and (i == len(messages) - 1 or reasoning):
                    self._reply(out, reasoning.strip("\n"), answer.lstrip("\n"))
                else:
                    self._reply(out, None, answer)
                qwen3_calls(self, out, message.tool_calls, after_text=bool(answer))
                self._end_reply(out)
            elif message.role == "tool":
                tool_results(self, out, messages, i, message.content, opens=i == 0 or messages[i - 1].role != "tool")
            else:
                self._plain_turn(out, message.role, message.content)
        if add_generation_prompt:
            out.token(self.im_start_id), out.text("assistant\n")
            if not self.enable_thinking:
                out.token(self.think_start_id), out.text("\n\n"), out.token(self.think_end_id), out.text("\n\n")
        return out.result()
