"""gpt-oss tokenizer: the checkpoint's own ``tokenizer.json`` (o200k_harmony, read with the `tokenizers` library) and
the harmony chat format as gpt-oss's chat template (``chat_template.jinja`` of ``openai/gpt-oss-*``) renders it::

    <|start|>system<|message|>{identity}\\nKnowledge cutoff: 2024-06\\nCurrent date: {date}\\n\\nReasoning: {effort}
    \\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system}\\n\\n<|end|>
    <|start|>user<|message|>{user}<|end|>
    <|start|>assistant<|channel|>final<|message|>{earlier reply}<|end|>
    <|start|>user<|message|>{user}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{thinking}<|end|>
    <|start|>assistant<|channel|>final<|message|>{last reply}<|return|>

(one line here per message; the template writes no newlines between them). The system message is always there; a
conversation's own first ``system`` message becomes the developer message (none when it is absent or empty). Only
the conversation's last reply ends with ``<|return|>`` and keeps its reasoning (``Message.thinking``, the template's
``thinking`` field, on the analysis channel); earlier replies end with ``<|end|>`` and lose theirs, and with
``add_generation_prompt`` every reply is an earlier one and ``<|start|>assistant`` follows.

Tool calling, as the template renders it: the ``tools`` become a ``# Tools`` section of the developer message (the
TypeScript-like ``namespace functions`` of :mod:`mtune.tokenizers.gpt_oss_tools`) and the system message gains
"Calls to these tools must go to the commentary channel: 'functions'."; an assistant message's tool call is::

    <|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments as JSON}<|call|>

(the official template writes ``commentary json`` as text; the harmony library's ``<|constrain|>json`` token is not
what the template, and so transformers, produces), after an analysis message with the message's content or thinking
when no final answer follows later in the conversation. A ``tool`` message, the result of the latest call, is
``<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{content as a JSON string}<|end|>``. Harmony
has one call per message: a message with several calls is refused (the template renders only the first), and so are
a tool message with no call before it and one whose ``name`` is not that call's. Arguments given as JSON text are
written as their object (the template would write the text as a JSON string).

What mtune does not take from the template: the date is a setting (``current_date``, default
:data:`DEFAULT_DATE`), not the day the data is tokenized (the template calls ``strftime_now``), so the same data gives
the same ids every day; ``builtin_tools`` (browser, python) are not rendered; a ``system`` message after the first is
refused (the template drops it without a word).

Trained tokens: everything a reply's model generates after the ``<|start|>assistant`` that prompts it: the channel
headers, the reasoning, the content, a tool call (`` to=functions...`` to ``<|call|>``) and the closing ``<|end|>`` /
``<|return|>`` / ``<|call|>`` (with reasoning, the ``<|start|>assistant`` between the analysis and the next message
too). Tool definitions and tool results are not trained.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.chat_builder import ChatBuilder
from mtune.tokenizers.gpt_oss_tools import tool_namespace
from mtune.tokenizers.tokenizer_json import TokenizerJson
from mtune.tokenizers.tools import tojson

# The harmony control tokens gpt-oss's chat format uses (o200k_harmony: ids 199998-200012 in the hub's file; mtune
# reads each id from the file's added tokens).
HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
DEFAULT_DATE = "2025-08-05"  # gpt-oss's release day
REASONING_EFFORTS = ("low", "medium", "high")
# A reply written in harmony itself: the template refuses these in content and thinking, and so does mtune.
CHANNEL_TAGS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")
TOOLS_SYSTEM_NOTE = "\nCalls to these tools must go to the commentary channel: 'functions'."


class GptOssTokenizer(TokenizerJson):
    """gpt-oss ``tokenizer.json``. ``bos_id`` is None: the family's ``<|startoftext|>`` (``startoftext_id``) is
    added neither by the file's post-processor nor by the chat template, so ``encode`` adds none, as transformers
    does. ``eos_id`` = ``pad_id`` = <|endoftext|>; ``end_of_turn_id`` = <|return|> (what closes a conversation's
    last reply, and so a cut one); ``stop_tokens`` = [<|return|>, <|call|>, <|endoftext|>], the checkpoint's
    generation_config eos ids (``<|end|>`` is not one: a reasoning message ends with it and the reply goes on).

    Settings, all part of the fingerprint: ``current_date`` (``YYYY-MM-DD``, default :data:`DEFAULT_DATE`),
    ``reasoning_effort`` (low | medium | high, default medium), ``model_identity`` (the system message's first line).
    """

    family = "gpt_oss"
    control_tokens = HARMONY_TOKENS
    description = "gpt-oss (harmony)"
    reads_thinking = True
    reads_tools = True

    def __init__(self, path: str | Path, max_seq_len: int | None = None, current_date: str = DEFAULT_DATE,
                 reasoning_effort: str = "medium", model_identity: str = MODEL_IDENTITY):
        super().__init__(path, max_seq_len)
        try:
            valid_date = len(current_date) == 10 and datetime.date.fromisoformat(current_date) is not None
        except (TypeError, ValueError):
            valid_date = False
        if not valid_date:
            raise TokenizerError(f"gpt_oss tokenizer: current_date={current_date!r} is not a YYYY-MM-DD date")
        if reasoning_effort not in REASONING_EFFORTS:
            raise TokenizerError(f"gpt_oss tokenizer: reasoning_effort={reasoning_effort!r} is not one of "
                                 f"{', '.join(REASONING_EFFORTS)}")
        if not isinstance(model_identity, str) or not model_identity:
            raise TokenizerError(f"gpt_oss tokenizer: model_identity={model_identity!r} must be non-empty text")
        self.current_date, self.reasoning_effort, self.model_identity = current_date, reasoning_effort, model_identity
        ids = self.control_ids
        self.bos_id = None
        self.startoftext_id = ids["<|startoftext|>"]
        self.eos_id = self.pad_id = ids["<|endoftext|>"]
        self.start_id, self.message_id, self.channel_id = ids["<|start|>"], ids["<|message|>"], ids["<|channel|>"]
        self.end_id, self.return_id, self.call_id = ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]
        self.end_of_turn_id = self.return_id
        self.stop_tokens = [self.return_id, self.call_id, self.eos_id]

    def _fingerprint_extra(self) -> str:
        return (f"current_date={self.current_date} reasoning_effort={self.reasoning_effort} "
                f"model_identity={self.model_identity!r}")

    def system_text(self) -> str:
        """The text of the system message the template puts before every conversation."""
        return (f"{self.model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {self.current_date}\n\n"
                f"Reasoning: {self.reasoning_effort}\n\n# Valid channels: analysis, commentary, final. Channel must "
                "be included for every message.")

    def _render(self, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        out = ChatBuilder(self)

        def header(role: str) -> None:  # <|start|>{role}<|message|>
            out.token(self.start_id), out.text(role), out.token(self.message_id)

        def channel(name: str) -> None:  # <|channel|>{name}<|message|>: written by the model, so trained
            out.token(self.channel_id, True), out.text(name, True), out.token(self.message_id, True)

        header("system")
        out.text(self.system_text() + (TOOLS_SYSTEM_NOTE if tools else ""))
        out.token(self.end_id)
        first = 1 if messages[0].role == "system" else 0
        if (first and messages[0].content) or tools:
            header("developer")
            if first and messages[0].content:
                out.text(f"# Instructions\n\n{messages[0].content}\n\n")
            if tools:
                out.text("# Tools\n\n" + tool_namespace(tools))
            out.token(self.end_id)
        last_call = None  # the name of the latest tool call: a tool message answers it
        for i in range(first, len(messages)):
            message = messages[i]
            if message.role == "system":
                raise TokenizerError(f"gpt_oss chat format: message {i} is a system message; only the first message "
                                     "may be one (it becomes the developer message)")
            if message.role == "user":
                header("user"), out.text(message.content), out.token(self.end_id)
                continue
            if message.role == "tool":
                if last_call is None:
                    raise TokenizerError(f"gpt_oss chat format: message {i} is a tool message, but no assistant "
                                         "message before it calls a tool")
                if message.name is not None and message.name != last_call:
                    raise TokenizerError(f"gpt_oss chat format: message {i} is the result of tool {message.name!r}, "
                                         f"but the call before it is to {last_call!r}")
                out.token(self.start_id), out.text(f"functions.{last_call} to=assistant")
                out.token(self.channel_id), out.text("commentary"), out.token(self.message_id)
                out.text(tojson(message.content)), out.token(self.end_id)
                continue
            for field, text in (("content", message.content), ("thinking", message.thinking or "")):
                if any(tag in text for tag in CHANNEL_TAGS):
                    raise TokenizerError(f"gpt_oss chat format: message {i}'s {field} holds harmony channel tags "
                                         "(<|channel|>...<|message|>); give the reasoning as thinking and the "
                                         "final answer as content, without tags")
            out.token(self.start_id), out.text("assistant")  # the prompt of the reply: not trained
            if message.tool_calls:
                last_call = self._tool_call(out, channel, messages, i)
                continue
            last = i == len(messages) - 1 and not add_generation_prompt
            if last and message.thinking is not None:
                channel("analysis"), out.text(message.thinking, True)
                out.token(self.end_id, True), out.token(self.start_id, True), out.text("assistant", True)
            channel("final"), out.text(message.content, True)
            out.token(self.return_id if last else self.end_id, True)
            if not last:
                last_call = None
        if add_generation_prompt:
            out.token(self.start_id), out.text("assistant")
        return out.result()

    def _tool_call(self, out: ChatBuilder, channel, messages: list[Message], i: int) -> str:
        """Message ``i``'s tool call, after its ``<|start|>assistant``: an analysis message first when the message
        has content or thinking and no final answer follows later (the template drops it otherwise), then
        `` to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>``. Returns the tool's name."""
        message = messages[i]
        if len(message.tool_calls) > 1:
            raise TokenizerError(f"gpt_oss chat format: message {i} makes {len(message.tool_calls)} tool calls; "
                                 "harmony has one call per assistant message (the template renders only the first): "
                                 "give each call its own assistant message, followed by its tool message")
        if message.content and message.thinking:
            raise TokenizerError(f"gpt_oss chat format: message {i} calls a tool and has both content and thinking; "
                                 "give its reasoning in one of them (both become its analysis message)")
        answered = any(m.role == "assistant" and not m.tool_calls for m in messages[i + 1:])
        analysis = message.content or message.thinking
        if analysis and not answered:
            channel("analysis"), out.text(analysis, True)
            out.token(self.end_id, True), out.token(self.start_id, True), out.text("assistant", True)
        call = message.tool_calls[0]
        out.text(f" to=functions.{call.name}", True)
        channel("commentary json")
        out.text(tojson(call.arguments), True), out.token(self.call_id, True)
        return call.name
