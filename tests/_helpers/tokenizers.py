"""Tiny tokenizers for tests, trained on the spot with the real libraries' trainers.

Each ``write_*`` function writes a model directory the way it looks on the Hugging Face Hub (tokenizer files,
``config.json``, ``tokenizer_config.json`` with the family's official chat template) and returns the vocabulary size
so a tiny model built beside it can match. Files are cached per process: training takes ~0.1-0.5 s each.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from mtune.tokenizers.bpe_to_tiktoken import train_byte_level_bpe, write_tiktoken_file
from mtune.tokenizers.llama3 import CHAT_TEMPLATE as LLAMA3_CHAT_TEMPLATE

# The official chat templates, written out from the model cards' tokenizer_config.json, tool-calling branches left
# out where mtune renders system/user/assistant turns only. Llama 3's is mtune.tokenizers.llama3.CHAT_TEMPLATE,
# which the tiny built-in model's files carry too. The families that render tool calling (gpt-oss, Qwen3, Qwen3.5,
# Llama 3.1+) have their full templates in tests/assets/chat_templates/ (gpt-oss's tiny files always; Qwen's through
# write_qwen_tools_tokenizer; Llama 3.1's and 3.2's through write_llama3_tokenizer's chat_template).
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

MISTRAL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace() %}{%- set ns.index = 0 %}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endfor %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token}}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}{%- endif %}{%- endfor %}"
)

QWEN2_5_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's (Qwen/Qwen3-8B tokenizer_config.json), its tool-calling branches left out (full: qwen3.jinja of the assets).
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Qwen3.5's (Qwen/Qwen3.5-27B tokenizer_config.json; Qwen3.5-4B's is the same, see the assets' README.md), its image /
# video content and tool-calling branches left out as above; what is kept is the template's text verbatim.
QWEN3_5_CHAT_TEMPLATE = (
    "{%- macro render_content(content, do_vision_count, is_system_content=false) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is none or content is undefined %}{{- '' }}"
    "{%- else %}{{- raise_exception('Unexpected content type.') }}{%- endif %}{%- endmacro %}"
    "{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set content = render_content(messages[0].content, false, true)|trim %}"
    "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set content = render_content(message.content, false)|trim %}"
    "{%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}"
    "{%- for message in messages %}{%- set content = render_content(message.content, true)|trim %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- set reasoning_content = reasoning_content|trim %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('Unexpected message role.') }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)

# Phi-4's (microsoft/phi-4 tokenizer_config.json since its January 2025 update: each turn its own header and
# add_generation_prompt honoured).
PHI4_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)
# Phi-4's first release: each user turn opens the assistant's header itself (no add_generation_prompt branch).
PHI4_FIRST_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|><|im_start|>assistant<|im_sep|>'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
)

# Phi-4-mini-instruct's (microsoft/Phi-4-mini-instruct tokenizer_config.json), its tools branch left out.
PHI4_MINI_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

# Gemma 3's (google/gemma-3-1b-it tokenizer_config.json), its image-content branch left out.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)

# Gemma 4's (google/gemma-4-*-it chat_template.jinja), its text branches: a system turn of its own, earlier replies'
# thought blocks dropped (its strip_thinking macro) and trimmed; tools, thinking and media left out.
GEMMA4_CHAT_TEMPLATE = (
    "{%- macro strip_thinking(text) -%}{%- set ns = namespace(result='') -%}"
    "{%- for part in text.split('<channel|>') -%}{%- if '<|channel>' in part -%}"
    "{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}{%- else -%}"
    "{%- set ns.result = ns.result + part -%}{%- endif -%}{%- endfor -%}{{- ns.result | trim -}}{%- endmacro -%}"
    "{%- set loop_messages = messages -%}{{ bos_token }}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\n' -}}{{- messages[0]['content'] | trim -}}{{- '<turn|>\n' -}}"
    "{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\n' }}"
    "{%- if role == 'model' -%}{{- strip_thinking(message['content']) -}}"
    "{%- else -%}{{- message['content'] | trim -}}{%- endif -%}{{- '<turn|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}"
)

# gpt-oss's (openai/gpt-oss-120b and -20b chat_template.jinja), verbatim as vendored unchanged by llama.cpp in
# models/templates/openai-gpt-oss-120b.jinja: tests/assets/chat_templates/gpt_oss.jinja, tools macros included.
GPT_OSS_CHAT_TEMPLATE = (Path(__file__).parents[1] / "assets" / "chat_templates" / "gpt_oss.jinja").read_text()

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)

FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "qwen3_5", "phi4", "phi4_mini", "gemma3", "gemma4",
            "gpt_oss")

_WORDS = (
    "the model learns to follow instructions and answers questions about data training tokens memory "
    "hardware fine tune recipe llama mistral qwen adapter rank weight gradient batch sequence chat user "
    "assistant system hello world café naïve über 東京 数据 emoji 🙂 don't it's we're I'll they've"
).split()


# Conversations rendered by every family. Texts avoid control-token spellings (Hugging Face turns those into
# control tokens; mtune deliberately does not, tested separately) and use the whitespace the templates normalise.
CONVERSATIONS = {
    "single": [("user", "hello world, what is 12345 + 6?"), ("assistant", "It's 12351.")],
    "system": [("system", "Be brief and exact."), ("user", "Name a café in 東京."),
               ("assistant", "  Über café 🙂  "), ("user", "another one\nplease"),
               ("assistant", "naïve data\n\nmemory")],
    "multi": [("user", " we're  fine tuning a llama "), ("assistant", "The model learns."),
              ("user", "don't stop"), ("assistant", "I'll go on:\n- rank 8\n- batch 4")],
}


def corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic mixed text: words, numbers, punctuation, non-ASCII, brackets like chat markup."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(rng.choice(["[INST]", "<|eot_id|>", "<|im_end|>", "<s>", "(x)", "{y}", "a+b=c", "..."]))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ""]))
    return lines


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False))


# ---------------------------------------------------------------------------------------------------- sentencepiece


@lru_cache(maxsize=None)
def _sentencepiece_model(variant: str) -> bytes:
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    control = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
               "[/TOOL_RESULTS]"] if variant == "mistral" else []
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=out,
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=control,
        # Llama 2 / Mistral's normalizer settings: text kept as-is, one dummy prefix space, digits split.
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


def write_llama2_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Llama 2 sentencepiece tokenizer (unk=0, bos=1, eos=2, byte fallback). Returns the vocab size."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.model").write_bytes(_sentencepiece_model("llama2"))
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": True, "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    _merge_config(model_dir, {"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 500})
    return 500


def write_mistral_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Mistral v3-style sentencepiece tokenizer: [INST]=3, [/INST]=4 ... as control pieces."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.model").write_bytes(_sentencepiece_model("mistral"))
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "additional_special_tokens": ["[INST]", "[/INST]"], "chat_template": MISTRAL_CHAT_TEMPLATE,
    })
    _merge_config(model_dir, {"model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 500})
    return 500


# ----------------------------------------------------------------------------------------------- byte-level BPE


@lru_cache(maxsize=None)
def _byte_level_bpe(pattern: str, vocab_size: int) -> str:
    """Train a byte-level BPE with `tokenizers`; returns its tokenizer.json (no added tokens)."""
    return train_byte_level_bpe(corpus(), vocab_size, pattern)


LLAMA3_BASE_VOCAB = 512
LLAMA3_NUM_SPECIAL = 256


def llama3_special_token_names(release: str = "3.2") -> list[str]:
    """A Llama 3 release's 256 special tokens in id order, as its tokenizer.json lists them (ids 128000-128255).

    The releases differ from +5 on: Llama 3.1 calls +5 <|reserved_special_token_2|> and numbers the reserved tokens
    from 3 at +11; Llama 3.2 calls +5 <|step_id|> and numbers them from 2 at +11 (up to 246 at +255).
    """
    if release not in ("3.1", "3.2"):
        raise ValueError(f"unknown Llama 3 release {release!r}; expected 3.1 or 3.2")
    step = "<|step_id|>" if release == "3.2" else "<|reserved_special_token_2|>"
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", step, "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    first = 2 if release == "3.2" else 3
    return named + [f"<|reserved_special_token_{k}|>" for k in range(first, first + LLAMA3_NUM_SPECIAL - len(named))]


def pin_template_day(monkeypatch, day: tuple[int, int, int] = (2024, 7, 26)) -> None:
    """Make transformers' ``strftime_now`` (Llama 3.2's template writes ``strftime_now("%d %b %Y")``, the day it runs)
    return ``day``; by default 26 Jul 2024, the 3.1 template's date and mtune's ``date_string`` default."""
    import datetime

    import transformers.utils.chat_template_utils as chat_utils

    class Day(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*day)

    monkeypatch.setattr(chat_utils, "datetime", Day)


def write_llama3_tokenizer(model_dir: str | Path, release: str = "3.2", chat_template: str | None = None) -> int:
    """Write a tiny Llama 3 tokenizer: `original/tokenizer.model` as a tiktoken rank file (512 ranks, in the
    `tokenizers` trainer's merge order) plus the 256 special tokens after it, named as in Llama `release`'s
    tokenizer.json (3.2 or 3.1), and `chat_template` in its tokenizer_config.json (default: Llama 3's,
    LLAMA3_CHAT_TEMPLATE; the full 3.1 / 3.2 templates are tests/assets/chat_templates/llama3_1.jinja and
    llama3_2.jinja). Returns the vocab size (768)."""
    model_dir = Path(model_dir)
    write_tiktoken_file(_byte_level_bpe(LLAMA3_PATTERN, LLAMA3_BASE_VOCAB), model_dir / "original" / "tokenizer.model")
    vocab_size = LLAMA3_BASE_VOCAB + LLAMA3_NUM_SPECIAL
    # The Hub's tokenizer.json beside it: the same trained BPE with the special tokens added after the base.
    spec = json.loads(_byte_level_bpe(LLAMA3_PATTERN, LLAMA3_BASE_VOCAB))
    spec["added_tokens"] = [
        {"id": LLAMA3_BASE_VOCAB + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i, t in enumerate(llama3_special_token_names(release))
    ]
    _write_json(model_dir / "tokenizer.json", spec)
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": chat_template or LLAMA3_CHAT_TEMPLATE,
    })
    _merge_config(model_dir, {"model_type": "llama", "bos_token_id": LLAMA3_BASE_VOCAB,
                              "eos_token_id": LLAMA3_BASE_VOCAB + 9, "vocab_size": vocab_size})
    return vocab_size


QWEN2_BASE_VOCAB = 500
QWEN2_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _write_tokenizer_json(model_dir: str | Path, *, pattern: str, base_vocab: int, added: tuple[str, ...],
                          tokenizer_config: dict, config: dict, normalizer: dict | None = None,
                          not_special: tuple[str, ...] = ()) -> int:
    """Write a `tokenizer.json` trained as byte-level BPE of ``base_vocab`` tokens with ``added`` after it (special
    but those in ``not_special``), its `tokenizer_config.json` and the model config's token fields (``config``
    plus the vocab size). Returns the vocab size."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    spec = json.loads(_byte_level_bpe(pattern, base_vocab))
    if normalizer is not None:
        spec["normalizer"] = normalizer
    spec["added_tokens"] = [
        {"id": base_vocab + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t not in not_special} for i, t in enumerate(added)
    ]
    _write_json(model_dir / "tokenizer.json", spec)
    _write_json(model_dir / "tokenizer_config.json", tokenizer_config)
    vocab_size = base_vocab + len(added)
    _merge_config(model_dir, {**config, "vocab_size": vocab_size})
    return vocab_size


