"""fp8 storage of the frozen linear weights inside the blocks (``weight_storage_dtype``): 1 byte a weight instead
of 2, upcast to the compute dtype just before each matmul. The implementation: `fp8` beside this declaration
(which weights) and `mtune.modules.fp8_linear` (how they are stored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Settings,
                                             setting)

__all__ = ["WeightStorage", "WEIGHT_STORAGE", "WeightStorageSettings", "WEIGHT_STORAGE_DTYPES"]

WEIGHT_STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
"""The values of ``weight_storage_dtype`` (torch dtype names), besides null."""


@dataclass(frozen=True)
class WeightStorageSettings(Settings):
    weight_storage_dtype: str | None = setting(
        None, "store the frozen linear weights inside the blocks in this fp8 format (one fp32 scale per output row) "
        "and upcast each to the compute dtype just before use; LoRA recipes only (null: as dtype)",
        choices=WEIGHT_STORAGE_DTYPES, must_match_on_resume=True)  # later steps compute with fp8-rounded weights
    weight_storage_skip_patterns: tuple[str, ...] = setting(
        [], "fnmatch globs on module names (model.layers.0.* or layers.0.*) whose weights keep the model dtype",
        must_match_on_resume=True)


class WeightStorage(MemoryTechnique):
    name = "weight_storage_dtype"
    Settings = WeightStorageSettings
    # fp8 is a level of the frozen base's storage, beside NF4 (lora.quantize_base)
    fit_knob = FitKnob("lora_method", floor_only=True)

    def enabled(self, s: WeightStorageSettings, memory: Any) -> bool:
        return s.weight_storage_dtype is not None

    def rules(self, s: WeightStorageSettings, memory: Any) -> list[str]:
        """fp8 storage is for frozen weights: it needs adapters to train (a full fine-tune updates every weight, and
        an fp8 copy cannot take small updates), and it is one storage choice, so not together with NF4. FSDP2
        sharding and sharded loading do not handle its per-row scales yet."""
        dtype = s.weight_storage_dtype
        problems = [f"weight_storage_skip_patterns: each entry must be a string glob such as 'model.layers.0.*', "
                    f"got {p!r}" for p in s.weight_storage_skip_patterns if not isinstance(p, str)]
        if dtype is None:
            return problems
        if memory.lora is None:
            problems.append(f"weight_storage_dtype={dtype} stores frozen weights, but this config has no lora node (a "
                            "full fine-tune trains every weight): add a lora node (a LoRA recipe), or set "
                            "weight_storage_dtype=null")
        elif memory.lora.quantize_base:
            problems.append(f"weight_storage_dtype={dtype} cannot be combined with lora.quantize_base=true (the base "
                            "weights are stored either as fp8 or as NF4): set one of weight_storage_dtype=null or "
                            "lora.quantize_base=false")
        if memory.distributed:
            problems.append(f"weight_storage_dtype={dtype} is not supported by the distributed recipes yet (FSDP2 "
                            "shards the weights but not their fp8 scales): set weight_storage_dtype=null "
                            "(lora.quantize_base=true gives 4-bit bases that FSDP2 shards), or train on one device")
        return problems

    def footprint(self, s: WeightStorageSettings, memory: Any, facts: ModelFacts) -> Footprint:
        if s.weight_storage_dtype is None:
            return Footprint()
        return Footprint(shapes_parameters=True, lossy="fp8 base weights")

    def fit_choices(self, s: WeightStorageSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """The frozen base's storage, a level each: the model dtype, fp8 (0.5x bf16, ~1% off in logits), NF4
        (0.27x, ~20%; ``lora.quantize_base``). Only with a frozen base (a lora node)."""
        if memory.lora is None:
            return [FitChoice(0, {})]
        # lossy relative to the user's own base: nothing is given up by a base at least as precise as theirs
        theirs = 2 if memory.lora.quantize_base else 1 if s.weight_storage_dtype else 0
        return [FitChoice(0, {"lora.quantize_base": False, "weight_storage_dtype": None}),
                FitChoice(1, {"lora.quantize_base": False, "weight_storage_dtype": "float8_e4m3fn"},
                          lossy="fp8 base weights" if theirs < 1 else None, quality="fp8_base"),
                FitChoice(2, {"lora.quantize_base": True, "weight_storage_dtype": None},
                          lossy="NF4 base weights" if theirs < 2 else None, quality="nf4_base")]

    def on_model(self, model: Any, s: WeightStorageSettings, memory: Any, placement: Any) -> None:
        from mtune.training.memory.techniques.weight_storage.fp8 import apply_fp8_weight_storage

        apply_fp8_weight_storage(model, s.weight_storage_dtype, s.weight_storage_skip_patterns)

    def weights(self, s: WeightStorageSettings) -> Any:
        from mtune.training.memory.techniques.weight_storage.fp8 import Fp8Weights

        return Fp8Weights()


WEIGHT_STORAGE = WeightStorage()
