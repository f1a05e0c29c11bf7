"""PEFT adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``, as Hugging Face PEFT writes
them, so ``peft.PeftModel.from_pretrained(base_model, adapter_dir)`` loads what mtune saves and mtune loads what
PEFT saves.

- :func:`save_peft_adapter` writes a LoRA / DoRA model's adapter (the base weights are not written).
- :func:`load_peft_adapter` loads an adapter directory into a model that already has the same LoRA layout
  (``lora.adapter_dir``: start training from an existing adapter); a layout that disagrees is refused with one line
  naming the field.
- :func:`check_adapter` is the check every adapter that is loaded or merged passes first: ``adapter_config.json``
  against the tensors' keys and shapes, and both against the model.
- :func:`read_adapter` / :func:`adapter_from_model` give an :class:`Adapter` (A, B, scaling, DoRA magnitude per
  adapted linear), the form :mod:`mtune.training.checkpointing.merge` folds into base weights.

Key names are PEFT's: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``lora_B``,
``lora_magnitude_vector`` for DoRA; ``base_model.model.lm_head....`` for the output projection).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtune.modules.expert_layout import ExpertLayout, expert_key
from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.lora import LoRALinear
from mtune.modules.lora_experts_peft import expert_peft_config, per_expert_factors
from mtune.modules.lora_state import adapter_config, load_peft_adapter_state_dict, peft_adapter_state_dict, peft_module
from mtune.training.checkpointing.adapter_check import (  # the check, and the names peft.py has always exported
    ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, LORA_PARTS, AdapterError, adapter_modules, adapter_weights_path,
    check_adapter, check_adapter_matches, lora_layout, read_adapter_config,
)
from mtune.training.checkpointing.manifest import write_safetensors

__all__ = [
    "lora_node_from_adapter",
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "Adapter",
    "AdapterLayer",
    "AdapterError",
    "adapter_from_model",
    "check_adapter",
    "check_adapter_matches",
    "load_peft_adapter",
    "lora_layout",
    "read_adapter",
    "read_adapter_config",
    "save_peft_adapter",
]


@dataclass
class AdapterLayer:
    """One adapted linear: ``a`` [rank, in], ``b`` [out, rank], ``scaling`` (alpha / rank), DoRA ``magnitude``
    [out] or None."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    magnitude: torch.Tensor | None = None


@dataclass
class Adapter:
    """An adapter as a map from mtune module name (``layers.0.self_attn.q_proj``, ``lm_head``) to its layer."""

    layers: dict[str, AdapterLayer]


def _plain(value: Any) -> Any:
    # OmegaConf nodes and typed configs (LoraConfig) -> plain containers, so all are read the same way.
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor shard is gathered (collective: every rank must call this)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ------------------------------------------------------------------------------------------------------ layout