def write_qwen2_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Qwen2-style `tokenizer.json` (byte-level BPE, NFC, `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>` added after a 500-token base). Returns the vocab size (503)."""
    return _write_tokenizer_json(
        model_dir, pattern=QWEN2_PATTERN, base_vocab=QWEN2_BASE_VOCAB, added=QWEN2_ADDED, normalizer={"type": "NFC"},
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                          "pad_token": "<|endoftext|>", "chat_template": QWEN2_5_CHAT_TEMPLATE},
        config={"model_type": "qwen2", "bos_token_id": None, "eos_token_id": QWEN2_BASE_VOCAB + 2})


QWEN3_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def write_qwen3_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Qwen3-style `tokenizer.json`: Qwen2's with `<think>` and `</think>` added (not special, as in
    Qwen3's file) and Qwen3's chat template. Returns the vocab size (505)."""
    return _write_tokenizer_json(
        model_dir, pattern=QWEN2_PATTERN, base_vocab=QWEN2_BASE_VOCAB, added=QWEN3_ADDED, normalizer={"type": "NFC"},
        not_special=("<think>", "</think>"),
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                          "pad_token": "<|endoftext|>", "chat_template": QWEN3_CHAT_TEMPLATE},
        config={"model_type": "qwen3", "bos_token_id": None, "eos_token_id": QWEN2_BASE_VOCAB + 2})


