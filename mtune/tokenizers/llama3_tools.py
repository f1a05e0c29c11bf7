"""The Llama 3.1 / 3.2 / 3.3 Instruct templates' format: their system turn, written for every conversation, and tool
calling as they render it (``apply_chat_template(messages, tools=...)``; Llama 3 itself has neither)::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n
    Cutting Knowledge Date: December 2023\\nToday Date: {date_string}\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{TOOLS_IN_USER_INTRO}{each tool's JSON}\\n\\n{user}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "get_weather", "parameters": {"city": "Paris"}}
    <|eot_id|>
    <|start_header_id|>ipython<|end_header_id|>\\n\\n{the result as a JSON string}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{reply}<|eot_id|>

The system turn (the date lines, then the system message's text if any) opens every conversation the templates
render, tools or not; the "Environment: ipython" line only when tools are given. :mod:`mtune.tokenizers.llama3` uses
these turns for every tool-calling conversation, and for the others when the checkpoint's template has the date lines
(its ``date_header`` setting). The tools go into the first user message (the templates'
``tools_in_user_message`` default; each tool's JSON indented by 4), or with ``tools_in_user_message=False`` into the
system turn after the date lines. The date is a setting (``date_string``, default "26 Jul 2024", the 3.1 / 3.3
templates' default), where Llama 3.2's template writes the day it runs. A tool result is written as ``tojson`` writes
its text (a JSON string, quotes and escapes included), as the templates do for any content. Refused, where the templates
would drop or misplace data: a message with several calls (the templates raise), a call message with text (the templates
write only the call), tools with no user message first after the system message (the templates would put that message's
text in the user turn). Llama 3.1's and 3.3's ``builtin_tools`` (brave_search, wolfram_alpha, code_interpreter, written
as ``<|python_tag|>`` calls ending with ``<|eom_id|>``) are not rendered: a call to one is written as any other call, as
the templates do when ``builtin_tools`` is not given. Trained: the calls and the replies with their ``<|eot_id|>``; the
system turn, the tool definitions and the ``ipython`` results are not.
"""

from __future__ import annotations

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.tools import tojson

# The templates' texts (Llama 3.1 / 3.2 / 3.3 Instruct; the three agree on these).
KNOWLEDGE_CUTOFF = "December 2023"
# What tells a Llama 3.1+ template from Llama 3's: the first of its date lines (Llama 3's template has none).
DATE_LINES_MARK = "Cutting Knowledge Date"
DEFAULT_DATE = "26 Jul 2024"  # the 3.1 / 3.3 templates' date_string default (3.2's writes the day it runs)
CALL_FORMAT = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
               'value}.Do not use variables.\n\n')
TOOLS_IN_USER_INTRO = ("Given the following functions, please respond with a JSON for a function call with its proper "
                       "arguments that best answers the given prompt.\n\n" + CALL_FORMAT)
TOOLS_IN_SYSTEM_INTRO = ("You have access to the following functions. To call a function, please respond with JSON "
                         "for a function call." + CALL_FORMAT)


def template_turns(messages: list[Message], tools: list[dict] | None, date_string: str,
                   tools_in_user_message: bool) -> list[tuple[str, str, bool]]:
    """The turns (role, body, trained) of a conversation, with tool calling or without, as the Llama 3.1+ templates
    write them: their system turn first (untrained), then the messages (``tools`` None: no tool definitions)."""
    start = 1 if messages[0].role == "system" else 0  # the index of the first message after the system's
    system = messages[0].content.strip() if start else ""
    head = "Environment: ipython\n" if tools is not None else ""
    head += f"{DATE_LINES_MARK}: {KNOWLEDGE_CUTOFF}\nToday Date: {date_string}\n\n"
    tool_text = "".join(tojson(tool, indent=4) + "\n\n" for tool in tools or ())
    if tools is not None and not tools_in_user_message:
        head += TOOLS_IN_SYSTEM_INTRO + tool_text
    turns = [("system", head + system, False)]
    if tools is not None and tools_in_user_message:
        if start == len(messages) or messages[start].role != "user":
            what = f"message {start} has role {messages[start].role!r}" if start < len(messages) else "none is"
            raise TokenizerError(f"llama3 chat format: the tools go into the first user message, which must come "
                                 f"first after the system message, but {what}; start the conversation with the "
                                 "user's message, or set tools_in_user_message=false")
        turns.append(("user", TOOLS_IN_USER_INTRO + tool_text + messages[start].content.strip(), False))
        start += 1
    for i in range(start, len(messages)):
        message = messages[i]
        if message.role == "tool":
            turns.append(("ipython", tojson(message.content), False))
        elif message.tool_calls:
            if len(message.tool_calls) > 1:
                raise TokenizerError(f"llama3 chat format: message {i} makes {len(message.tool_calls)} tool "
                                     "calls; the Llama 3.1+ templates take one call per assistant message (they "
                                     "raise on more): split them into a call, its result, the next call, ...")
            if message.content.strip():
                raise TokenizerError(f"llama3 chat format: message {i} has text beside its tool call, which the "
                                     "Llama 3.1+ templates do not write (they render the call alone); move the "
                                     "text into an assistant message of its own or drop it")
            call = message.tool_calls[0]
            turns.append(("assistant", f'{{"name": "{call.name}", "parameters": {tojson(call.arguments)}}}', True))
        else:
            turns.append((message.role, message.content.strip(), message.role == "assistant"))
    return turns
