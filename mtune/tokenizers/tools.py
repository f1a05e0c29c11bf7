"""Tool calling in chat data: the tools a conversation offers and the calls an assistant message makes.

The format is OpenAI's / Hugging Face's ``apply_chat_template(messages, tools=...)``::

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "...",
                                               "parameters": {JSON schema of the arguments}}}]
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    {"role": "tool", "content": "18 C, sunny"}                      # optional: name, tool_call_id

A call's ``arguments`` is a JSON object, given as a dict or as its JSON text (as the OpenAI API returns it); a
call may also be given without the ``function`` wrapper (``{"name": ..., "arguments": ...}``). Which families render
tools, and how, is their own module's business (gpt-oss: ``gpt_oss_tools``; Qwen3 / Qwen3.5: ``qwen_tools``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "parse_tool_calls", "parse_tools", "tojson"]


def tojson(value: Any, indent: int | None = None) -> str:
    """JSON text as the chat templates' ``tojson`` filter writes it under transformers: ``json.dumps`` with
    non-ASCII kept, ``", "`` / ``": "`` separators (``","`` at line ends with ``indent``) and the keys in their
    given order."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _json_object(value: Any, what: str) -> dict:
    """``value`` as a dict: itself, or the JSON object its text holds. ``what`` names it in the error."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a dict or its JSON text), got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ToolCall:
    """One call an assistant message makes. ``arguments``: the call's arguments as a dict. ``arguments_text``: the
    JSON text they were given as, when they were given as text (None for a dict); Qwen3's template writes such text
    verbatim, and the others render the dict."""

    name: str
    arguments: dict
    arguments_text: str | None = None

    @classmethod
    def parse(cls, value: Any, where: str) -> "ToolCall":
        """A call from its OpenAI / Hugging Face dict (``{"type": "function", "function": {"name", "arguments"}}``
        or ``{"name", "arguments"}``) or a ToolCall. ``where`` names it in errors (e.g. ``message 2 tool_calls[0]``)."""
        if isinstance(value, ToolCall):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a tool call must be a dict with a function name and arguments, got "
                             f"{type(value).__name__}")
        function = value.get("function", value)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}: a tool call needs function.name (non-empty text)")
        arguments = function.get("arguments", {})
        parsed = _json_object(arguments, f"{where} arguments")
        return cls(function["name"], parsed, arguments if isinstance(arguments, str) else None)


def parse_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """A message's ``tool_calls`` (None or a list of calls) as ToolCalls."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: tool_calls must be a list, got {type(value).__name__}")
    return tuple(ToolCall.parse(call, f"{where} tool_calls[{i}]") for i, call in enumerate(value))


def parse_tools(value: Any, where: str = "tools") -> list[dict] | None:
    """The tools a conversation offers: a list of ``{"type": "function", "function": {"name": ..., ...}}`` dicts
    (or its JSON text), returned as given (the Qwen templates write each one's JSON in its own key order). None or
    an empty list: no tools."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list of tool definitions, got {type(value).__name__}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"description\": ..., \"parameters\": {...}}}}}")
        if "parameters" in function and not isinstance(function["parameters"], (dict, type(None))):
            raise ValueError(f"{where}[{i}] ({function['name']}): parameters must be a JSON schema object")
    return list(value) or None
