"""Generate text from a base or fully fine-tuned checkpoint, or a base plus a PEFT adapter, printed as it is produced.

    mtune run generate --config tiny/generate prompt="Hello"
    mtune run generate --config tiny/generate '~prompt' 'messages=[{role: user, content: "reverse: a b c"}]'

`prompt` is plain text to continue; `messages` is a chat, rendered in the tokenizer's chat format with the assistant
header appended. Greedy with `temperature: 0`; otherwise sampled (`top_k`, `top_p`) from a generator seeded with
`seed`. Decoding uses the model's KV cache. `weight_offloading` keeps the weights in host memory and brings one
group of blocks (or one module) to the device at a time, for models larger than the device. The generated text goes to stdout token by token; logs go to stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable
from typing import TextIO

import torch
from omegaconf import DictConfig, OmegaConf

from mtune.config import RecipeSchema
from mtune.config.errors import ConfigError
from mtune.config.keys import GENERATE_KEYS, MODEL_NODES
from mtune.config.rules import GENERATE_RULES
from mtune.modules.generation import generate_stream
from mtune.tokenizers import Message, load_tokenizer
from mtune.tokenizers.base import ROLES
from mtune.training.checkpointing.manifest import check_before_loading
from mtune.training.checkpointing.peft import load_peft_adapter, lora_node_from_adapter
from mtune.training.context import configure_logging, resolve_device
from mtune.training.precision import resolve_dtype
from mtune.training.memory.registry import GENERATION_MEMORY_KEYS, MemoryConfig
from mtune.training.model_setup import resolve_model_source, setup_model

SCHEMA = RecipeSchema([MODEL_NODES, GENERATE_KEYS, GENERATION_MEMORY_KEYS],
                      rules=GENERATE_RULES)

log = logging.getLogger("mtune")


def chat_messages(messages: Iterable) -> list[Message]:
    """The config's ``messages`` as `Message` objects; a turn that is not ``{role, content}`` with a known role and
    text content is refused in one line naming it (``messages[1].role``)."""
    chat = []
    for i, turn in enumerate(messages):
        if not hasattr(turn, "keys") or set(turn.keys()) != {"role", "content"}:
            raise ConfigError(f"messages[{i}]: expected {{role: ..., content: ...}}, got {turn!r}")
        if turn["role"] not in ROLES:
            raise ConfigError(f"messages[{i}].role: {turn['role']!r} is not a chat role; use one of "
                              f"{', '.join(ROLES)}")
        if not isinstance(turn["content"], str):
            raise ConfigError(f"messages[{i}].content: expected text, got {type(turn['content']).__name__} "
                              f"{turn['content']!r} (quote it)")
        chat.append(Message(role=turn["role"], content=turn["content"]))
    return chat


def prompt_tokens(tokenizer, prompt: str | None, messages: Iterable | None) -> list[int]:
    """Token ids of a plain-text prompt (BOS where the family has one, no EOS) or of a chat awaiting its reply."""
    if messages is not None:
        chat = chat_messages(messages)
        return tokenizer.tokenize_messages(chat, add_generation_prompt=True).tokens
    return tokenizer.encode(prompt, add_bos=True, add_eos=False)


def stream_text(tokenizer, steps: Iterable[torch.Tensor], out: TextIO | None = None) -> tuple[str, int]:
    """Write the text of the first row of ``steps`` to ``out`` (default: stdout) as it grows; returns (text, tokens
    generated).

    Each step re-decodes all ids so far and writes what is new: byte-level tokens can split a character, and
    sentencepiece decides spaces from the context, so decoding token by token on its own would garble both. Text
    ending in an incomplete character (U+FFFD) waits for the next token.
    """
    out = out if out is not None else sys.stdout
    ids: list[int] = []
    stops, printed, count = set(tokenizer.stop_tokens), "", 0
    for step in steps:
        token = int(step[0])
        count += 1
        if token in stops:
            break
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd") or not text.startswith(printed):
            continue
        out.write(text[len(printed):])
        out.flush()
        printed = text
    text = tokenizer.decode(ids)
    if text.startswith(printed):
        out.write(text[len(printed):])
    out.write("\n")
    out.flush()
    return text, count


def main(cfg: DictConfig) -> str:
    configure_logging()
    if cfg.messages is not None:
        chat_messages(cfg.messages)  # refuse a malformed chat before loading the model
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    adapter_dir = cfg.adapter_dir
    lora = lora_node_from_adapter(adapter_dir) if adapter_dir else None
    memory = MemoryConfig(**{key.name: cfg[key.name] for key in GENERATION_MEMORY_KEYS.keys})
    model, _ = setup_model(source, device=device, dtype=dtype, lora=lora, memory=memory, trainable=False)
    if adapter_dir:
        if cfg.verify_checksums:
            check_before_loading(adapter_dir)
        load_peft_adapter(model, adapter_dir)
        log.info("adapter: loaded %s", adapter_dir)
    model.eval()

    tokenizer_cfg = cfg.get("tokenizer") or {}
    tokenizer_path = tokenizer_cfg.get("path") or source.checkpoint_dir
    if tokenizer_path is None:
        raise ConfigError("tokenizer.path is needed when the model has random weights (model.size)")
    tokenizer = load_tokenizer(tokenizer_path, max_seq_len=tokenizer_cfg.get("max_seq_len"))
    messages = cfg.messages
    if messages is not None:
        messages = OmegaConf.to_container(messages, resolve=True) if OmegaConf.is_config(messages) else messages
    prompt = prompt_tokens(tokenizer, cfg.prompt, messages)

    generator = None
    temperature = float(cfg.temperature)
    if temperature > 0:
        generator = torch.Generator(device).manual_seed(cfg.seed)
    start = time.perf_counter()
    steps = generate_stream(model, prompt, cfg.max_new_tokens, temperature=temperature,
                            top_k=cfg.top_k, top_p=cfg.top_p, stop_tokens=tokenizer.stop_tokens,
                            generator=generator)
    text, count = stream_text(tokenizer, steps)
    seconds = time.perf_counter() - start
    log.info("%d prompt tokens, %d new tokens in %.2f s (%.1f tokens/s)", len(prompt), count, seconds,
             count / max(seconds, 1e-9))
    return text