def lora_node_from_adapter(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``lora`` config node that rebuilds the adapters of a saved PEFT adapter (its modules, rank, alpha and
    DoRA; no dropout, a full-precision base) and loads them from ``adapter_dir``, e.g. for generation. The adapter
    is checked first (:func:`check_adapter`), so one whose files disagree is refused before a model is built."""
    config = check_adapter(adapter_dir)
    return dict(modules=adapter_modules(config), rank=config["r"], alpha=config["lora_alpha"], dropout=0.0,
                use_dora=bool(config.get("use_dora", False)), quantize_base=False, adapter_dir=str(adapter_dir))

def _scaling(config: Mapping[str, Any]) -> float:
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank


# ------------------------------------------------------------------------------------------------------ save
def save_peft_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    lora_cfg: Mapping[str, Any] | None = None,
    base_model_name_or_path: str | os.PathLike | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for the model's LoRA / DoRA adapter.

    Args:
        model: a model transformed by ``apply_lora``; its adapter tensors are saved in their own dtype. With FSDP
            the adapter is gathered (every rank must call this) and rank 0 writes it.
        out_dir: created if needed.
        lora_cfg: the config's ``lora`` node; only ``dropout`` is taken from it (rank, alpha, modules and DoRA are
            read from the model itself, and must agree with it).
        base_model_name_or_path: recorded in ``adapter_config.json`` (the base checkpoint directory or hub id).
    The directory loads with ``peft.PeftModel.from_pretrained(base, out_dir)``.
    """
    layout = lora_layout(model)
    lora_cfg = _plain(lora_cfg) or {}
    for key in ("rank", "alpha", "use_dora"):
        if key in lora_cfg and lora_cfg[key] is not None and lora_cfg[key] != layout[key]:
            raise AdapterError(f"lora.{key}={lora_cfg[key]} but the model's adapters have {key}={layout[key]}")
    dropout = float(lora_cfg.get("dropout") or layout["dropout"])
    experts = expert_peft_config(model)
    if experts:
        dropout = 0.0  # peft refuses dropout on parameter targets; it acts in training only
    tensors = {k: _full(v).to("cpu").contiguous() for k, v in peft_adapter_state_dict(model).items()}
    out = Path(out_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return out  # the gathers above needed every rank; rank 0 writes
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / ADAPTER_WEIGHTS_NAME, metadata={"format": "pt"})  # hashed as written
    dense = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoRALinear)})
    config = adapter_config(dense, layout["rank"], layout["alpha"], dropout=dropout, experts=experts,
                            use_dora=layout["use_dora"],
                            base_model_name_or_path=None if base_model_name_or_path is None else str(base_model_name_or_path))
    (out / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------------------------------------------ load
def _read_adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    path = adapter_weights_path(adapter_dir)
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{path}: unreadable safetensors file ({e})") from None


@torch.no_grad()
def load_peft_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """Load a PEFT adapter directory into ``model``'s LoRALinear modules (in place; returns the model).

    The model must already carry the adapter's layout (``apply_lora`` with the same modules, rank, alpha and DoRA
    setting) and the adapter must fit it (:func:`check_adapter`); otherwise :class:`AdapterError` names the first
    field or tensor that differs, e.g. ``adapter_config.json has r=16 but the model has lora.rank=8``. Tensors are
    cast to the model's adapter dtype. Call it on an unsharded model (before FSDP) after the base weights and
    ``reset_lora_parameters``.
    """
    adapter_dir = Path(adapter_dir)
    check_adapter(adapter_dir, model)
    try:
        load_peft_adapter_state_dict(model, _read_adapter_tensors(adapter_dir))
    except ValueError as e:  # what shapes cannot show: expert adapters mtune cannot represent
        raise AdapterError(f"{adapter_dir / ADAPTER_WEIGHTS_NAME}: {e}") from None
    return model


def read_adapter(adapter_dir: str | os.PathLike, layout: ExpertLayout = ExpertLayout.PER_EXPERT) -> Adapter:
    """An :class:`Adapter` from a PEFT directory (tensors as stored; rsLoRA scaling alpha/sqrt(r) honoured); expert
    adapters one layer per expert and projection as the base checkpoint's ``layout`` family names them
    (:func:`~mtune.modules.lora_experts_peft.per_expert_factors`). The directory is checked first
    (:func:`check_adapter`: its config against its tensors)."""
    adapter_dir = Path(adapter_dir)
    config = check_adapter(adapter_dir)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_adapter_tensors(adapter_dir).items():
        named = peft_module(key)
        if named is not None:
            parts.setdefault(named[0], {})[LORA_PARTS[named[1]]] = tensor
    scaling = _scaling(config)
    layers = {name: AdapterLayer(*factors) for name, factors in per_expert_factors(parts, config, layout).items()}
    layers.update((name, AdapterLayer(p["a"], p["b"], scaling, p.get("magnitude"))) for name, p in parts.items())
    return Adapter(layers)


def adapter_from_model(model: nn.Module) -> Adapter:
    """The live model's adapters (no copies, except the gather of FSDP shards: every rank must call this then)."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRAExpertLinear):  # one layer per expert, as the checkpoint holds the weights
            a, b = _full(module.lora_a.weight), _full(module.lora_b.weight)
            layers.update((expert_key(f"{name}.weight", e).removesuffix(".weight"),
                           AdapterLayer(a[e], b[e], module.scaling)) for e in range(module.n_experts))
        elif isinstance(module, LoRALinear):
            magnitude = None if module.magnitude is None else _full(module.magnitude)
            layers[name] = AdapterLayer(_full(module.lora_a.weight), _full(module.lora_b.weight), module.scaling,
                                        magnitude)
    if not layers:
        raise AdapterError("the model has no LoRA adapter to export")
    return Adapter(layers)
