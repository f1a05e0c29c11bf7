"""Fold a LoRA / DoRA adapter into its base checkpoint, streaming one tensor at a time.

For each adapted linear (s = alpha / rank; the formula is `mtune.modules.lora.merge_adapter`):

    LoRA:  W' = W + s B A
    DoRA:  W' = m * (W + s B A) / ||W + s B A||_row        (PEFT's merge; m is ``lora_magnitude_vector``)

The merge reads W from the *source checkpoint* in the precision it is stored in, computes in fp32 and writes W' back
in that precision (or ``dtype``). So a QLoRA run, whose live base weights are NF4, exports the full-precision model
people serve: the base it merges into is the original, not the 4-bit copy it trained against (docs/checkpoints.md
gives the measured distance between the two).

Experts arrive as the base family's layout holds them (:mod:`mtune.modules.expert_layout`): each expert's adapter is
folded into its row of a per-expert key, its rows of a whole, transposed projection (gpt-oss) or its gate / up rows
of a side-by-side ``gate_up_proj`` (Gemma 4). The hub's MXFP4 experts (gpt-oss) are dequantized (to ``dtype``, bf16
when None) and written whole, so the merged model is a plain checkpoint (its config drops ``quantization_config``).

Peak memory is the adapter plus one base tensor (plus whatever the writer buffers up to ``max_shard_size``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mtune.modules.lora import merge_adapter
from mtune.modules.expert_layout import (
    MXFP4_BLOCKS, ExpertLayout, expert_layout, mxfp4_part, side_by_side_key, stacked_key, whole_key,
)
from mtune.training.checkpointing.hf import (
    CheckpointError, checkpoint_keys, load_hf_config, open_safetensors, save_hf_checkpoint,
)
from mtune.training.checkpointing.peft import Adapter, adapter_from_model, read_adapter
from mtune.training.checkpointing.placing import read_mxfp4

__all__ = ["merged_hf_weights", "save_merged_model"]


def _as_adapter(adapter: str | os.PathLike | nn.Module | Adapter, layout: ExpertLayout) -> Adapter:
    if isinstance(adapter, Adapter):
        return adapter
    if isinstance(adapter, nn.Module):
        return adapter_from_model(adapter)
    return read_adapter(adapter, layout)


def _weight_key(module_name: str) -> str:
    return f"{module_name}.weight" if module_name.startswith("lm_head") else f"model.{module_name}.weight"


@torch.no_grad()
def merged_hf_weights(
    base_dir: str | os.PathLike,
    adapter: str | os.PathLike | nn.Module | Adapter,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` for every tensor of the base checkpoint, in file order, adapters folded in.

    Args:
        base_dir: the Hugging Face checkpoint the adapter was trained on (its original-precision weights).
        adapter: a PEFT adapter directory, a live LoRA model (its LoRALinear adapters are read; the model's own
            base weights, NF4 or not, are not used), or an :class:`~mtune.training.checkpointing.peft.Adapter`.
            With FSDP pass ``adapter_from_model(model)`` gathered on every rank, then merge on rank 0.
        dtype: the output dtype of floating tensors; None keeps each tensor's stored dtype.

    Every adapted module must have a weight in the checkpoint, checked before the first tensor is yielded.
    Feed the result to ``save_hf_checkpoint(..., source_dir=base_dir)``; see :func:`save_merged_model`.
    """
    # experts a checkpoint holds whole: gpt-oss's transposed, Gemma 4's gate and up side by side (both name their down
    # projection ``experts.down_proj``: the family's layout says which it is)
    layout = expert_layout(load_hf_config(base_dir)[1])
    layers = {_weight_key(name): layer for name, layer in _as_adapter(adapter, layout).layers.items()}
    listed = checkpoint_keys(base_dir)
    held = {k for keys in listed.values() for k in keys}
    # the hub's MXFP4 experts (gpt-oss) are written dequantized, under the whole key their blocks stand for
    if layout is ExpertLayout.WHOLE_TRANSPOSED:
        held |= {k.removesuffix(MXFP4_BLOCKS) for k in held if mxfp4_part(k) == "blocks"}
    whole = _whole_experts(layers, held) if layout is ExpertLayout.WHOLE_TRANSPOSED else {}
    layers = _gate_up_expert_layers(layers, held) if layout is ExpertLayout.GATE_UP_SIDE_BY_SIDE else layers
    missing = set(layers) - held
    if missing:
        raise CheckpointError(
            f"{base_dir}: the adapter adapts {sorted(missing)[0]} (and {len(missing) - 1} more), which the base "
            "checkpoint does not hold: pass the base model the adapter was trained on"
        )
    return _stream(listed, layers, dtype, whole, layout)


