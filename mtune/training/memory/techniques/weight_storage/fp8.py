"""fp8 storage of the frozen linear weights inside the transformer blocks (``weight_storage_dtype``).

Which weights: every linear inside ``model.layers`` — the LoRA-adapted ones keep their adapters in the model dtype
and store only the frozen base in fp8 — except those whose module name matches a glob of
``weight_storage_skip_patterns``. Embeddings, norms and the output projection (``lm_head``) are never stored in fp8:
they are few bytes for their effect on the output. How a weight is stored and upcast: `mtune.modules.fp8_linear`.

Only frozen weights: a trainable weight stored in fp8 would lose every update smaller than its rounding step, so a
full fine-tune is refused (the validator says so before anything is built; this module checks again for callers
that skip the validator).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

from torch import nn

from mtune.config.errors import ConfigError
from mtune.modules.fp8_linear import (FP8_DTYPES, FrozenFp8Linear, has_fp8_storage, quantize_fp8_weight_,
                                      store_weight_as_fp8)
from mtune.modules.lora import LoRALinear, has_nf4_weight
from mtune.modules.moe import Router
from mtune.training.memory.technique import WeightPhases

__all__ = ["apply_fp8_weight_storage", "module_name_matches", "Fp8Weights"]

log = logging.getLogger(__name__)


def module_name_matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a module's name (mtune's ``layers.0.mlp.down_proj``, or as in the Hugging Face checkpoint,
    ``model.layers.0.mlp.down_proj``) matches any fnmatch glob in ``patterns``."""
    hf_name = name if name.startswith("lm_head") else f"model.{name}"
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(hf_name, p) for p in patterns)


def apply_fp8_weight_storage(model: nn.Module, dtype: str, skip_patterns: Sequence[str] = ()) -> list[str]:
    """Store the frozen linears of ``model.layers`` in ``dtype`` (``float8_e4m3fn`` or ``float8_e5m2``), in place;
    call after LoRA (adapters are applied first, so their base weights are frozen). Works on a meta-device model
    (weights are quantized once loaded: `mtune.training.model_setup`). Returns the names of the stored modules.

    Raises ConfigError for an unknown dtype, a trainable weight among those to store, or a skip pattern that
    matches no linear layer (a typo would otherwise silently store everything).
    """
    if dtype not in FP8_DTYPES:
        raise ConfigError(f"weight_storage_dtype must be one of {', '.join(FP8_DTYPES)} or null, got {dtype!r}")
    torch_dtype = FP8_DTYPES[dtype]
    # an MoE router (an nn.Linear subclass) is not stored: routing stays in the model's dtype
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, Router) and not _inside_adapter(name)}
    unmatched = [p for p in skip_patterns if not any(module_name_matches(name, [p]) for name in linears)]
    if unmatched:
        raise ConfigError(f"weight_storage_skip_patterns {unmatched} match no linear layer; module names look like "
                          "model.layers.0.self_attn.q_proj (or layers.0.self_attn.q_proj): e.g. 'model.layers.0.*'")
    stored = []
    for name, module in linears.items():
        if not name.startswith("layers.") or module_name_matches(name, skip_patterns) or has_fp8_storage(module):
            continue
        if has_nf4_weight(module):
            raise ConfigError(f"weight_storage_dtype={dtype} cannot be combined with lora.quantize_base=true ({name} is "
                              "NF4): set one of weight_storage_dtype=null or lora.quantize_base=false")
        if module.weight.requires_grad:
            raise ConfigError(f"weight_storage_dtype={dtype} stores frozen weights, but {name}.weight is trainable "
                              "(a full fine-tune): use a LoRA recipe (lora node), or set weight_storage_dtype=null")
        if isinstance(module, LoRALinear):
            store_weight_as_fp8(module, torch_dtype)  # the base only; its adapter stays in the model dtype
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, FrozenFp8Linear.from_linear(module, torch_dtype))
        stored.append(name)
    log.info("weight storage: %d linear weights stored as %s (%d skipped by weight_storage_skip_patterns)",
             len(stored), dtype, sum(module_name_matches(n, skip_patterns) for n in linears))
    return stored


def _inside_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ("lora_a", "lora_b")


class Fp8Weights(WeightPhases):
    """fp8 storage's weight phase: each marked frozen weight is stored in fp8 as it arrives (the model never holds
    the blocks' weights whole in the compute dtype)."""

    def arrived(self, model: nn.Module, module: nn.Module) -> None:
        quantize_fp8_weight_(module)
