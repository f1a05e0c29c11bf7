"""fp8 storage of the frozen linear weights inside the blocks (``weight_storage_dtype``): 1 byte a weight instead
of 2, upcast to the compute dtype just before each matmul. The implementation:
`mtune.training.memory.weight_storage` (which weights) and `mtune.modules.fp8_linear` (how they are stored)."""

from __future__ import annotations

from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["WeightStorage", "WEIGHT_STORAGE", "WEIGHT_STORAGE_DTYPES"]

WEIGHT_STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
"""The values of ``weight_storage_dtype`` (torch dtype names), besides null."""


class WeightStorage(MemoryTechnique):
    name = "weight_storage_dtype"
    keys = (
        Key("weight_storage_dtype", str, None,
            "store the frozen linear weights inside the blocks in this fp8 format (one fp32 scale per output row) "
            "and upcast each to the compute dtype just before use; LoRA recipes only (null: as dtype)",
            choices=WEIGHT_STORAGE_DTYPES),
        Key("weight_storage_skip_patterns", list, [],
            "fnmatch globs on module names (model.layers.0.* or layers.0.*) whose weights keep the model dtype"),
    )
    from_yaml = {"weight_storage_skip_patterns": lambda patterns: tuple(patterns or ())}  # frozen in MemoryConfig
    must_match_on_resume = ("weight_storage_dtype", "weight_storage_skip_patterns")  # every later step computes
    # with the fp8-rounded weights
    fit_knob = "lora_method"  # fp8 is a level of the frozen base's storage, beside NF4 (lora.quantize_base)
    fit_saves_floor_only = True

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.weight_storage_dtype is not None

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        from mtune.training.memory.weight_storage import apply_fp8_weight_storage

        apply_fp8_weight_storage(model, memory.weight_storage_dtype, memory.weight_storage_skip_patterns)

    def describe(self, memory: Any, lora: Any = None) -> str:
        return str(memory.weight_storage_dtype)

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """The frozen base's storage, a level each: the model dtype, fp8 (0.5x bf16, ~1% off in logits), NF4
        (0.27x, ~20%; ``lora.quantize_base``). Only with a frozen base (a lora node)."""
        if cfg.get("lora") is None:
            return [FitChoice(0, {})]
        # lossy relative to the user's own base: nothing is given up by a base at least as precise as theirs
        theirs = 2 if get(cfg, "lora.quantize_base", False) else 1 if get(cfg, "weight_storage_dtype") else 0
        return [FitChoice(0, {"lora.quantize_base": False, "weight_storage_dtype": None}),
                FitChoice(1, {"lora.quantize_base": False, "weight_storage_dtype": "float8_e4m3fn"},
                          lossy="fp8 base weights" if theirs < 1 else None, quality_cost=3),
                FitChoice(2, {"lora.quantize_base": True, "weight_storage_dtype": None},
                          lossy="NF4 base weights" if theirs < 2 else None, quality_cost=5)]

    def rules(self, cfg: Any) -> list[str]:
        """fp8 storage is for frozen weights: it needs adapters to train (a full fine-tune updates every weight, and
        an fp8 copy cannot take small updates), and it is one storage choice, so not together with NF4."""
        dtype = get(cfg, "weight_storage_dtype")
        problems = [f"weight_storage_skip_patterns: each entry must be a string glob such as 'model.layers.0.*', "
                    f"got {p!r}" for p in get(cfg, "weight_storage_skip_patterns", []) if not isinstance(p, str)]
        if dtype is None:
            return problems
        if get(cfg, "lora") is None:
            problems.append(f"weight_storage_dtype={dtype} stores frozen weights, but this config has no lora node (a "
                            "full fine-tune trains every weight): add a lora node (a LoRA recipe), or set "
                            "weight_storage_dtype=null")
        elif get(cfg, "lora.quantize_base", False):
            problems.append(f"weight_storage_dtype={dtype} cannot be combined with lora.quantize_base=true (the base "
                            "weights are stored either as fp8 or as NF4): set one of weight_storage_dtype=null or "
                            "lora.quantize_base=false")
        return problems

    def distributed_rules(self, cfg: Any) -> list[str]:
        """fp8 storage keeps a per-row scale beside each weight; FSDP2 sharding and sharded loading do not handle
        it yet."""
        dtype = get(cfg, "weight_storage_dtype")
        if dtype is None:
            return []
        return [f"weight_storage_dtype={dtype} is not supported by the distributed recipes yet (FSDP2 shards the "
                "weights but not their fp8 scales): set weight_storage_dtype=null (lora.quantize_base=true gives "
                "4-bit bases that FSDP2 shards), or train on one device"]

    def lossy(self, cfg: Any) -> str | None:
        return None if get(cfg, "weight_storage_dtype") is None else "fp8 base weights"


WEIGHT_STORAGE = WeightStorage()