def write_qwen3_5_tokenizer(model_dir: str | Path) -> int:
    """Write Qwen3's tiny `tokenizer.json` with Qwen3.5's chat template and a `qwen3_5_text` config. Returns 505."""
    return _write_tokenizer_json(
        model_dir, pattern=QWEN2_PATTERN, base_vocab=QWEN2_BASE_VOCAB, added=QWEN3_ADDED, normalizer={"type": "NFC"},
        not_special=("<think>", "</think>"),
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                          "pad_token": "<|endoftext|>", "chat_template": QWEN3_5_CHAT_TEMPLATE},
        config={"model_type": "qwen3_5_text", "bos_token_id": None, "eos_token_id": QWEN2_BASE_VOCAB + 2})


QWEN_TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHAT_TEMPLATES = Path(__file__).parents[1] / "assets" / "chat_templates"


def write_qwen_tools_tokenizer(model_dir: str | Path, family: str) -> int:
    """Write the tiny Qwen3 (`family` qwen3) or Qwen3.5 (qwen3_5) `tokenizer.json` with the four tool tags added
    after `</think>` (not special, as in the hub's files) and the family's full official template, tool-calling
    branches included: tests/assets/chat_templates/qwen3.jinja (Qwen/Qwen3-0.6B's) or qwen3_5.jinja (Qwen3.5's,
    whose lines without tools are those of QWEN3_5_CHAT_TEMPLATE); their sources are in that folder's README.md.
    Returns the vocab size (509)."""
    model_type = {"qwen3": "qwen3", "qwen3_5": "qwen3_5_text"}[family]
    return _write_tokenizer_json(
        model_dir, pattern=QWEN2_PATTERN, base_vocab=QWEN2_BASE_VOCAB, added=QWEN3_ADDED + QWEN_TOOL_TAGS,
        normalizer={"type": "NFC"}, not_special=("<think>", "</think>") + QWEN_TOOL_TAGS,
        tokenizer_config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                          "pad_token": "<|endoftext|>",
                          "chat_template": (CHAT_TEMPLATES / f"{family}.jinja").read_text()},
        config={"model_type": model_type, "bos_token_id": None, "eos_token_id": QWEN2_BASE_VOCAB + 2})


