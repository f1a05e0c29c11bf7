"""NF4 dequantization on CUDA as one compiled kernel: torchao's own ``NF4Tensor.get_original_weight`` under
``torch.compile`` (Inductor), with ``emulate_precision_casts`` so that its values are bit for bit the eager ones.

Eager, torchao dequantizes in about twenty ops and widens the 4-bit codes to int64 on the way (transients several
times the bf16 result). On an H100 that made one 8B block's seven frozen matmuls take 2.08x the time of the bf16
matmuls, against 1.26x with the dequantization compiled (docs/benchmarks.md, "NF4 matmul kernels"), and it is most of
a Qwen3-30B-A3B QLoRA step, which dequantizes every expert three times. So an eager QLoRA run (``compile: false``) on
CUDA dequantizes through this kernel: one compilation per weight shape on first use (seconds), then one kernel per
call that allocates only its result. Inside torch.compile'd code the dequantization is traced with the rest, and on
the CPU torchao's ops run as they are (compiling there needs a C++ toolchain, and the CPU runs are the tests'). Where
the kernel cannot be built, the run's log says why once and torchao's ops run.
"""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["COMPILED_ON_CUDA", "dequantize_nf4", "compiled_dequantization_applies"]

log = logging.getLogger("mtune")

COMPILED_ON_CUDA = True
"""Whether NF4 weights on CUDA dequantize through the compiled kernel (False: torchao's eager ops; the GPU suite's
twin rows set it to measure one against the other)."""

_kernel = None  # the compiled get_original_weight, built on first use


def compiled_dequantization_applies(weight: torch.Tensor) -> bool:
    """Whether :func:`dequantize_nf4` takes the compiled kernel for ``weight``: a CUDA weight, outside compiled
    code."""
    return COMPILED_ON_CUDA and weight.device.type == "cuda" and not torch.compiler.is_compiling()


def _original_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.get_original_weight()


def dequantize_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 ``weight``'s values as a plain tensor of its original dtype and shape. A planner's fake weight on CUDA
    gets the kernel's one allocation, its result (its values are never read)."""
    global _kernel, COMPILED_ON_CUDA
    if not compiled_dequantization_applies(weight):
        return weight.get_original_weight()
    if is_fake(weight):
        return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if _kernel is None:
        _kernel = torch.compile(_original_weight, dynamic=False, fullgraph=True,
                                options={"emulate_precision_casts": True})
    try:
        return _kernel(weight)
    except Exception as error:  # no Triton, a compiler failure: the eager ops give the same values, more slowly
        COMPILED_ON_CUDA = False
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.warning("NF4 dequantization could not be compiled on %s (%s): torchao's eager ops run instead",
                    weight.device, first_line)
        return weight.get_original_weight()
