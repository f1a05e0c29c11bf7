"""NF4 dequantization on CUDA as one compiled kernel, bit for bit the values of torchao's eager
``NF4Tensor.get_original_weight``.

Eager, torchao dequantizes in about twenty ops and widens the 4-bit codes to int64 on the way (transients several
times the bf16 result). On an H100 that made one 8B block's seven frozen matmuls take 2.08x the time of the bf16
matmuls, against 1.26x with the dequantization compiled (docs/benchmarks.md, "NF4 matmul kernels"), and it is most of
a Qwen3-30B-A3B QLoRA step, which dequantizes every expert three times. So an eager QLoRA run (``compile: false``) on
CUDA dequantizes in two parts: torchao dequantizes the block scales (one value per 64 weights) with its own eager
ops, and :func:`decode` (torchao's decoding of the codes: each byte's two 4-bit codes looked up in the 16-value
table, scaled by their block's scale, interleaved) runs as one kernel compiled per weight shape on first use (seconds
of the first step), which allocates only its result. The split keeps the values torchao's on every torch: compiled
whole, Inductor before torch 2.13 rounds the scales' division and sum once instead of twice (a bf16 step off on a
fifth of the values, torch 2.11). Inside torch.compile'd code the dequantization is traced with the rest, and on the
CPU torchao's ops run as they are (compiling there needs a C++ toolchain, and the CPU runs are the tests'). Under a
Python dispatch mode (the byte tracker of ``plan_check``'s first steps) the kernel runs with the mode set aside, as
dynamo compiles only then (a compile declined under a mode is never tried again), and the mode is shown its result.
Where the kernel cannot be built, the run's log says why once and torchao's ops run.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["COMPILED_ON_CUDA", "KERNEL_SHAPES", "compiled_dequantization_applies", "decode", "decodes_alone",
           "dequantize_nf4", "planning_decodes_alone"]

log = logging.getLogger("mtune")

COMPILED_ON_CUDA = True
"""Whether NF4 weights on CUDA dequantize through the compiled kernel (False: torchao's eager ops; the GPU suite's
twin rows set it to measure one against the other)."""

_kernel = None  # the compiled decode, built on first use

KERNEL_SHAPES = 64
"""Weight shapes the kernel may compile for in one process (one compile each, at static shapes). Dynamo's own limit
per function is 8, fewer than the NF4 shapes of a hybrid or mixture-of-experts model (attention, expert parts, other
layer kinds); past its limit a ``fullgraph`` compile raises, which would send every later weight to torchao's ops."""


def compiled_dequantization_applies(weight: torch.Tensor) -> bool:
    """Whether :func:`dequantize_nf4` takes the compiled kernel for ``weight``: a real CUDA weight, outside compiled
    code (the planner models the kernel itself: ``mtune.training.planning.replay``)."""
    return (COMPILED_ON_CUDA and weight.device.type == "cuda" and not torch.compiler.is_compiling()
            and not is_fake(weight))


_PLANNED_ALONE = [False]  # set while the planner plans a run that dequantizes through the kernel


def decodes_alone(weight: torch.Tensor) -> bool:
    """Whether dequantizing ``weight`` allocates only its result (and its block scales, 1/64 of it): through the
    compiled kernel (:func:`compiled_dequantization_applies`), or, for the planner's fake weights, in a run the planner
    plans as one that does (:func:`planning_decodes_alone`). Otherwise torchao's ops hold int64 codes beside it."""
    return _PLANNED_ALONE[0] if is_fake(weight) else compiled_dequantization_applies(weight)


@contextlib.contextmanager
def planning_decodes_alone(alone: bool):
    """While inside, :func:`decodes_alone` answers ``alone`` for fake weights (the planner's, for its target)."""
    before, _PLANNED_ALONE[0] = _PLANNED_ALONE[0], alone
    try:
        yield
    finally:
        _PLANNED_ALONE[0] = before


def _under_dispatch_mode() -> bool:
    """Whether a Python dispatch mode is active (mtune's byte tracker in ``plan_check``'s first steps). Dynamo does
    not compile under one: a ``fullgraph`` compile raises there, and the function is then never compiled again."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _set_aside(modes: bool):
    """The active dispatch modes set aside while inside (when ``modes``), so that dynamo compiles the kernel."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes() if modes else contextlib.nullcontext()


def decode(codes: torch.Tensor, table: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """torchao's decoding of NF4 codes: ``codes`` uint8 ``[n / 2]`` (two 4-bit codes a byte, the first in the high
    bits), ``table`` the 16 NF4 values, ``scales`` ``[n / block]`` (one per block, already dequantized) -> ``shape``
    in the table's dtype, each value its code's table entry times its block's scale."""
    half_block = codes.numel() // scales.numel()
    repeated = scales.unsqueeze(-1).expand(scales.numel(), half_block).flatten()
    first, second = table[(codes >> 4).long()] * repeated, table[(codes & 0b1111).long()] * repeated
    return torch.stack([first, second], dim=-1).reshape(shape)


def dequantize_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 ``weight``'s values as a plain tensor of its original dtype and shape."""
    global _kernel, COMPILED_ON_CUDA
    if not compiled_dequantization_applies(weight):
        return weight.get_original_weight()
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)
    if _kernel is None:
        _kernel = torch.compile(decode, dynamic=False, fullgraph=True)
    tracked = _under_dispatch_mode()
    # set and restored by hand: config.patch costs ~0.15 ms a call here, and this runs for every weight of every step
    limit, torch._dynamo.config.recompile_limit = torch._dynamo.config.recompile_limit, KERNEL_SHAPES
    try:
        with _set_aside(tracked):
            out = _kernel(weight.quantized_data, weight.nf4, scales, tuple(weight.shape))
        # the mode (the byte tracker) did not see the kernel allocate: a view made under it shows it the result
        return out.view(out.shape) if tracked else out
    except torch.OutOfMemoryError:  # the step's, not the kernel's: out-of-memory handling and recovery take it
        raise
    except Exception as error:  # no Triton, a compiler failure: the eager ops give the same values, more slowly
        COMPILED_ON_CUDA = False
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.warning("NF4 dequantization could not be compiled on %s (%s): torchao's eager ops run instead",
                    weight.device, first_line)
        return weight.get_original_weight()
    finally:
        torch._dynamo.config.recompile_limit = limit