PHI4_BASE_VOCAB = 500
PHI4_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>", "<|dummy_85|>")
PHI4_MINI_ADDED = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>")


def write_phi4_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Phi-4-style `tokenizer.json` (byte-level BPE, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
    `<|im_sep|>` and the pad token `<|dummy_85|>` added after a 500-token base), Phi-4's special tokens (eos
    `<|im_end|>`, as since its January 2025 update) and chat template. Returns the vocab size (505)."""
    return _write_tokenizer_json(
        model_dir, pattern=LLAMA3_PATTERN, base_vocab=PHI4_BASE_VOCAB, added=PHI4_ADDED,
        tokenizer_config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                          "eos_token": "<|im_end|>", "pad_token": "<|dummy_85|>", "add_bos_token": False,
                          "chat_template": PHI4_CHAT_TEMPLATE},
        config={"model_type": "phi3", "bos_token_id": PHI4_BASE_VOCAB, "eos_token_id": PHI4_BASE_VOCAB + 2,
                "pad_token_id": PHI4_BASE_VOCAB + 4})


def write_phi4_mini_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny Phi-4-mini-style `tokenizer.json` (byte-level BPE, `<|endoftext|>`, the role tokens and `<|end|>`
    added after a 500-token base) and Phi-4-mini's chat template. Returns the vocab size (505)."""
    return _write_tokenizer_json(
        model_dir, pattern=LLAMA3_PATTERN, base_vocab=PHI4_BASE_VOCAB, added=PHI4_MINI_ADDED,
        tokenizer_config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                          "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                          "chat_template": PHI4_MINI_CHAT_TEMPLATE},
        config={"model_type": "phi3", "bos_token_id": PHI4_BASE_VOCAB, "eos_token_id": PHI4_BASE_VOCAB})


GEMMA3_ADDED = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")


def write_gemma3_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny `tokenizer.json` with Gemma 3's control tokens (byte-level BPE here; Gemma's own is a
    sentencepiece-style BPE, read by the same `tokenizers` code) and Gemma 3's chat template. Returns 505."""
    return _write_tokenizer_json(
        model_dir, pattern=LLAMA3_PATTERN, base_vocab=PHI4_BASE_VOCAB, added=GEMMA3_ADDED,
        tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                          "pad_token": "<pad>", "add_bos_token": False, "chat_template": GEMMA3_CHAT_TEMPLATE},
        config={"model_type": "gemma3_text", "bos_token_id": PHI4_BASE_VOCAB + 2,
                "eos_token_id": PHI4_BASE_VOCAB + 1})


GEMMA4_ADDED = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>")


