"""Tool calling in Qwen3's and Qwen3.5's chat templates: the tools block of the system message, an assistant
message's calls and the tool results.

Both put the tools' JSON definitions, one a line, in ``<tools>...</tools>`` at the start of the system message
(before the conversation's own system text) with instructions around them, and group consecutive tool results into
one user turn, each as ``\\n<tool_response>\\n{result}\\n</tool_response>``. They differ in how a call is written::

    Qwen3:   <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    Qwen3.5: <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>

(Qwen3.5 writes a string or number argument as Python text, a list or an object as JSON). Calls follow the reply's
text in the same assistant turn and are trained with it. ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` are tokens of the checkpoints' ``tokenizer.json``: the template's own tags become those ids
(:meth:`Qwen3Tokenizer._tagged`), while the same spelling inside a message stays text, as for every control token.
"""

from __future__ import annotations

from mtune.tokenizers.chat_builder import ChatBuilder
from mtune.tokenizers.tools import ToolCall, tojson

TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

QWEN3_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                    "with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN3_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>")
QWEN3_5_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN3_5_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>")


def tools_text(head: str, tools: list[dict], tail: str) -> str:
    """The tools block: ``head``, each tool's JSON on a line of its own, ``tail``."""
    return head + "".join("\n" + tojson(tool) for tool in tools) + tail


def qwen3_calls(tokenizer, out: ChatBuilder, calls: tuple[ToolCall, ...], after_text: bool) -> None:
    """Qwen3's calls, trained: each ``<tool_call>`` JSON block on a new line (the first only after text). Arguments
    given as JSON text are written verbatim, as the template does; a dict is written as JSON."""
    for i, call in enumerate(calls):
        if i or after_text:
            out.text("\n", True)
        arguments = call.arguments_text if call.arguments_text is not None else tojson(call.arguments)
        tokenizer._tagged(out, f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>',
                          True)


def _parameter_value(value) -> str:
    """Qwen3.5's text of one argument: JSON for a list or an object, Python's ``str`` otherwise (Jinja's
    ``string`` filter: ``True``, ``None``, ``2.5``)."""
    return tojson(value) if isinstance(value, (dict, list, tuple)) else str(value)


def qwen3_5_calls(tokenizer, out: ChatBuilder, calls: tuple[ToolCall, ...], after_text: bool) -> None:
    """Qwen3.5's calls, trained: the first after a blank line when text comes before it, the others on a new line,
    each ``<function=...>`` with one ``<parameter=...>`` block per argument. Arguments given as JSON text are
    parsed and written like a dict (the template itself raises on text: it iterates ``arguments|items``)."""
    for i, call in enumerate(calls):
        prefix = "\n" if i else ("\n\n" if after_text else "")
        body = "".join(f"<parameter={name}>\n{_parameter_value(value)}\n</parameter>\n"
                       for name, value in call.arguments.items())
        tokenizer._tagged(out, f"{prefix}<tool_call>\n<function={call.name}>\n{body}</function>\n</tool_call>",
                          True)


def tool_results(tokenizer, out: ChatBuilder, messages, i: int, content: str, opens: bool) -> None:
    """Tool message ``i`` (its ``content`` as the template writes it), not trained: ``<|im_start|>user`` when
    ``opens``, its ``<tool_response>`` block, and ``<|im_end|>\\n`` when no tool message follows."""
    if opens:
        out.token(tokenizer.im_start_id), out.text("user")
    tokenizer._tagged(out, "\n<tool_response>\n")
    out.text(content)
    tokenizer._tagged(out, "\n</tool_response>")
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
        out.token(tokenizer.im_end_id), out.text("\n")