def _whole_experts(layers: dict, held: set[str]) -> dict[str, dict[int, object]]:
    """The per-expert adapter layers (``model.layers.0.mlp.experts.3.gate_up_proj.weight``) of a checkpoint that
    holds each expert projection whole and transposed (gpt-oss: ``model.layers.0.mlp.experts.gate_up_proj [E, in,
    out]``), taken out of ``layers`` and grouped by that key: ``{key: {expert: layer}}``."""
    whole: dict[str, dict[int, object]] = {}
    for key in [k for k in layers if k not in held]:
        slot = stacked_key(key)
        fused = whole_key(slot[0]) if slot is not None else None
        if fused in held:
            whole.setdefault(fused, {})[slot[1]] = layers.pop(key)
    return whole


def _gate_up_expert_layers(layers: dict, held: set[str]) -> dict:
    """``layers`` with the per-expert adapters of experts a checkpoint holds with gate and up side by side (Gemma
    4's ``experts.gate_up_proj [E, 2h, d]``, gate rows first, and ``experts.down_proj``: no per-expert keys) grouped
    under that key, as ``{expert: {"gate" | "up" | "down": layer}}``; the others unchanged."""
    out = {}
    for key, layer in layers.items():
        slot = stacked_key(key)
        joined = side_by_side_key(slot[0]) if slot is not None else None
        if joined is None or key in held or joined[0] not in held:
            out[key] = layer
        else:
            out.setdefault(joined[0], {}).setdefault(slot[1], {})[joined[1]] = layer
    return out


def _merge_gate_up(tensor: torch.Tensor, experts: dict, dtype) -> torch.Tensor:
    """A ``[E, rows, in]`` experts tensor of :func:`_gate_up_expert_layers` with each expert's adapters folded into
    its rows (gate: the first half of ``gate_up_proj``'s, up: the second; down: all of ``down_proj``'s)."""
    merged = tensor.to(dtype or tensor.dtype, copy=True)
    half = tensor.shape[1] // 2
    rows = {"gate": slice(0, half), "up": slice(half, None), "down": slice(None)}
    for e, parts in experts.items():
        for part, layer in parts.items():
            merged[e, rows[part]] = merge_adapter(tensor[e, rows[part]], layer.a, layer.b, layer.scaling,
                                                  layer.magnitude, dtype)
    return merged


def _stream(listed, layers, dtype, whole, layout) -> Iterator[tuple[str, torch.Tensor]]:
    mxfp4 = layout is ExpertLayout.WHOLE_TRANSPOSED
    where = {k: path for path, keys in listed.items() for k in keys} if mxfp4 else {}
    for path, keys in listed.items():
        with open_safetensors(path) as f:
            for key in keys:
                if mxfp4 and mxfp4_part(key) is not None:
                    if mxfp4_part(key) == "scales":
                        continue  # read with their blocks
                    # [E, out, in] dequantized (to dtype, bf16 when None), held [E, in, out] as the whole layout does
                    tensor = read_mxfp4(f, key, lambda k: open_safetensors(where[k]), dtype).transpose(1, 2)
                    key = key.removesuffix(MXFP4_BLOCKS)
                else:
                    tensor = f.get_tensor(key)
                if key in whole:  # [E, in, out]: each adapted expert's [out, in] slice merged
                    merged = tensor.to(dtype or tensor.dtype, copy=True)
                    for e, layer in whole[key].items():
                        merged[e] = merge_adapter(tensor[e].t(), layer.a, layer.b, layer.scaling, None,
                                                  merged.dtype).t()
                    tensor = merged
                elif isinstance(layers.get(key), dict):
                    tensor = _merge_gate_up(tensor, layers[key], dtype)
                elif key in layers:
                    layer = layers[key]
                    if tuple(tensor.shape) != (layer.b.shape[0], layer.a.shape[1]):
                        raise CheckpointError(
                            f"{path}: {key} has shape {list(tensor.shape)} but the adapter expects "
                            f"{[layer.b.shape[0], layer.a.shape[1]]}: pass the base model the adapter was trained on"
                        )
                    tensor = merge_adapter(tensor, layer.a, layer.b, layer.scaling, layer.magnitude, dtype)
                elif dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield key, tensor
                del tensor


def save_merged_model(
    base_dir: str | os.PathLike,
    adapter: str | os.PathLike | nn.Module | Adapter,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the merged model as a Hugging Face directory (config, tokenizer and generation files copied from
    ``base_dir``); ``out_dir`` must hold no weights yet. Returns ``out_dir``."""
    return save_hf_checkpoint(merged_hf_weights(base_dir, adapter, dtype), out_dir, source_dir=base_dir,
                              max_shard_size=max_shard_size)
