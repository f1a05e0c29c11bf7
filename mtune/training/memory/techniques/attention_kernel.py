"""How packed rows (and rows longer than a sliding window) tell attention what each token may see
(``attention_kernel``): segment boundaries, O(s) memory (``segments``: exact SDPA per document on the CPU, varlen
flash on CUDA), or a dense boolean ``[b, 1, s, s]`` mask, s² bytes a row (``dense_mask``, the fallback); ``auto``
keeps the dense mask for rows of at most 256 tokens and uses segments beyond. All give the same numbers
(round-off). Unpacked rows without a window take SDPA's causal path whatever the key says. The implementation:
`mtune.modules.packed_attention` (the kernels) and `TransformerDecoder.attention_kernel` (the choice).

A top-level key rather than one of the ``model`` node: it changes how a step computes, not which model is trained,
so a resumed run may change it (``model`` must match as a whole), and the planner, ``--fit`` and the out-of-memory
advice see it as a technique, beside the others that trade the activation term."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import MemoryTechnique

__all__ = ["AttentionKernel", "ATTENTION_KERNEL", "ATTENTION_KERNEL_CHOICES"]

ATTENTION_KERNEL_CHOICES = ("auto", "segments", "dense_mask")
"""The values of ``attention_kernel``: `mtune.modules.transformer.ATTENTION_KERNELS` (a test checks they agree)."""

log = logging.getLogger(__name__)


class AttentionKernel(MemoryTechnique):
    name = "attention_kernel"
    keys = (
        Key("attention_kernel", str, "auto",
            "packed rows: segments (document boundaries, O(s) memory: SDPA per document on CPU, varlen flash on "
            "CUDA), dense_mask (a [b, 1, s, s] mask, s² bytes a row: the fallback), or auto (the dense mask up to "
            "256 tokens a row, segments beyond)", choices=ATTENTION_KERNEL_CHOICES),
    )

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return True  # the model is told the choice even when it is the default

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        from mtune.modules.packed_attention import kernel_for

        model.attention_kernel = memory.attention_kernel
        if memory.attention_kernel != "dense_mask":
            param = next(model.parameters())
            device = placement.compute if placement is not None else param.device
            runs = kernel_for(device, param.dtype, model.args.sliding_window)
            log.info("attention_kernel=%s: packed rows%s run %s on %s", memory.attention_kernel,
                     " over 256 tokens" if memory.attention_kernel == "auto" else "", runs, device)

    def describe(self, memory: Any, lora: Any = None) -> str:
        return memory.attention_kernel

    def for_any_length(self, cfg: Any) -> dict:
        """The dense mask grows as s²: long rows take the segments kernel (the same numbers)."""
        return {"attention_kernel": "segments"} if cfg.get("attention_kernel") == "dense_mask" else {}

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        """The dense mask of packed rows costs s² bytes a row (1 GiB at 32K tokens)."""
        packed = bool((cfg.get("dataset") or {}).get("packed"))
        if packed and cfg.get("attention_kernel") == "dense_mask":
            return [(5, "attention_kernel=auto")]
        return []


ATTENTION_KERNEL = AttentionKernel()
