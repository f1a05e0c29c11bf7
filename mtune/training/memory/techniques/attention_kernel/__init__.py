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
from dataclasses import dataclass
from typing import Any

from mtune.config.keys import ATTENTION_KERNELS
from mtune.training.memory.technique import MemoryTechnique, ModelFacts, Settings, advice, setting

__all__ = ["AttentionKernel", "ATTENTION_KERNEL", "AttentionKernelSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionKernelSettings(Settings):
    attention_kernel: str = setting(
        "auto", "packed rows: segments (document boundaries, O(s) memory: SDPA per document on CPU, varlen flash on "
        "CUDA), dense_mask (a [b, 1, s, s] mask, s² bytes a row: the fallback), or auto (the dense mask up to 256 "
        "tokens a row, segments beyond)", choices=ATTENTION_KERNELS)


class AttentionKernel(MemoryTechnique):
    name = "attention_kernel"
    Settings = AttentionKernelSettings

    def enabled(self, s: AttentionKernelSettings, memory: Any) -> bool:
        return True  # the model is told the choice even when it is the default

    def length_overrides(self, s: AttentionKernelSettings, memory: Any, facts: ModelFacts, any_length: bool) -> dict:
        """The dense mask grows as s²: long rows take the segments kernel (the same numbers), written as it is."""
        return {"attention_kernel": "segments"} if any_length and s.attention_kernel == "dense_mask" else {}

    def oom_advice(self, s: AttentionKernelSettings, memory: Any) -> list[tuple[int, str]]:
        """The dense mask of packed rows costs s² bytes a row (1 GiB at 32K tokens)."""
        if memory.run.packed and s.attention_kernel == "dense_mask":
            return [advice("dense_mask", "attention_kernel=auto")]
        return []

    def on_model(self, model: Any, s: AttentionKernelSettings, memory: Any, placement: Any) -> None:
        from mtune.modules.gated_deltanet import GatedDeltaNet
        from mtune.modules.gated_deltanet_fla import KERNEL_RUNS, recurrence_runs
        from mtune.modules.packed_attention import kernel_for

        model.attention_kernel = s.attention_kernel
        param = next(model.parameters())
        device = placement.compute if placement is not None else param.device
        if s.attention_kernel != "dense_mask":
            runs = kernel_for(device, param.dtype, model.args.sliding_window)
            log.info("attention_kernel=%s: packed rows%s run %s on %s", s.attention_kernel,
                     " over 256 tokens" if s.attention_kernel == "auto" else "", runs, device)
        if any(isinstance(m, GatedDeltaNet) for m in model.modules()):  # linear attention has kernels of its own
            runs = recurrence_runs(device)
            log.info("Gated DeltaNet layers: the recurrence runs %s on %s", runs, device)
            if runs == KERNEL_RUNS:  # an H100's first step took minutes (docs/models.md)
                log.info("the first steps compile and autotune flash-linear-attention's Triton kernels: minutes on "
                         "a machine whose Triton cache does not hold them yet, seconds after")


ATTENTION_KERNEL = AttentionKernel()
