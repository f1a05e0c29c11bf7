"""Generate text from a base or fully fine-tuned checkpoint, or a base plus a PEFT adapter, printed as it is produced.

    mtune run generate --config tiny/generate prompt="Hello"
    mtune run generate --config tiny/generate '~prompt' 'messages=[{role: user, content: "reverse: a b c"}]'

`prompt` is plain text to continue; `messages` is a chat, rendered in the tokenizer's chat format with the assistant
header appended. Greedy with `temperature: 0`; otherwise sampled (`top_k`, `top_p`) from a generator seeded with
`seed`. Decoding uses the model's KV cache (and Qwen3.5's linear-attention layers their recurrent state).
`weight_offloading` keeps the weights in host memory and brings one group of blocks (or one module) to the device at
a time, for models larger than the device. The generated text goes to stdout token by token; logs go to stderr.
"""

from __future__ import annotations

import logging
import time

import torch
from omegaconf import DictConfig, OmegaConf

from mtune.config import RecipeSchema
from mtune.config.keys import GENERATE_KEYS, MODEL_NODES
from mtune.config.rules import GENERATE_RULES
from mtune.modules.generation import generate_stream, stream_text
from mtune.tokenizers.prompt import chat_messages, prompt_tokens
from mtune.training.checkpointing.peft import lora_node_from_adapter
from mtune.training.context import configure_logging, resolve_device
from mtune.training.data_setup import setup_tokenizer
from mtune.training.precision import resolve_dtype
from mtune.training.memory.registry import GENERATION_MEMORY_KEYS, MemoryConfig
from mtune.training.model_setup import resolve_model_source, setup_model

SCHEMA = RecipeSchema([MODEL_NODES, GENERATE_KEYS, GENERATION_MEMORY_KEYS],
                      rules=GENERATE_RULES)

log = logging.getLogger("mtune")


def main(cfg: DictConfig) -> str:
    configure_logging()
    if cfg.messages is not None:
        chat_messages(cfg.messages)  # refuse a malformed chat before loading the model
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums, adapter_key="adapter_dir")
    lora = lora_node_from_adapter(cfg.adapter_dir) if cfg.adapter_dir else None  # built, then loaded from there
    memory = MemoryConfig(**{key.name: cfg[key.name] for key in GENERATION_MEMORY_KEYS.keys})
    model, _ = setup_model(source, device=device, dtype=dtype, lora=lora, memory=memory, trainable=False,
                           verify_checksums=cfg.verify_checksums)
    model.eval()

    tokenizer = setup_tokenizer(cfg.get("tokenizer"), source)
    messages = cfg.messages
    if messages is not None:
        messages = OmegaConf.to_container(messages, resolve=True) if OmegaConf.is_config(messages) else messages
    prompt = prompt_tokens(tokenizer, cfg.prompt, messages)
    if len(prompt) + cfg.max_new_tokens > source.args.max_seq_len:  # generates, but past what the model learned
        log.warning("%d prompt + %d new tokens run past the %d positions %s was trained on: expect the text to degrade",
                    len(prompt), cfg.max_new_tokens, source.args.max_seq_len, source.family)

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
