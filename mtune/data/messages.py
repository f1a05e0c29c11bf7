"""A row's conversation as chat messages: OpenAI-style ``{role, content, ...}`` or ShareGPT-style ``{from, value}``.

ShareGPT's roles are ``human`` / ``gpt`` / ``system`` (``user`` / ``assistant`` too), plus the two tool roles of the
convention LLaMA-Factory's ShareGPT format uses (its ``function_tag`` and ``observation_tag`` defaults)::

    {"from": "function_call", "value": "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}"}
    {"from": "observation", "value": "{\\"temperature\\": 18}"}

A ``function_call`` turn is an assistant message calling the tool(s) its value names: the JSON text of one
``{"name", "arguments"}`` object, or of a list of them (parallel calls); ``arguments`` an object or its JSON text. An
``observation`` turn is a ``tool`` message holding the result. A ``gpt`` turn right before a ``function_call`` is
that assistant turn's text: the two become one message with the text and the calls, as the OpenAI form writes the
same turn (LLaMA-Factory itself skips such a row, whose roles break its rule of user / observation turns at odd
positions and gpt / function_call at even ones). The tool definitions of a ShareGPT row may be given bare
(``{"name", "description", "parameters"}``, as LLaMA-Factory's data has them): they are wrapped in OpenAI's
``{"type": "function", "function": ...}``, as LLaMA-Factory does for the templates that take that form, and an empty
text means no tools.
"""

from __future__ import annotations

import json
from typing import Any

from mtune.data.tokenized import RowError
from mtune.tokenizers.base import REASONING_FIELDS, ROLES, Message
from mtune.tokenizers.tools import ToolCall

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "function_call": "assistant", "observation": "tool"}
# OpenAI-style roles read as others: Llama 3.1's name for a tool's result (its template reads either)
OPENAI_ROLE_ALIASES = {"ipython": "tool"}
# OpenAI-style fields beyond role/content that reach Message (the reasoning under either name)
OPENAI_FIELDS = (*REASONING_FIELDS, "tool_calls", "name", "tool_call_id")


def chat_message(message: Any, column: str, i: int) -> tuple[str, str]:
    """``(role, content)`` of one message of either style; ``column[i]`` names it in errors."""
    if isinstance(message, dict) and "role" in message:  # OpenAI style
        role, content = message["role"], message.get("content")
        role = OPENAI_ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise RowError(f"{column}[{i}]: role {role!r} is not one of {', '.join(ROLES)} (or ipython, read as tool)")
    elif isinstance(message, dict) and "from" in message:  # ShareGPT style
        role, content = SHAREGPT_ROLES.get(message["from"]) if isinstance(message["from"], str) else None, \
            message.get("value")
        if role is None:
            raise RowError(f"{column}[{i}]: from={message['from']!r} is not one of {', '.join(SHAREGPT_ROLES)}")
    else:
        raise RowError(f"{column}[{i}]: a message needs role/content (OpenAI) or from/value (ShareGPT) keys")
    if content is None and message.get("tool_calls"):  # an assistant message that only calls tools
        content = ""
    if not isinstance(content, str):
        raise RowError(f"{column}[{i}]: content must be text, got {type(content).__name__}")
    return role, content


def conversation_messages(conversation: Any, column: str, system_prompt: str | None = None) -> list[Message]:
    """The Messages of a row's ``column`` (a non-empty list of messages of either style, see the module docstring).
    ``system_prompt`` replaces the conversation's system messages."""
    if not isinstance(conversation, list) or not conversation:
        raise RowError(f"column {column!r} must be a non-empty list of messages")
    messages = [Message("system", system_prompt)] if system_prompt else []
    previous_from = None
    for i, message in enumerate(conversation):
        role, content = chat_message(message, column, i)
        if system_prompt and role == "system":
            continue
        sharegpt = message.get("from") if "role" not in message else None
        try:
            if sharegpt == "function_call":
                calls = _function_call(content, f"{column}[{i}]")
                if previous_from == "gpt":  # the text of the same assistant turn: one message with text and calls
                    text = messages.pop()
                    messages.append(Message("assistant", text.content, thinking=text.thinking, tool_calls=calls))
                else:
                    messages.append(Message("assistant", "", tool_calls=calls))
            else:
                extra = {key: message[key] for key in OPENAI_FIELDS
                         if sharegpt is None and message.get(key) is not None}
                messages.append(Message.from_dict({"role": role, "content": content, **extra}))
        except (TypeError, ValueError) as e:
            raise RowError(f"{column}[{i}]: {e}") from None
        previous_from = sharegpt
    return messages


def with_row_system(messages: list[Message], value: Any, column: str) -> list[Message]:
    """``messages`` opened by a row's system column ``value`` (LLaMA-Factory's separate system prompt, text) where
    they do not open with a system message of their own, which wins (as in LLaMA-Factory). None or an empty text adds
    nothing; any other value than text is a RowError naming ``column``."""
    if value is None or value == "":
        return messages
    if not isinstance(value, str):
        raise RowError(f"column {column!r} must be text, got {type(value).__name__}")
    return messages if messages and messages[0].role == "system" else [Message("system", value), *messages]


def _function_call(value: str, where: str) -> tuple[ToolCall, ...]:
    """The calls of a ShareGPT ``function_call`` turn's value."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: a function_call value must be the JSON text of a {{\"name\", \"arguments\"}} object "
                       f"or a list of them; it is not valid JSON ({e.msg} at character {e.pos})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls:
        raise RowError(f"{where}: a function_call value names no call (an empty list)")
    return tuple(ToolCall.parse(call, f"function_call[{k}]") for k, call in enumerate(calls))


def sharegpt_tools(value: Any, column: str) -> Any:
    """A ShareGPT row's tool definitions: bare ``{"name", ...}`` definitions (given as a list or its JSON text)
    wrapped in ``{"type": "function", "function": ...}``; an empty text is no tools. Anything else is returned as
    given, for the tokenizer to check."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"column {column!r} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, list):
        return value
    return [{"type": "function", "function": tool} if isinstance(tool, dict) and "type" not in tool
            and "function" not in tool and "name" in tool else tool for tool in value]


def row_tools(value: Any, column: str, conversation: Any) -> Any:
    """A row's tool definitions (its ``column``'s ``value``) for the conversation they go with: wrapped as
    :func:`sharegpt_tools` wraps them where the conversation is ShareGPT-style, else as given."""
    return sharegpt_tools(value, column) if is_sharegpt(conversation) else value


def is_sharegpt(conversation: Any) -> bool:
    """Whether a conversation's messages are ShareGPT-style (its first message has ``from``)."""
    return isinstance(conversation, list) and bool(conversation) and isinstance(conversation[0], dict) and \
        "from" in conversation[0] and "role" not in conversation[0]
