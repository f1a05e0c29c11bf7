"""A PEFT adapter directory checked before anything is loaded from it or merged (``lora.adapter_dir``, generate's
``adapter_dir``, merge_lora, a LoRA run's resume): :func:`check_adapter` reads ``adapter_config.json``
(:func:`read_adapter_config`: a LoRA adapter mtune can represent) and the keys and shapes in the header of
``adapter_model.safetensors``, and refuses, in one line naming the file, the first way they disagree with each other
or with the model. :func:`refuse_adapter_dir` names an adapter directory given where a model belongs.
:mod:`mtune.training.checkpointing.peft` saves and loads the directories."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from mtune.errors import MtuneError
from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.lora import LoRALinear
from mtune.modules.lora_experts_peft import EXPERT_PATTERN, peft_modules
from mtune.modules.lora_state import adapter_mismatch, peft_module

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "LORA_PARTS", "AdapterError", "adapter_modules",
           "adapter_weights_path", "check_adapter", "check_adapter_matches", "lora_layout", "read_adapter_config",
           "refuse_adapter_dir"]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
LORA_PARTS = {"lora_A": "a", "lora_B": "b", "lora_magnitude_vector": "magnitude"}  # peft_module's tensor names


class AdapterError(MtuneError, ValueError):
    """An adapter directory that cannot be read, or that does not fit the model; the message names file or field."""


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


def adapter_weights_path(adapter_dir: Path) -> Path:
    """``adapter_dir``'s ``adapter_model.safetensors``; AdapterError when it is not there (naming what is)."""
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
        modules.setdefault(named[0], {})[LORA_PARTS[named[1]]] = shape
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
    path = adapter_weights_path(adapter_dir)
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


def refuse_adapter_dir(checkpoint_dir: str | os.PathLike, key: str, adapter_key: str = "adapter_dir") -> None:
    """Raise when ``checkpoint_dir``, the value of the config key ``key`` that wants a model, holds a PEFT adapter
    (``adapter_config.json``) instead, saying where it belongs (``adapter_key``); otherwise do nothing. Without it a
    user who swapped the two would be told the model is not downloaded."""
    config = Path(checkpoint_dir) / ADAPTER_CONFIG_NAME
    if not config.is_file():
        return
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None  # only for the hint
    raise AdapterError(f"{key}={checkpoint_dir} is a PEFT adapter directory ({config.name}), not a model",
                       f"set {adapter_key}={checkpoint_dir} and {key} to the adapter's base model"
                       + (f" ({config.name} names {base})" if base else ""))
