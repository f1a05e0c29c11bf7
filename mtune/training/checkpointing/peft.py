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

from mtune.errors import MtuneError
from mtune.modules.expert_layout import ExpertLayout, expert_key
from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.lora import LoRALinear
from mtune.modules.lora_experts_peft import EXPERT_PATTERN, expert_peft_config, peft_modules, per_expert_factors
from mtune.modules.lora_state import (
    adapter_config, adapter_mismatch, load_peft_adapter_state_dict, peft_adapter_state_dict, peft_module,
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

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_PARTS = {"lora_A": "a", "lora_B": "b", "lora_magnitude_vector": "magnitude"}  # peft_module's tensor names


class AdapterError(MtuneError, ValueError):
    """An adapter directory that cannot be read, or that does not fit the model; the message names file or field."""


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
def lora_layout(model: nn.Module) -> dict[str, Any]:
    """The LoRA settings a model was built with, read from its LoRALinear modules: ``modules`` (sorted HF names),
    ``rank``, ``alpha``, ``dropout``, ``use_dora``. Raises when the model has no adapter."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExpertLinear))]
    if not layers:
        raise AdapterError("the model has no LoRA adapter: build it with a lora node (lora.modules, lora.rank, ...)")
    first = layers[0][1]
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    return {
        "modules": sorted({name.rpartition(".")[2] for name, _ in layers}),
        "rank": first.rank,
        "alpha": first.alpha,
        "dropout": dropout,
        "use_dora": first.use_dora,
    }


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``adapter_dir``, checked to be a LoRA adapter mtune can represent."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{path}: not found; adapter_dir must be a PEFT adapter directory "
                           f"(adapter_config.json + {ADAPTER_WEIGHTS_NAME})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: invalid JSON ({e})") from None
    unsupported = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LoRA / DoRA adapters are supported"),
        "target_modules": (not isinstance(config.get("target_modules"), list),
                           "must be a list of module names (a regex is not supported)"),
        "rank_pattern": (set(config.get("rank_pattern") or {}) - EXPERT_PATTERN, "per-module ranks are not supported"),
        "alpha_pattern": (set(config.get("alpha_pattern") or {}) - EXPERT_PATTERN,
                          "per-module alphas are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "fully trained extra modules are not supported"),
        "bias": (config.get("bias", "none") != "none", "trained biases are not supported (need bias: none)"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights are not supported"),
        "r": (type(config.get("r")) is not int or config["r"] < 1, "must be a positive integer"),
        # peft's default alpha is 8
        "lora_alpha": (type(config.setdefault("lora_alpha", 8)) not in (int, float), "must be a number"),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            raise AdapterError(f"{path}: {field}={config.get(field)!r}: {why}")
    return config


def adapter_modules(config: Mapping[str, Any], where: str = "adapter_config.json", model_modules=()) -> list[str]:
    """``lora.modules`` of an adapter (:func:`~mtune.modules.lora_experts_peft.peft_modules`), errors naming it."""
    try:
        return peft_modules(config, model_modules)
    except ValueError as e:
        raise AdapterError(f"{where}: {e}") from None


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


def check_adapter_matches(config: Mapping[str, Any], layout: Mapping[str, Any], where: str = "adapter_dir") -> None:
    """Raise one line naming the first field where an adapter_config.json and a model's LoRA layout differ."""
    if config.get("use_rslora"):  # no lora.* setting gives it: mtune's LoRA layers scale by alpha / r
        raise AdapterError(f"{where}: adapter_config.json has use_rslora=true, which mtune's LoRA layers cannot load "
                           "(they scale by alpha/r)", "merge it into its base model (mtune run merge_lora) and use "
                           "the merged model")
    pairs = [
        ("r", config.get("r"), "lora.rank", layout["rank"]),
        ("lora_alpha", float(config.get("lora_alpha", 8)), "lora.alpha", float(layout["alpha"])),
        ("target_modules", adapter_modules(config, where, layout["modules"]), "lora.modules",
         sorted(layout["modules"])),
        ("use_dora", bool(config.get("use_dora", False)), "lora.use_dora", bool(layout["use_dora"])),
    ]
    for field, theirs, key, ours in pairs:
        if theirs != ours:
            raise AdapterError(
                f"{where}: adapter_config.json has {field}={theirs} but the model has {key}={ours}: "
                f"set {key} to match the adapter, or use an adapter trained with {key}={ours}"
            )


def _weights_path(adapter_dir: Path) -> Path:
    path = adapter_dir / ADAPTER_WEIGHTS_NAME
    if not path.is_file():
        found = sorted(p.name for p in adapter_dir.glob("adapter_model*"))
        hint = f" (found {', '.join(found)}; only safetensors is read)" if found else ""
        raise AdapterError(f"{path}: not found{hint}")
    return path


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by key, from the safetensors header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{path}: unreadable safetensors file ({e})") from None


def _check_tensors_match_config(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """Raise naming the first tensor of ``path`` that ``adapter_config.json`` does not describe: a module outside
    ``target_modules`` (or a target with no tensors), a rank other than ``r``, DoRA magnitudes without ``use_dora``
    (or missing with it), a lora_A without its lora_B."""
    def refuse(problem: str):
        raise AdapterError(f"{path}: {problem}", f"{ADAPTER_CONFIG_NAME} must be the one saved with these weights: "
                           "use that one, or correct its r / target_modules / use_dora")

    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    peft_names = {}  # mtune module name -> peft's (model.layers.0.self_attn.q_proj), which target_modules match
    for key, shape in shapes.items():
        if key.endswith(".base_layer.weight"):
            continue  # peft's copy of a targeted lm_head's base weight; the base model has it
        named = peft_module(key)
        if named is None:
            refuse(f"{key} is not a LoRA tensor (lora_A, lora_B or lora_magnitude_vector): mtune reads LoRA and DoRA "
                   "adapters only")
        modules.setdefault(named[0], {})[_PARTS[named[1]]] = shape
        peft_names[named[0]] = key.removeprefix("base_model.model.").rpartition(".lora_")[0]
    if not modules:
        refuse("holds no lora_A / lora_B tensors")
    rank, dora = config["r"], bool(config.get("use_dora"))
    targets = set(config.get("target_modules") or [])
    expert_params = {t.rpartition(".")[2] for t in config.get("target_parameters") or []}
    experts = [name for name in modules if expert_params and name.endswith((".experts", ".experts.base_layer"))]
    if expert_params and not experts:
        refuse(f"{ADAPTER_CONFIG_NAME} lists target_parameters {config['target_parameters']} but this file has no "
               "expert adapters")
    for name, parts in modules.items():
        if "a" not in parts or "b" not in parts:
            refuse(f"{name} has {'lora_A' if 'a' in parts else 'lora_B'} but no "
                   f"{'lora_B' if 'a' in parts else 'lora_A'}")
        a, b = parts["a"], parts["b"]
        if len(a) != 2 or len(b) != 2:
            refuse(f"lora_A and lora_B of {name} must be matrices, not of shapes {list(a)} and {list(b)}")
        if name in experts:  # all experts' factors stacked: lora_A [n_experts * r, in], lora_B [out, r * n_experts]
            param = "gate_up_proj" if name.endswith(".base_layer") or expert_params == {"gate_up_proj"} else "down_proj"
            r = (config.get("rank_pattern") or {}).get(param, rank)
            if a[0] % r or a[0] != b[1]:
                refuse(f"{ADAPTER_CONFIG_NAME} says rank {r} for the experts' {param} but lora_A of {name} has {a[0]} "
                       f"rows and lora_B {b[1]} columns (both must be the number of experts times the rank)")
            continue
        if not _targeted(peft_names[name], targets):
            refuse(f"{ADAPTER_CONFIG_NAME}'s target_modules {sorted(targets)} do not name {name}, but this file has "
                   "an adapter for it")
        if a[0] != rank:
            refuse(f"{ADAPTER_CONFIG_NAME} says r={rank} but lora_A of {name} has {a[0]} rows")
        if b[1] != rank:
            refuse(f"{ADAPTER_CONFIG_NAME} says r={rank} but lora_B of {name} has {b[1]} columns")
        if ("magnitude" in parts) != dora:
            refuse(f"{ADAPTER_CONFIG_NAME} says use_dora={str(dora).lower()} but {name} has "
                   f"{'no' if dora else 'a'} lora_magnitude_vector")
        if dora and parts["magnitude"] != (b[0],):
            refuse(f"lora_magnitude_vector of {name} has shape {list(parts['magnitude'])} but its lora_B has {b[0]} "
                   "rows")
    for target in sorted(targets):
        if not any(_targeted(peft_names[name], {target}) for name in modules if name not in experts):
            refuse(f"{ADAPTER_CONFIG_NAME} lists {target} in target_modules but this file has no {target} adapter")


def _targeted(peft_name: str, targets) -> bool:
    """Whether ``target_modules`` names a module, as peft matches them: the whole name or its last parts."""
    return any(peft_name == t or peft_name.endswith(f".{t}") for t in targets)


def check_adapter(adapter_dir: str | os.PathLike, model: nn.Module | None = None) -> dict[str, Any]:
    """Check a PEFT adapter directory before anything is loaded from it; returns its ``adapter_config.json``.

    Every adapter mtune loads or merges passes here (``lora.adapter_dir``, generate's ``adapter_dir``, merge_lora,
    resuming a LoRA run). :class:`AdapterError` names the file and the first disagreement, checked in this order:

    1. ``adapter_config.json`` against the tensors of ``adapter_model.safetensors`` (their keys and shapes, read
       from its header): ``target_modules``, ``r``, ``use_dora``, e.g. ``adapter_config.json says r=8 but lora_A of
       layers.0.self_attn.q_proj has 16 rows``.
    2. With ``model`` (transformed by ``apply_lora``; on the meta device or not): the config against the model's
       LoRA settings (:func:`check_adapter_matches`), then the tensors against its adapted modules and their shapes,
       e.g. an adapter trained on another base model (hidden size, layers).
    Merging compares the tensors with the base checkpoint itself (:mod:`mtune.training.checkpointing.merge`).
    """
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    path = _weights_path(adapter_dir)
    shapes = _tensor_shapes(path)
    _check_tensors_match_config(config, shapes, path)
    if model is not None:
        check_adapter_matches(config, lora_layout(model), where=str(adapter_dir))
        problem = adapter_mismatch(model, shapes)
        if problem:
            base = config.get("base_model_name_or_path")
            raise AdapterError(f"{path}: {problem}", "the adapter does not fit this model: set model.checkpoint_dir "
                               "to the base model it was trained on"
                               + (f" ({ADAPTER_CONFIG_NAME} names {base})" if base else ""))
    return config


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
    path = _weights_path(adapter_dir)
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
            parts.setdefault(named[0], {})[_PARTS[named[1]]] = tensor
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
