"""Llama 3 / 3.1 / 3.2 / 3.3 tokenizer: tiktoken over Meta's rank file, 256 special tokens after the base vocabulary.

Chat format of Llama 3 (its official template; message content is trimmed of surrounding whitespace, as the template
does)::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{user}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{reply}<|eot_id|>

The Llama 3.1 / 3.2 / 3.3 Instruct templates open every conversation with a system turn of their own,
``Cutting Knowledge Date: December 2023\\nToday Date: {date_string}\\n\\n{system}`` (the system message's text, if
any, after the date lines); mtune writes it when the checkpoint's chat template has those lines (``date_header``
"auto", see :func:`checkpoint_chat_template`) or when told to ("always"), and renders tool calling as those
templates do, that turn included: see :mod:`mtune.tokenizers.llama3_tools`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Sequence

from mtune.tokenizers.base import (Message, Tokenizer, TokenizerError, checkpoint_chat_template, model_dirs,
                                   read_json, uses_tool_calling)
from mtune.tokenizers.llama3_tools import DATE_LINES_MARK, DEFAULT_DATE, template_turns

# Meta's pre-tokenization regex for Llama 3 (numbers split into groups of up to three digits).
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
# date_header: whether conversations without tool calling get the Llama 3.1+ templates' system turn (the date lines).
DATE_HEADER_SETTINGS = ("auto", "always", "never")
# The official Jinja chat template of Llama 3 instruct models (their tokenizer_config.json, tool-calling branches
# left out), for model directories mtune writes (the tiny built-in model); transformers renders the same format.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Offsets from the base vocabulary size (128000 in the released models) of the tokens mtune gives a role; they are
# the same in every Llama 3 release.
_BEGIN_OF_TEXT, _END_OF_TEXT, _PAD, _START_HEADER, _END_HEADER, _EOM, _EOT, _PYTHON_TAG = 0, 1, 4, 6, 7, 8, 9, 10
# Tokens whose name a checkpoint must give at its offset for its names to be taken as a Llama 3 layout.
_REQUIRED = {_BEGIN_OF_TEXT: "<|begin_of_text|>", _END_OF_TEXT: "<|end_of_text|>",
             _START_HEADER: "<|start_header_id|>", _END_HEADER: "<|end_header_id|>", _EOT: "<|eot_id|>"}
# The generated names, in Llama 3.1's layout, for a rank file with no tokenizer.json / tokenizer_config.json beside
# it; the rest of the 256 slots are <|reserved_special_token_N|>. Other releases name some slots differently
# (Llama 3.2 calls +5 <|step_id|> and numbers the reserved tokens from 2 at +11), which is why a checkpoint's own
# names win whenever its files carry them.
_NAMED = {
    0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|reserved_special_token_0|>",
    3: "<|reserved_special_token_1|>", 4: "<|finetune_right_pad_id|>", 5: "<|reserved_special_token_2|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>",
}


def special_tokens(num_base: int) -> dict[str, int]:
    """The 256 generated Llama 3 special tokens (Llama 3.1's names) and their ids, placed right after ``num_base``
    base tokens. Used only when a checkpoint's files do not name them (see :func:`special_token_names`)."""
    names = dict(_NAMED)
    next_reserved = 3
    for offset in range(len(_NAMED), NUM_SPECIAL_TOKENS):
        names[offset] = f"<|reserved_special_token_{next_reserved}|>"
        next_reserved += 1
    return {name: num_base + offset for offset, name in names.items()}


def special_token_names(tokenizer_file: Path, num_base: int) -> tuple[dict[int, str], list[Path]]:
    """The names of the 256 special tokens (id -> name) and the files they were read from.

    Names come from the checkpoint: the ``added_tokens`` of its ``tokenizer.json``, then the
    ``added_tokens_decoder`` of its ``tokenizer_config.json`` for any id the first leaves out. Both are looked for
    beside ``tokenizer_file`` and, when that sits in ``original/``, in the model directory above it. Only where
    neither file exists (a bare rank file) or neither names an id are the generated names used (Llama 3.1's,
    :func:`special_tokens`). Ids outside the 256 slots after the base vocabulary are ignored.
    """
    folders = model_dirs(tokenizer_file)
    ids = range(num_base, num_base + NUM_SPECIAL_TOKENS)
    names: dict[int, str] = {}
    sources: list[Path] = []
    for model_dir in folders:
        for file, read in (("tokenizer.json", _added_tokens), ("tokenizer_config.json", _added_tokens_decoder)):
            path = model_dir / file
            if not path.is_file():
                continue
            found = {i: name for i, name in read(path).items() if i in ids and i not in names}
            if found:
                names.update(found)
                sources.append(path)
        if names:
            break
    for offset, name in _REQUIRED.items():
        if names and names.get(num_base + offset, name) != name:
            where = ", ".join(map(str, sources))
            raise TokenizerError(f"{where}: id {num_base + offset} is {names[num_base + offset]!r}, but a Llama 3 "
                                 f"tokenizer has {name} there; these names do not belong to {tokenizer_file}")
    taken = set(names.values())
    for name, i in special_tokens(num_base).items():
        if i not in names:
            names[i] = name if name not in taken else f"<|unnamed_special_token_{i - num_base}|>"
    return names, sources


def _added_tokens(path: Path) -> dict[int, str]:
    spec = read_json(path)
    return {int(t["id"]): t["content"] for t in spec.get("added_tokens") or []}


def _added_tokens_decoder(path: Path) -> dict[int, str]:
    config = read_json(path)
    return {int(i): t["content"] for i, t in (config.get("added_tokens_decoder") or {}).items()}


def is_tiktoken_file(path: Path) -> bool:
    """True when ``path`` looks like a tiktoken rank file (lines of ``<base64> <rank>``), not a sentencepiece model."""
    with open(path, "rb") as f:
        head = f.read(256)
    first = head.split(b"\n", 1)[0]
    parts = first.split(b" ")
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except ValueError:
        return False
    return True


def _ranks_from_tokenizer_json(path: Path) -> dict[bytes, int]:
    # Hugging Face's Llama 3 tokenizer.json is the same BPE with ids = tiktoken ranks, bytes spelled with GPT-2's
    # byte-to-printable-character table; undo that table to get the rank file back.
    from mtune.tokenizers.bpe_to_tiktoken import byte_level_alphabet

    char_to_byte = byte_level_alphabet()
    vocab = read_json(path)["model"]["vocab"]
    try:
        return {bytes(char_to_byte[c] for c in token): rank for token, rank in vocab.items()}
    except KeyError as err:
        raise TokenizerError(f"{path}: not a byte-level BPE tokenizer.json (character {err} has no byte)") from None


class Llama3Tokenizer(Tokenizer):
    """Llama 3 tokenizer from a tiktoken rank file (``original/tokenizer.model``) or, failing that, from the
    byte-level ``tokenizer.json`` of a Hugging Face Llama 3 repository (same ranks).

    ``bos_id`` = <|begin_of_text|>, ``eos_id`` = <|end_of_text|> (ends a document in ``encode``),
    ``pad_id`` = <|finetune_right_pad_id|>, ``end_of_turn_id`` = <|eot_id|>,
    ``stop_tokens`` = [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; these ids are fixed offsets after the base vocabulary.

    ``special`` maps the 256 special tokens' names to their ids. The names, which ``decode(...,
    skip_special_tokens=False)`` prints, are the checkpoint's own (its ``tokenizer.json`` / ``tokenizer_config.json``,
    listed in ``special_token_sources``); a bare rank file with neither beside it gets generated names in Llama 3.1's
    layout, which differ from other releases' (see :func:`special_token_names`).

    Chat-format settings (the module docstring; all part of the fingerprint): ``date_header``, whether a conversation
    without tool calling opens with the Llama 3.1+ templates' system turn: "auto" (default) when the checkpoint's chat
    template (:func:`checkpoint_chat_template`, its file in ``chat_template_source``) has its date lines, "always",
    "never" (Llama 3's format; a tool-calling conversation has that turn whatever the setting, as Llama 3 has no tool
    format); the outcome is ``dated_system_turn``. ``date_string``, the "Today Date" written in that turn (default
    :data:`DEFAULT_DATE`), and ``tools_in_user_message`` (default True: the tools go into the first user message, as
    the templates' default; False: into the system turn).
    """

    family = "llama3"
    reads_tools = True

    def __init__(self, path: str | Path, max_seq_len: int | None = None, date_string: str = DEFAULT_DATE,
                 tools_in_user_message: bool = True, date_header: str = "auto"):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(path)
        super().__init__([path], max_seq_len)
        ranks = _ranks_from_tokenizer_json(path) if path.suffix == ".json" else load_tiktoken_bpe(str(path))
        self.num_base_tokens = base = len(ranks)
        names, self.special_token_sources = special_token_names(path, base)
        self.special = {name: i for i, name in sorted(names.items())}
        self._enc = tiktoken.Encoding(name=f"mtune_llama3_{path.name}", pat_str=PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special)
        # Ids by position, the same in every Llama 3 release, whatever the checkpoint calls the slots.
        self.bos_id = base + _BEGIN_OF_TEXT
        self.eos_id = base + _END_OF_TEXT
        self.pad_id = base + _PAD
        self.start_header_id = base + _START_HEADER
        self.end_header_id = base + _END_HEADER
        self.eot_id = self.end_of_turn_id = base + _EOT
        self.eom_id = base + _EOM
        self.python_tag_id = base + _PYTHON_TAG
        self.stop_tokens = [self.eos_id, self.eom_id, self.eot_id]
        self.vocab_size = self.num_base_tokens + NUM_SPECIAL_TOKENS
        if not isinstance(date_string, str) or not date_string:
            raise TokenizerError(f"llama3 tokenizer: date_string must be non-empty text such as {DEFAULT_DATE!r}, got "
                                 f"{date_string!r}")
        if not isinstance(tools_in_user_message, bool):
            raise TokenizerError(f"llama3 tokenizer: tools_in_user_message must be true or false, got "
                                 f"{tools_in_user_message!r}")
        if date_header not in DATE_HEADER_SETTINGS:
            raise TokenizerError(f"llama3 tokenizer: date_header must be one of {', '.join(DATE_HEADER_SETTINGS)}, got "
                                 f"{date_header!r}")
        self.date_string = date_string
        self.tools_in_user_message = tools_in_user_message
        self.date_header = date_header
        template, self.chat_template_source = checkpoint_chat_template(path)
        self.dated_system_turn = date_header == "always" or (
            date_header == "auto" and template is not None and DATE_LINES_MARK in template)

    def _fingerprint_extra(self) -> str:
        # date_header by its outcome, which sets the ids: "auto" reads a file the fingerprint does not hash, and
        # "always" on a 3.1 checkpoint gives the ids "auto" does.
        return (f"date_string={self.date_string} tools_in_user_message={self.tools_in_user_message} "
                f"dated_system_turn={self.dated_system_turn}")

    def encode_text(self, text: str) -> list[int]:
        # disallowed_special=() : text that spells a special token is encoded as text, never as the token.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._enc.decode([i for i in ids if i < self.num_base_tokens])
        return self._enc.decode(ids)

    def _header(self, role: str) -> list[int]:
        return [self.start_header_id, *self.encode_text(role), self.end_header_id, *self.encode_text("\n\n")]

    def _turn(self, role: str, body: str, trained: bool) -> tuple[list[int], list[bool]]:
        """``<|start_header_id|>{role}<|end_header_id|>\\n\\n{body}<|eot_id|>``, the body and its end trained or not.
        The header's ``\\n\\n`` is encoded apart from the body: the pre-tokenizer always ends a piece there, since
        every body the templates write starts with a non-space (contents are trimmed, results JSON-quoted)."""
        header = self._header(role)
        body_ids = self.encode_text(body) + [self.eot_id]
        return header + body_ids, [False] * len(header) + [trained] * len(body_ids)

    def _render(self, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        if uses_tool_calling(messages, tools) or self.dated_system_turn:
            turns = template_turns(messages, tools, self.date_string, self.tools_in_user_message)
        else:
            turns = [(m.role, m.content.strip(), m.role == "assistant") for m in messages]
        tokens, trained = [self.bos_id], [False]
        for role, body, is_trained in turns:
            ids, flags = self._turn(role, body, is_trained)
            tokens += ids
            trained += flags
        if add_generation_prompt:
            header = self._header("assistant")
            tokens += header
            trained += [False] * len(header)
        return tokens, trained
