"""What every mtune tokenizer shares: messages, the tokenized conversation, truncation and the fingerprint.

A family module (``llama3``, ``llama2``, ``mistral``, ``qwen2``) subclasses :class:`Tokenizer` and supplies three
things: ``encode_text`` (plain text to ids, never producing a control token), ``decode`` and ``_render`` (a
conversation in the family's chat format, as (ids, trained) segments). Nothing here imports a tokenizer library.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mtune.errors import MtuneError
from mtune.tokenizers.tools import ToolCall, parse_tool_calls, parse_tools

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("thinking", "reasoning_content")  # the names chat data gives a reply's reasoning under


class TokenizerError(MtuneError, ValueError):
    """A tokenizer file that is not what its model directory or family needs; the message names the file."""


@dataclass(frozen=True)
class Message:
    """One turn of a conversation. ``role`` is "system", "user", "assistant" or "tool"; ``content`` is plain text
    (any control-token spelling inside it, e.g. ``<|eot_id|>``, is encoded as ordinary text; an assistant message
    that only calls tools may give None, read as ""). ``thinking``: an assistant reply's reasoning given apart from
    its content, None when it has none. The templates name that field differently, gpt-oss's ``thinking``, Qwen3's
    and Qwen3.5's ``reasoning_content`` (:meth:`from_dict` reads either name); each family renders it where its
    template does, and the families whose template has no such field refuse it (``Tokenizer.reads_thinking``).

    Tool calling (rendered by the families whose ``reads_tools`` is true, see :mod:`mtune.tokenizers.tools`):
    ``tool_calls``, an assistant message's calls (``ToolCall`` objects, or their OpenAI / Hugging Face dicts, arguments
    as a dict or its JSON text); a ``tool`` message's ``content`` is a call's result, ``name`` the tool's name and
    ``tool_call_id`` the call it answers (both optional, as the templates read them)."""

    role: str
    content: str | None
    thinking: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not supported; use one of {', '.join(ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"message tool_calls are only read on assistant messages, got them on a {self.role} "
                             "message")
        object.__setattr__(self, "tool_calls", parse_tool_calls(self.tool_calls or None, f"{self.role} message"))
        if self.content is None and self.tool_calls:
            object.__setattr__(self, "content", "")
        if not isinstance(self.content, str):
            raise TypeError(f"message content must be a str, got {type(self.content).__name__} (role {self.role})")
        if self.thinking is not None and (self.role != "assistant" or not isinstance(self.thinking, str)):
            raise ValueError(f"message thinking must be text on an assistant message, got "
                             f"{type(self.thinking).__name__} on a {self.role} message")
        for field in ("name", "tool_call_id"):
            if not isinstance(getattr(self, field), (str, type(None))):
                raise ValueError(f"message {field} must be text, got {type(getattr(self, field)).__name__}")

    @classmethod
    def from_dict(cls, message: dict) -> "Message":
        """A message in the OpenAI / Hugging Face dict form. Its reasoning may be under ``thinking`` (gpt-oss's
        data) or ``reasoning_content`` (Qwen's templates, OpenAI-compatible servers); a null one is absent, and a
        message giving both is refused rather than one of them dropped."""
        fields = dict(message)
        given = [key for key in REASONING_FIELDS if fields.get(key) is not None]
        if len(given) > 1:
            raise ValueError(f"{fields.get('role')} message has both {' and '.join(given)}; give its reasoning in "
                             "one of them")
        for key in REASONING_FIELDS:
            fields.pop(key, None)
        if given:
            if not isinstance(message[given[0]], str):
                raise ValueError(f"{given[0]} must be text, got {type(message[given[0]]).__name__}")
            fields["thinking"] = message[given[0]]
        return cls(**fields)


@dataclass
class TokenizedConversation:
    """``tokens``: the conversation's token ids. ``trained[i]``: whether token i belongs to an assistant reply (its
    end-of-turn token included) and so gets a label. ``truncated``: the conversation was cut to ``max_seq_len``."""

    tokens: list[int]
    trained: list[bool]
    truncated: bool


@dataclass
class TokenizedText:
    """``tokens`` of a plain text and whether they were cut to ``max_seq_len``."""

    tokens: list[int]
    truncated: bool


class Tokenizer:
    """Base of the family tokenizers. Attributes every family sets:

    - ``bos_id`` (None where the family has no begin-of-sequence token: Qwen2), ``eos_id``, ``pad_id``;
    - ``vocab_size``: ids run from 0 to ``vocab_size - 1``, special tokens included;
    - ``stop_tokens``: ids that end generation (end of text and end of turn);
    - ``end_of_turn_id``: the token closing a chat turn, kept when a conversation is truncated;
    - ``max_seq_len``: default length limit for ``encode`` and ``tokenize_messages`` (None: no limit).
    """

    family: str = ""
    reads_thinking = False  # whether the template has a reasoning field, rendered from Message.thinking
    reads_tools = False  # whether it renders tool calling: tools, Message.tool_calls and tool messages
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int
    stop_tokens: list[int]
    end_of_turn_id: int

    def __init__(self, files: Sequence[str | Path], max_seq_len: int | None = None):
        self.files = [Path(f) for f in files]
        self.max_seq_len = max_seq_len

    # ------------------------------------------------------------------ to implement in each family
    def encode_text(self, text: str) -> list[int]:
        """``text`` as ids, no BOS/EOS; control-token spellings stay text."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        """The conversation's ids and trained flags. A family whose ``reads_tools`` is true also takes
        ``tools=`` (a list of tool definitions, or None)."""
        raise NotImplementedError

    def _fingerprint_extra(self) -> str:
        """Settings beyond the files that change the ids (e.g. a default system prompt)."""
        return ""

    # ------------------------------------------------------------------ shared behaviour
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS / EOS when asked (no BOS for families without one), cut to
        ``max_seq_len`` when the tokenizer has one (EOS kept as the last token)."""
        return self.encode_with_truncation(text, add_bos=add_bos, add_eos=add_eos).tokens

    def encode_with_truncation(self, text: str, add_bos: bool = True, add_eos: bool = True,
                               max_seq_len: int | None = None) -> TokenizedText:
        """Like ``encode`` and also says whether the text was cut. ``max_seq_len`` defaults to the tokenizer's."""
        ids = self.encode_text(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos:
            ids = ids + [self.eos_id]
        limit = max_seq_len if max_seq_len is not None else self.max_seq_len
        if limit is None or len(ids) <= limit:
            return TokenizedText(ids, False)
        cut = ids[: limit - 1] + [self.eos_id] if add_eos else ids[:limit]
        return TokenizedText(cut, True)

    def tokenize_messages(self, messages: Sequence[Message], max_seq_len: int | None = None,
                          add_generation_prompt: bool = False, tools: Any = None) -> TokenizedConversation:
        """Render ``messages`` in the family's chat format, as its official chat template does.

        Only assistant replies (their end-of-turn token included) are marked trained. With ``max_seq_len`` (default:
        the tokenizer's) a longer conversation is cut and its last token replaced by the end-of-turn token, which is
        trained when the cut fell inside an assistant reply. ``add_generation_prompt`` appends the assistant header
        where the family has one (Llama 3, Qwen2), for generation. ``tools``: the tool definitions the conversation
        offers (OpenAI format, see :mod:`mtune.tokenizers.tools`), for the families that render tool calling; the
        others refuse a conversation with tools, tool calls or tool messages.
        """
        messages = [m if isinstance(m, Message) else Message.from_dict(m) for m in messages]
        if not messages:
            raise ValueError("tokenize_messages got an empty conversation; give at least one message")
        if not self.reads_thinking and any(m.thinking is not None for m in messages):
            raise TokenizerError(f"{self.family} chat format: a message has reasoning (thinking / reasoning_content), "
                                 "which this family's chat template has no field for (gpt-oss, Qwen3 and Qwen3.5 "
                                 "render it); put it in the content or drop the field")
        tools = parse_tools(tools)
        if uses_tool_calling(messages, tools):
            if not self.reads_tools:
                raise TokenizerError(f"{self.family} chat format: the conversation uses tool calling (tools, "
                                     "tool_calls or tool messages), which mtune renders only for Llama 3.1+, gpt-oss, "
                                     "Qwen3 and Qwen3.5; drop these rows or fine-tune one of those families")
            tokens, trained = self._render(messages, add_generation_prompt, tools=tools)
        else:
            tokens, trained = self._render(messages, add_generation_prompt)
        limit = max_seq_len if max_seq_len is not None else self.max_seq_len
        if limit is None or len(tokens) <= limit:
            return TokenizedConversation(tokens, trained, False)
        if limit < 2:
            raise ValueError(f"max_seq_len={limit} is too short to hold a conversation; use at least 2")
        tokens = tokens[: limit - 1] + [self.end_of_turn_id]
        trained = trained[: limit - 1] + [trained[limit - 1]]
        return TokenizedConversation(tokens, trained, True)

    def fingerprint(self) -> str:
        """A stable hash of the tokenizer's class, files and settings: equal fingerprints give equal ids (the
        data cache keys on it). ``max_seq_len`` is not part of it."""
        digest = hashlib.sha256(f"{type(self).__module__}.{type(self).__qualname__}\n".encode())
        for path in self.files:
            digest.update(path.name.encode() + b"\n")
            digest.update(path.read_bytes())
        digest.update(self._fingerprint_extra().encode())
        return digest.hexdigest()[:32]

    def __repr__(self) -> str:
        files = ", ".join(str(f) for f in self.files)
        return f"{type(self).__name__}(files=[{files}], vocab_size={self.vocab_size}, max_seq_len={self.max_seq_len})"


def check_alternating(messages: list[Message], family: str) -> tuple[str | None, list[Message]]:
    """Split off a leading system message and check the rest alternates user/assistant, starting with user (the
    rule of the Llama 2 and Mistral templates). Returns (system text or None, the other messages)."""
    system = messages[0].content if messages[0].role == "system" else None
    turns = messages[1:] if system is not None else messages
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.role != expected:
            raise ValueError(
                f"{family} chat format: message {i + (system is not None)} has role {message.role!r} but "
                f"{expected!r} was expected; after an optional first system message, roles must alternate "
                "user/assistant starting with user"
            )
    if not turns:
        raise ValueError(f"{family} chat format: a conversation needs at least one user message")
    return system, turns


def uses_tool_calling(messages: Sequence[Message], tools: list[dict] | None) -> bool:
    """Whether a conversation calls tools: definitions offered, a message with tool calls, or a tool's result."""
    return bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)


