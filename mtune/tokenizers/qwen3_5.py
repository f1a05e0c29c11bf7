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

Replies before the last user message lose their reasoning, as in Qwen3; a reply's reasoning is read as in Qwen3
(``Message.thinking``, the template's ``reasoning_content``, else a ``<think>`` block in the content). The thinking
block is trained with the reply. Tool calling is rendered as the template does (see
:mod:`mtune.tokenizers.qwen_tools`: Qwen3.5 writes a call as ``<function=...>`` with one ``<parameter=...>`` block
per argument): the calls are trained with their reply, tool definitions and results are not.
"""

from __future__ import annotations

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.chat_builder import ChatBuilder
from mtune.tokenizers.qwen3 import Qwen3Tokenizer, split_reasoning
from mtune.tokenizers.qwen_tools import QWEN3_5_TOOLS_HEAD, QWEN3_5_TOOLS_TAIL, qwen3_5_calls, tool_results, tools_text


def is_tool_response(content: str) -> bool:
    text = content.strip()
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


class Qwen3_5Tokenizer(Qwen3Tokenizer):
    """Qwen3.5 ``tokenizer.json``: :class:`Qwen3Tokenizer`'s ids, the chat format of the module docstring."""

    family = "qwen3_5"

    def _render(self, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
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
        out = ChatBuilder(self)
        system = messages[0].content.strip() if messages[0].role == "system" else None
        if tools:
            out.token(self.im_start_id), out.text("system\n")
            self._tagged(out, tools_text(QWEN3_5_TOOLS_HEAD, tools, QWEN3_5_TOOLS_TAIL))
            out.text("\n\n" + system if system else ""), out.token(self.im_end_id), out.text("\n")
        elif system is not None:
            self._plain_turn(out, "system", system)
        for i, message in enumerate(messages):
            content = message.content.strip()
            if message.role == "assistant":
                reasoning, answer = split_reasoning(content, message.thinking)
                self._reply(out, reasoning.strip() if i > queries[-1] else None, answer)
                qwen3_5_calls(self, out, message.tool_calls, after_text=bool(answer.strip()))
                self._end_reply(out)
            elif message.role == "tool":
                tool_results(self, out, messages, i, content, opens=i > 0 and messages[i - 1].role != "tool")
            elif message.role == "user":
                self._plain_turn(out, "user", content)
        if add_generation_prompt:
            out.token(self.im_start_id), out.text("assistant\n"), out.token(self.think_start_id)
            if self.enable_thinking:
                out.text("\n")
            else:
                out.text("\n\n"), out.token(self.think_end_id), out.text("\n\n")
        return out.result()
