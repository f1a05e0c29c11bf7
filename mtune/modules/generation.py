"""Autoregressive text generation with the decoder's KV cache."""

import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TextIO

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids ``[b]`` from last-position logits ``[b, vocab]``.

    ``temperature=0`` is greedy (argmax). Otherwise logits are divided by the temperature, cut to the ``top_k``
    largest and to the smallest set whose probability reaches ``top_p``, and sampled.
    """
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token that crosses top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def _grad_free(model) -> AbstractContextManager:
    """The context to run the model's forwards in: ``inference_mode`` (the fastest) for a plain model, ``no_grad``
    for one with distributed (DTensor) parameters.

    FSDP2 allocates each block's all-gather buffers on the model's first forward and reuses them for the rest of
    the run. When that first forward is a generation (a task evaluation before training) under ``inference_mode``,
    the buffers become inference tensors, and training's next all-gather cannot write into them ("Inplace update
    to inference tensor outside InferenceMode"). Under ``no_grad`` they are ordinary tensors.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no parameter can be a DTensor
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters()):
        return torch.no_grad()
    return torch.inference_mode()


def generate_stream(
    model,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, but yields each step's new tokens, LongTensor ``[b]``, as soon as they are sampled
    (for printing text as it is produced). The KV cache is removed when the iterator ends or is closed.

    Every forward runs under ``inference_mode``, or ``no_grad`` when the model is sharded (see :func:`_grad_free`).
    A sharded model runs a collective in each forward, so every rank must generate for the same number of steps:
    give every rank the same prompts (as the task evaluation does) or no ``stop_tokens``."""
    device = model.embed_tokens.weight.device
    tokens = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if tokens.dim() == 1:
        tokens = tokens[None]
    b, s = tokens.shape
    stops = torch.tensor(list(stop_tokens or []), dtype=torch.long, device=device)
    model.setup_caches(b, s + max_new_tokens)
    grad_free = _grad_free(model)
    try:
        with grad_free:
            logits = model(tokens, last_only=True)[:, -1]
        done = torch.zeros(b, dtype=torch.bool, device=device)
        last = None
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if last is not None:
                nxt = torch.where(done, last, nxt)
            yield nxt
            done = done | torch.isin(nxt, stops)
            last = nxt
            if bool(done.all()):
                break
            with grad_free:
                logits = model(nxt[:, None])[:, -1]
    finally:
        model.remove_caches()


def generate(
    model,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend prompts with up to ``max_new_tokens`` tokens; returns LongTensor ``[b, prompt + generated]``.

    Args:
        model: a ``TransformerDecoder`` (its caches are set up here and removed afterwards).
        prompt_ids: a list of ids, or LongTensor ``[s]`` or ``[b, s]`` (prompts of equal length).
        temperature, top_k, top_p: see :func:`sample_next`; the default is greedy decoding.
        stop_tokens: a row is finished once it produced one of these; finished rows repeat it, and generation
            ends when every row is finished.
        generator: RNG for sampling.
    """
    tokens = torch.as_tensor(prompt_ids, dtype=torch.long, device=model.embed_tokens.weight.device)
    if tokens.dim() == 1:
        tokens = tokens[None]
    steps = generate_stream(model, tokens, max_new_tokens, temperature, top_k, top_p, stop_tokens, generator)
    return torch.cat([tokens, *(nxt[:, None] for nxt in steps)], dim=1)


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
