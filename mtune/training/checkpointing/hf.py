"""Read and write Hugging Face model directories (``config.json`` + safetensors, single file or sharded).

Loading streams one tensor at a time into a model built on the meta device, so peak memory is the model plus one
tensor; saving accepts a model, a state dict or any iterable of ``(name, tensor)`` (a distributed gather can yield
one full tensor at a time) and shards the output at a size limit.
"""

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from mtune.errors import MtuneError
from mtune.models import build_model_from_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config, text_model_key
from mtune.modules.expert_layout import (
    ExpertLayout, as_checkpoint_holds, checkpoint_shape, expert_layout, from_checkpoint, side_by_side_parts,
    stacked_key, whole_name,
)
from mtune.modules.transformer import DecoderArgs, TransformerDecoder
from mtune.training.checkpointing._shard_writer import ShardWriter
from mtune.training.checkpointing.adapter_check import refuse_adapter_dir
from mtune.training.checkpointing.placing import expected_tensors, held_names, held_shape, place, read_mxfp4
from mtune.units import parse_bytes

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files a model directory carries besides its weights: tokenizer, chat template, generation defaults.
_COPIED_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken")
_NOT_COPIED = {CONFIG_NAME, INDEX_NAME, "mtune_state.json"}
_SHARD_SIZE_ERROR = "{what} {text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes"
log = logging.getLogger(__name__)


class CheckpointError(MtuneError, ValueError):
    """A checkpoint directory that cannot be read or written; the message names the file or key."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def mtune_name(hf_key: str) -> str | None:
    """``model.layers.0.self_attn.q_proj.weight`` (or a multimodal checkpoint's text-model key, see
    :func:`text_model_key`) -> ``layers.0.self_attn.q_proj.weight``; None for a tower mtune does not train."""
    key = text_model_key(hf_key)
    return None if key is None else key.removeprefix("model.")


def hf_key(name: str) -> str:
    """mtune's parameter name -> the Hugging Face checkpoint key (``lm_head.`` and ``model.`` names unchanged)."""
    return name if name.startswith(("lm_head.", "model.")) else f"model.{name}"