def model_dirs(tokenizer_file: Path) -> list[Path]:
    """Where a checkpoint's tokenizer_config.json and friends are looked for: beside ``tokenizer_file`` and, when that
    sits in ``original/`` (Meta's rank file), in the model directory above it."""
    folder = tokenizer_file.parent
    return [folder, folder.parent] if folder.name == "original" else [folder]


def checkpoint_chat_template(tokenizer_file: Path) -> tuple[str | None, Path | None]:
    """The checkpoint's chat template and the file it was read from, or (None, None) when it has none.

    Read as transformers reads it: ``chat_template.jinja`` wins over the ``chat_template`` of
    ``tokenizer_config.json`` (the default one, when that is a list of named templates); both looked for beside
    ``tokenizer_file`` and, from ``original/``, in the model directory above it (the nearer folder first).
    """
    for model_dir in model_dirs(tokenizer_file):
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8"), jinja
        config_path = model_dir / "tokenizer_config.json"
        template = config_chat_template(config_path) if config_path.is_file() else None
        if template:
            return template, config_path
    return None, None


def config_chat_template(config_path: Path) -> str | None:
    """The ``chat_template`` of a checkpoint's ``tokenizer_config.json`` (the default one, where it is a list of named
    templates), or None when the file has none."""
    template = read_json(config_path).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template or None


def read_json(path: Path) -> Any:
    """A tokenizer's JSON file (a dict); one that is not (cut short, a Git LFS pointer) is a TokenizerError naming it."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: {not_the_file(path) or f'not valid JSON ({e})'}") from None
    if not isinstance(spec, dict):
        raise TokenizerError(f"{path}: not valid JSON for this file (a {type(spec).__name__}, not an object)")
    return spec


def not_the_file(path: Path) -> str:
    """What a tokenizer file that a library cannot read is, when its first bytes tell (a Git LFS pointer), else ""."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs.github.com/spec/"):
        return "a Git LFS pointer, not the file itself: fetch it (git lfs pull in the clone, or mtune download)"
    return ""
