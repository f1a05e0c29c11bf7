"""A LoRA model's state as others read it: the adapter alone in mtune's names (:func:`lora_state_dict`) or in
PEFT's (:func:`peft_adapter_state_dict`, :func:`peft_key`; :func:`adapter_config` is the ``adapter_config.json``
that goes with it), checked against a model (:func:`adapter_mismatch`) and loaded back from PEFT's names
(:func:`load_peft_adapter_state_dict`), and the whole model with
every adapter folded into its base weight (:func:`merge_lora_weights`). The model is one :func:`apply_lora
<mtune.modules.lora.apply_lora>` transformed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from mtune.modules.expert_linear import ExpertLinear, LoRAExpertLinear
from mtune.modules.fp8_linear import is_fp8_stored, stored_weight
from mtune.modules.lora import ADAPTER_PARAM_NAMES, LoRALinear
from mtune.modules.lora_experts_peft import adapted_experts, expert_mtune_tensors, expert_peft_tensors
from mtune.modules.nf4_linear import dequantize

__all__ = [
    "lora_state_dict",
    "peft_key",
    "peft_adapter_state_dict",
    "peft_module",
    "adapter_mismatch",
    "load_peft_adapter_state_dict",
    "adapter_config",
    "merge_lora_weights",
]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter parameters only, with mtune's names (e.g. `layers.0.self_attn.q_proj.lora_a.weight`)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith(ADAPTER_PARAM_NAMES)}


_TO_PEFT = {"lora_a.weight": "lora_A.weight", "lora_b.weight": "lora_B.weight", "magnitude": "lora_magnitude_vector"}


def peft_key(key: str) -> str:
    """mtune's adapter key -> PEFT's (``layers.0.self_attn.q_proj.lora_a.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    module, _, _ = key.rpartition(".lora_") if ".lora_" in key else key.rpartition(".magnitude")
    suffix = key[len(module) + 1 :]
    prefix = "base_model.model." if module.startswith("lm_head") else "base_model.model.model."
    return f"{prefix}{module}.{_TO_PEFT[suffix]}"


def _expert_keys(model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{name}." for name, _ in adapted_experts(model))


def peft_adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter with PEFT's key names, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
    ready for `adapter_model.safetensors`; the experts' adapters as peft holds them on transformers 5's fused
    experts (`mtune.modules.lora_experts_peft`)."""
    experts = _expert_keys(model)
    plain = {peft_key(k): v for k, v in lora_state_dict(model).items() if not k.startswith(experts)}
    return {**plain, **expert_peft_tensors(model)}


def peft_module(key: str) -> tuple[str, str] | None:
    """(mtune module name, tensor) of a PEFT adapter key, the inverse of :func:`peft_key`:
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (``layers.0.self_attn.q_proj``,
    ``lora_A``); None for a key that is no LoRA tensor."""
    for suffix in _TO_PEFT.values():
        if key.endswith(f".{suffix}"):
            module = key[: -len(suffix) - 1].removeprefix("base_model.model.").removeprefix("model.")
            return module, suffix.removesuffix(".weight")
    return None


def _named(key: str) -> str:
    module = peft_module(key)
    return f"{module[1]} of {module[0]}" if module else key


def adapter_mismatch(model: nn.Module, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The first way a PEFT-named adapter (``shapes``: each tensor's shape by key) does not fit the LoRA layers of
    ``model`` (transformed by `apply_lora`; on the meta device or not), e.g. ``lora_A of layers.0.self_attn.q_proj
    has shape [8, 128] but the model's is [8, 256]``; None when every tensor the model needs is there with its
    shape, and no other. PEFT's copies of a targeted lm_head's base weight (``...base_layer.weight``) are ignored."""
    expected = {k: tuple(v.shape) for k, v in peft_adapter_state_dict(model).items()}  # in the model's order
    shapes = {k: tuple(v) for k, v in shapes.items() if not k.endswith(".base_layer.weight")}
    for key in shapes:
        if key not in expected:
            return f"the adapter has {_named(key)}, which the model does not adapt"
    for key, shape in expected.items():
        if key not in shapes:
            return f"the model adapts {peft_module(key)[0]} but the adapter has no {peft_module(key)[1]} for it"
        if shapes[key] != shape:
            return f"{_named(key)} has shape {list(shapes[key])} but the model's is {list(shape)}"
    return None


def load_peft_adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a PEFT-named adapter state dict into a model that `apply_lora` has already transformed; ValueError
    naming the first tensor that does not fit (:func:`adapter_mismatch`).

    Full base-layer copies that PEFT adds when lm_head is targeted (`...lm_head.base_layer.weight`) are ignored:
    the base weights come from the base model."""
    problem = adapter_mismatch(model, {k: v.shape for k, v in state_dict.items()})
    if problem:
        raise ValueError(f"adapter does not match the model's LoRA layers: {problem}")
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith(".base_layer.weight")}
    experts = expert_mtune_tensors(state_dict, model)  # takes the experts' entries out of state_dict
    by_peft_name = {peft_key(k): k for k in lora_state_dict(model) if not k.startswith(_expert_keys(model))}
    model.load_state_dict({**{by_peft_name[k]: v for k, v in state_dict.items()}, **experts}, strict=False)


def adapter_config(
    modules: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_dora: bool = False,
    base_model_name_or_path: str | None = None,
    experts: dict | None = None,
) -> dict:
    """The `adapter_config.json` contents PEFT needs to load `peft_adapter_state_dict`; ``experts``: the fields
    expert adapters add (`mtune.modules.lora_experts_peft.expert_peft_config`)."""
    return {**(experts or {}),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(modules)),
        "use_dora": use_dora,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


@torch.no_grad()
def merge_lora_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its base weight: plain tensors in the base dtype,
    no adapter keys, NF4 and fp8 weights dequantized (so the base is the stored, rounded one: exports from a base
    checkpoint merge into the original instead, `mtune.training.checkpointing.merge`). The model is not modified."""
    merged = {}
    modules = dict(model.named_modules())
    for key, value in model.state_dict().items():
        if key.endswith(ADAPTER_PARAM_NAMES):
            continue
        module = modules.get(key.rpartition(".")[0])
        if key.endswith(".weight") and isinstance(module, ExpertLinear):  # [n_experts, out, in], NF4 or not
            merged[key] = module.merged_weight() if isinstance(module, LoRAExpertLinear) else module.plain_weight()
        elif key.endswith(".weight") and isinstance(module, LoRALinear):
            merged[key] = module.merged_weight()
        elif key.endswith(".weight") and is_fp8_stored(module):
            merged[key] = stored_weight(module).detach()
        else:
            merged[key] = dequantize(value).detach()
    return merged

