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

What mtune does not take from the template: the date is a setting (``current_date``, default
:data:`DEFAULT_DATE`), not the day the data is tokenized (the template calls ``strftime_now``), so the same data gives
the same ids every day; the tools branches (``tools``, ``builtin_tools``, ``tool_calls``, the ``tool`` role) are not
rendered; a ``system`` message after the first is refused (the template drops it without a word).

Trained tokens: everything a reply's model generates after the ``<|start|>assistant`` that prompts it: the channel
headers, the reasoning, the content and the closing ``<|end|>`` / ``<|return|>`` (with reasoning, the
``<|start|>assistant`` between the analysis and the final message too).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from mtune.tokenizers.base import Message, TokenizerError
from mtune.tokenizers.tokenizer_json import TokenizerJson

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

    def _header(self, role: str) -> list[int]:
        """``<|start|>{role}<|message|>``."""
        return [self.start_id] + self.encode_text(role) + [self.message_id]

    def _channel(self, channel: str) -> list[int]:
        """``<|channel|>{channel}<|message|>``: what the model writes after ``<|start|>assistant``."""
        return [self.channel_id] + self.encode_text(channel) + [self.message_id]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trained: list[bool] = []

        def add(ids: list[int], train: bool) -> None:
            tokens.extend(ids)
            trained.extend([train] * len(ids))

        add(self._header("system") + self.encode_text(self.system_text()) + [self.end_id], False)
        first = 1 if messages[0].role == "system" else 0
        if first and messages[0].content:
            add(self._header("developer") + self.encode_text(f"# Instructions\n\n{messages[0].content}\n\n")
                + [self.end_id], False)
        for i in range(first, len(messages)):
            message = messages[i]
            if message.role == "system":
                raise TokenizerError(f"gpt_oss chat format: message {i} is a system message; only the first message "
                                     "may be one (it becomes the developer message)")
            if message.role == "user":
                add(self._header("user") + self.encode_text(message.content) + [self.end_id], False)
                continue
            for field, text in (("content", message.content), ("thinking", message.thinking or "")):
                if any(tag in text for tag in CHANNEL_TAGS):
                    raise TokenizerError(f"gpt_oss chat format: message {i}'s {field} holds harmony channel tags "
                                         "(<|channel|>...<|message|>); give the reasoning as thinking and the "
                                         "final answer as content, without tags")
            last = i == len(messages) - 1 and not add_generation_prompt
            add([self.start_id] + self.encode_text("assistant"), False)  # the prompt of the reply: not trained
            reply = []
            if last and message.thinking is not None:
                reply = (self._channel("analysis") + self.encode_text(message.thinking) + [self.end_id, self.start_id]
                         + self.encode_text("assistant"))
            reply += (self._channel("final") + self.encode_text(message.content)
                      + [self.return_id if last else self.end_id])
            add(reply, True)
        if add_generation_prompt:
            add([self.start_id] + self.encode_text("assistant"), False)
        return tokens, trained
