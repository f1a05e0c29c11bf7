"""Qwen3.5 tokenizer: Qwen3's ``tokenizer.json``, ChatML turns and ``<think>`` tags, with Qwen3.5's chat template.

The checkpoints' template (``tokenizer_config.json`` / ``chat_template.jinja`` of ``Qwen/Qwen3.5-*``) differs from
Qwen3's in four ways this module follows:

- every message's text is trimmed of surrounding whitespace (the template's ``render_content(...)|trim``), and a
  reply's reasoning too;
- every assistant reply after the last user message opens with its thinking block, empty or not (Qwen3 writes an
  empty block only on the conversation's last reply)::

      <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>\\n

- the generation prompt opens the thinking block: ``<|im_start|>assistant\\n<think>\\n``, or, with
  ``enable_thinking=False``, the closed empty block ``<think>\\n\\n</think>\\n\\n``;
- a conversation needs a user message (one that is not a ``<tool_response>``: such a message does not count as the
  last query either), and a system message only comes first (the template raises otherwise).

Replies before the last user message lose their reasoning, as in Qwen3. The thinking block is trained with the
reply; the tool-calling branches of the template (``tools``, ``tool_calls``, the ``tool`` role) are not rendered.
"""

from __future__ import annotations

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.qwen3 import Qwen3Tokenizer, split_reasoning


def is_tool_response(content: str) -> bool:
    text = content.strip()
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


class Qwen3_5Tokenizer(Qwen3Tokenizer):
    """Qwen3.5 ``tokenizer.json``: :class:`Qwen3Tokenizer`'s ids, the chat format of the module docstring."""

    family = "qwen3_5"

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        if messages[0].role != "system" and self.system_prompt is not None:
            messages = [Message("system", self.system_prompt)] + list(messages)
        if any(m.role == "system" for m in messages[1:]):
            raise TokenizerError("qwen3_5 chat format: a system message may only come first (as Qwen3.5's chat "
                                 "template requires)")
        # the last user query: a user message wrapping a tool's output does not count, as in the template
        queries = [i for i, m in enumerate(messages) if m.role == "user" and not is_tool_response(m.content)]
        if not queries:
            raise TokenizerError("qwen3_5 chat format: the conversation has no user message (Qwen3.5's chat "
                                 "template requires one that is not a <tool_response>)")
        tokens: list[int] = []
        trained: list[bool] = []
        for i, message in enumerate(messages):
            content = message.content.strip()
            if message.role == "assistant":
                reasoning, answer = split_reasoning(content)
                if i > queries[-1]:
                    ids, mask = self._thinking_reply(reasoning.strip(), answer)
                else:
                    ids, mask = self._turn("assistant", answer)
            else:
                ids, mask = self._turn(message.role, content)
            tokens += ids
            trained += mask
        if add_generation_prompt:
            ids, _ = self._turn("assistant", None)
            ids = ids + [self.think_start_id]
            if self.enable_thinking:
                ids += self.encode_text("\n")
            else:
                ids += self.encode_text("\n\n") + [self.think_end_id] + self.encode_text("\n\n")
            tokens += ids
            trained += [False] * len(ids)
        return tokens, trained