def write_gemma4_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny `tokenizer.json` with Gemma 4's control tokens (byte-level BPE here, as for Gemma 3) and Gemma
    4's chat template (text branches). Returns 505."""
    return _write_tokenizer_json(
        model_dir, pattern=LLAMA3_PATTERN, base_vocab=PHI4_BASE_VOCAB, added=GEMMA4_ADDED,
        tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                          "pad_token": "<pad>", "add_bos_token": False, "chat_template": GEMMA4_CHAT_TEMPLATE},
        config={"model_type": "gemma4_text", "bos_token_id": PHI4_BASE_VOCAB + 2,
                "eos_token_id": PHI4_BASE_VOCAB + 1})


# o200k's pre-tokenizer pattern (tiktoken's o200k_base, which o200k_harmony extends with the harmony tokens).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# The hub's gpt-oss tokenizer.json ends with these 21 tokens at ids 199998-200018 (transformers'
# convert_gpt_oss_weights_to_hf.py: the harmony tokens, the rest <|reserved_{id}|>); the tiny file keeps their
# order after its 500-token base, so each sits at 500 + (hub id - 199998).
GPT_OSS_HUB_IDS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
                   "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
                   "<|call|>": 200012, "<|endofprompt|>": 200018}
GPT_OSS_FIRST_SPECIAL = 199998
_GPT_OSS_NAMES = {i: f"<|reserved_{i}|>" for i in range(199998, 200019)} | {i: n for n, i in GPT_OSS_HUB_IDS.items()}
GPT_OSS_ADDED = tuple(_GPT_OSS_NAMES[i] for i in sorted(_GPT_OSS_NAMES))


def write_gpt_oss_tokenizer(model_dir: str | Path) -> int:
    """Write a tiny gpt-oss-style `tokenizer.json` (byte-level BPE with o200k's pattern, the 21 tokens of the hub's
    file after a 500-token base in the hub's order), `tokenizer_config.json` with the hub's bos / eos / pad and the
    official template as `chat_template.jinja` beside it, as the checkpoint ships it. Returns the vocab size (521)."""
    base = PHI4_BASE_VOCAB
    vocab_size = _write_tokenizer_json(
        model_dir, pattern=O200K_PATTERN, base_vocab=base, added=GPT_OSS_ADDED,
        tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                          "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        config={"model_type": "gpt_oss", "eos_token_id": base + 200002 - GPT_OSS_FIRST_SPECIAL,
                "pad_token_id": base + 199999 - GPT_OSS_FIRST_SPECIAL})
    (Path(model_dir) / "chat_template.jinja").write_text(GPT_OSS_CHAT_TEMPLATE)
    return vocab_size


def _merge_config(model_dir: Path, fields: dict) -> None:
    # A model helper may have written config.json already: keep its fields, only fill in missing ones.
    path = model_dir / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    for key, value in fields.items():
        config.setdefault(key, value)
    _write_json(path, config)


_WRITERS = {"llama2": write_llama2_tokenizer, "llama3": write_llama3_tokenizer,
            "mistral": write_mistral_tokenizer, "qwen2": write_qwen2_tokenizer, "qwen3": write_qwen3_tokenizer,
            "qwen3_5": write_qwen3_5_tokenizer, "phi4": write_phi4_tokenizer,
            "phi4_mini": write_phi4_mini_tokenizer, "gemma3": write_gemma3_tokenizer,
            "gemma4": write_gemma4_tokenizer, "gpt_oss": write_gpt_oss_tokenizer}


def write_tokenizer_files(model_dir: str | Path, family: str) -> int:
    """Add a tiny tokenizer of `family` (llama2 | llama3 | mistral | qwen2 | qwen3 | qwen3_5 | phi4 | phi4_mini |
    gemma3 | gemma4 | gpt_oss) to `model_dir`; returns its vocab size (llama2/mistral 500, llama3 768, qwen2 503,
    qwen3(_5) / phi4(_mini) / gemma3 / gemma4 505, gpt_oss 521) so the model's embedding can match. An existing config.json keeps its
    own fields (its `vocab_size` included)."""
    if family not in _WRITERS:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {FAMILIES}")
    return _WRITERS[family](model_dir)


def trained_text_runs(tok, result) -> list[str]:
    """A tokenized conversation's trained tokens decoded with ``tok``, one string per run of them."""
    runs, current = [], []
    for token, trained in zip(result.tokens + [None], result.trained + [False]):
        if trained:
            current.append(token)
        elif current:
            runs.append(tok.decode(current, skip_special_tokens=False))
            current = []
    return runs