def _short_list(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


# ------------------------------------------------------------------------------------------------------ config
def read_hf_config(checkpoint_dir: str | os.PathLike) -> dict:
    """The raw ``config.json`` dict of a Hugging Face model directory."""
    path = Path(checkpoint_dir) / CONFIG_NAME
    if not path.is_file():
        refuse_adapter_dir(checkpoint_dir, "checkpoint_dir")
        raise CheckpointError(f"{path}: not found; checkpoint_dir must be a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def load_hf_config(checkpoint_dir: str | os.PathLike) -> tuple[str, DecoderArgs]:
    """``(family, args)`` from ``checkpoint_dir/config.json``; family is ``llama2|llama3|mistral|qwen2``."""
    try:
        return model_args_from_hf_config(read_hf_config(checkpoint_dir))
    except (ValueError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{Path(checkpoint_dir) / CONFIG_NAME}: {detail}") from None


# ------------------------------------------------------------------------------------------------------ loading
def weight_files(checkpoint_dir: str | os.PathLike) -> dict[Path, list[str] | None]:
    """Safetensors files of a checkpoint, each with the HF keys the index assigns it (None: a single file)."""
    root = Path(checkpoint_dir)
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files: dict[Path, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(root / name, []).append(key)
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {INDEX_NAME} is missing")
        return files
    if (root / SINGLE_FILE).is_file():
        return {root / SINGLE_FILE: None}
    raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_NAME} (only safetensors checkpoints are supported)")


def open_safetensors(path: Path):
    """``safe_open`` a file for reading on CPU; a truncated or corrupt file raises :class:`CheckpointError`."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def checkpoint_keys(checkpoint_dir: str | os.PathLike) -> dict[Path, list[str]]:
    """Every safetensors file of a checkpoint with its HF keys (from the index, or the single file's header)."""
    listed = {}
    for path, keys in weight_files(checkpoint_dir).items():
        if keys is None:
            with open_safetensors(path) as f:
                keys = list(f.keys())
        listed[path] = keys
    return listed


def locate_tensors(
    model: nn.Module, checkpoint_dir: str | os.PathLike, not_in_checkpoint: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], dict[Path, list[tuple[str, str]]]]:
    """Match a checkpoint's keys to the model's tensors before anything is read.

    Returns ``(expected, by_file)``: the model's tensors by mtune name (:func:`expected_tensors`, minus those
    ``not_in_checkpoint(name)`` marks, e.g. LoRA adapters) and, per safetensors file, its ``(mtune name, hf key)``
    pairs; an expert's key keeps its index in the name (``experts.3.gate_proj.weight``, row 3 of the model's
    ``experts.gate_proj.weight``: :func:`~mtune.modules.expert_layout.stacked_key`), or, where the family holds
    experts whole (``ExpertLayout.WHOLE_TRANSPOSED``), is named as the model's parameter. Missing or unexpected keys
    raise :class:`CheckpointError` naming them.
    """
    expected = expected_tensors(model)
    if not_in_checkpoint is not None:
        expected = {k: v for k, v in expected.items() if not not_in_checkpoint(k)}
    whole = expert_layout(model) is ExpertLayout.WHOLE_TRANSPOSED
    held = held_names(model, expected)
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    listed = set()
    skipped = 0
    for path, keys in checkpoint_keys(checkpoint_dir).items():
        for key in keys:
            name = mtune_name(key)
            if whole and name is not None and (name := whole_name(name)) is None:
                continue  # MXFP4 scales: read with their blocks
            skipped += name is None
            if name is None or (tied and name == "lm_head.weight"):
                continue  # a vision tower; some tied checkpoints store the shared matrix twice
            by_file.setdefault(path, []).append((name, key))
            listed.add(name)
    if skipped:
        log.info("%s: %d tensors of other towers (vision, audio, multi-token prediction) skipped (mtune trains the "
                 "text model)", checkpoint_dir, skipped)
    missing, unexpected = held - listed, listed - held
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint_dir}: checkpoint does not match the model: missing keys [{_short_list(missing)}], "
            f"unexpected keys [{_short_list(unexpected)}]"
        )
    return expected, by_file


def load_hf_checkpoint(
    model: nn.Module,
    checkpoint_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    not_in_checkpoint: Callable[[str], bool] | None = None,
    after_tensor: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Load a Hugging Face checkpoint's weights into ``model``, one tensor at a time.

    ``model`` may be on the meta device (tensors are assigned, on ``device``) or materialised (tensors copied into
    its parameters). ``dtype=None`` keeps the checkpoint's dtype on meta models. Every key must match: missing or
    unexpected keys and wrong shapes raise :class:`CheckpointError` before or as they are found.

    ``not_in_checkpoint(name)`` marks model parameters a base checkpoint does not hold (LoRA adapters).
    ``after_tensor(module)`` is called with the module that just received a tensor, e.g. to quantize a frozen
    weight to NF4 at once, so the whole model never sits in memory at full precision.
    """
    expected, by_file = locate_tensors(model, checkpoint_dir, not_in_checkpoint)
    layout, gate_up = expert_layout(model), side_by_side_parts(model)
    whole = layout is ExpertLayout.WHOLE_TRANSPOSED  # gpt-oss's experts: maybe MXFP4 pairs, in two files
    where = {k: p for p, keys in checkpoint_keys(checkpoint_dir).items() for k in keys} if whole else {}
    arrived: dict[str, int] = {}  # experts of each stacked projection read so far
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for name, key in entries:
                slot = None if name in expected or name in gate_up else stacked_key(name)
                want = held_shape(name, slot, expected, gate_up)
                try:
                    tensor = read_mxfp4(f, key, lambda k: open_safetensors(where[k]), dtype) if whole else None
                    shape = tuple(f.get_slice(key).get_shape() if tensor is None else tensor.shape)
                    want = checkpoint_shape(name, want, layout) if tensor is None else want  # MXFP4: the model's
                    if shape != want:
                        raise CheckpointError(f"{path}: tensor {key} has shape {list(shape)}, the model expects {list(want)}")
                    if tensor is None:
                        tensor = from_checkpoint(name, f.get_tensor(key), layout)
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{path}: cannot read tensor {key} ({e})") from None
                completed = place(model, name, slot, tensor, dtype, device, arrived, gate_up)
                del tensor
                for parameter in completed if after_tensor is not None else ():
                    after_tensor(model.get_submodule(parameter.rpartition(".")[0]))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def load_model_from_hf(
    checkpoint_dir: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> TransformerDecoder:
    """Build the checkpoint's model on meta and stream its weights onto ``device`` (in ``dtype``, or as stored)."""
    _, args = load_hf_config(checkpoint_dir)
    model = build_model_from_args(args)
    return load_hf_checkpoint(model, checkpoint_dir, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------------ saving
def save_hf_checkpoint(
    weights: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike | None = None,
    max_shard_size: int | str = "5GB",
    model_args: DecoderArgs | None = None,
) -> Path:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    Args:
        weights: a model, a state dict, or an iterable of ``(name, tensor)`` consumed one at a time. Names are
            mtune's (``layers.0.self_attn.q_proj.weight``) or already HF's (``model.``-prefixed).
        out_dir: created if needed; must not already hold weights.
        source_dir: the checkpoint these weights came from: its ``config.json`` is kept (its own field names; the
            ``dtype``/``torch_dtype`` field set to what was saved) and its tokenizer and generation files copied.
        max_shard_size: bytes or e.g. ``"5GB"``; one file without an index when everything fits.
        model_args: describes the model when there is no ``source_dir`` and ``weights`` is not a model.
    Tied models (``tie_word_embeddings``) do not write ``lm_head.weight``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")) or (out / INDEX_NAME).exists():
        raise CheckpointError(f"{out}: already holds model weights; save into an empty directory")
    if isinstance(weights, nn.Module):
        model_args = model_args or getattr(weights, "args", None)
        weights = weights.state_dict()
    items = weights.items() if isinstance(weights, Mapping) else weights
    if source_dir is not None:
        config = {k: v for k, v in read_hf_config(source_dir).items() if k != "quantization_config"}  # dequantized
        if config.get("text_config") is not None:  # a multimodal checkpoint: its text model is what was trained
            config = hf_config_from_model_args(load_hf_config(source_dir)[1])
    elif model_args is not None:
        config = hf_config_from_model_args(model_args)
    else:
        raise CheckpointError(f"{out}: pass source_dir (the checkpoint the weights came from) or model_args")
    tied = bool(config.get("tie_word_embeddings", False))
    layout = expert_layout(model_args if model_args is not None else model_args_from_hf_config(config)[1])

    max_bytes = parse_bytes(max_shard_size, "max_shard_size", message=_SHARD_SIZE_ERROR)
    writer, saved_dtype = ShardWriter(out, max_bytes), None

    def gathered():
        for name, tensor in items:
            key = hf_key(name)
            if tied and key == "lm_head.weight":
                continue
            tensor = tensor.detach()
            if hasattr(tensor, "full_tensor"):  # a DTensor shard: gather it (every rank must call this)
                tensor = tensor.full_tensor()
            yield key, tensor

    for key, piece in as_checkpoint_holds(gathered(), layout):
        if saved_dtype is None and piece.is_floating_point():
            saved_dtype = piece.dtype
        writer.add(key, piece.to("cpu").contiguous())
    writer.finish()

    if saved_dtype is not None:
        field = "dtype" if "dtype" in config else "torch_dtype"
        config[field] = _dtype_name(saved_dtype)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        for path in Path(source_dir).iterdir():
            if path.is_file() and path.suffix in _COPIED_SUFFIXES and path.name not in _NOT_COPIED:
                shutil.copy2(path, out / path.name)
    return out
