"""Frozen linear weights stored in fp8 and upcast to the compute dtype just before use.

A weight W [out, in] is stored as one fp8 code per value plus one fp32 scale per output row:

    scale_r = max_j |W_rj| / fp8_max          (fp8_max: 448 for float8_e4m3fn, 57344 for float8_e5m2)
    code_rj = fp8(W_rj / scale_r)             (round to nearest)
    W'_rj   = code_rj * scale_r               (upcast at compute, in the activations' dtype)

so each row uses the whole fp8 range and a row of large values cannot crush a row of small ones. Storage is one
byte per value plus 4 bytes per row: 0.50x bf16 and 0.25x fp32, plus 4/in_features bytes per value for the
scales. float8_e4m3fn keeps 3 mantissa bits (relative rounding error up to 1/16, ~1/32 on average), float8_e5m2
keeps 2 bits and more exponent range; e4m3 is the better choice for weights.

The matmul itself runs in the compute dtype (no fp8 kernels are needed, so it works on any device, the CPU
included). :func:`fp8_linear` is an autograd function that keeps only the fp8 codes and scales for backward and
upcasts again there: the full-precision copy of a weight exists for one layer at a time, never until backward.

The weights are frozen (LoRA's base): they never receive gradients. The scales are a non-persistent buffer
``weight_scale``, so state-dict keys stay ``weight`` / ``bias`` and Hugging Face checkpoints load unchanged; a
loaded weight is quantized when :func:`quantize_fp8_weight_` is called on its module (`mtune.training.model_setup`
does it as each tensor arrives, so the full-precision model never exists at once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FP8_DTYPES",
    "FrozenFp8Linear",
    "quantize_fp8",
    "dequantize_fp8",
    "fp8_linear",
    "store_weight_as_fp8",
    "quantize_fp8_weight_",
    "has_fp8_storage",
    "is_fp8_stored",
    "stored_weight",
]

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
"""``weight_storage_dtype`` names -> torch dtypes."""


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: ``weight`` [out, in] as ``dtype`` codes [out, in] and fp32 row scales [out, 1]."""
    w = weight.detach().float()
    fp8_max = torch.finfo(dtype).max
    scale = (w.abs().amax(dim=1, keepdim=True) / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (w / scale).clamp(-fp8_max, fp8_max).to(dtype)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in ``dtype``. Every fp8 code is exact in bf16/fp16/fp32; the scale and the product are
    rounded to ``dtype`` (exact in fp32; within 2 ulps of bf16, far below fp8's own rounding), and the temporary is
    one weight in ``dtype``, not in fp32."""
    return codes.to(dtype) * scale.to(dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x W'^T with W' upcast from fp8 in forward and again in backward; no gradient for the frozen weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(codes, scale)
        return F.linear(x, dequantize_fp8(codes, scale, x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        codes, scale = ctx.saved_tensors
        return grad_out @ dequantize_fp8(codes, scale, grad_out.dtype), None, None


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W'^T`` (no bias) for a weight stored as ``codes`` and row ``scale``, computed in ``x``'s dtype."""
    return _Fp8Linear.apply(x, codes, scale)


# ----------------------------------------------------------------------------------------- a module's storage
def store_weight_as_fp8(module: nn.Module, dtype: torch.dtype) -> None:
    """Mark ``module`` (an ``nn.Linear`` whose weight is frozen) to keep its weight in ``dtype``: adds the
    ``weight_scale`` buffer and quantizes at once when the weight is real; on the meta device the weight stays as it
    is until :func:`quantize_fp8_weight_` (after loading)."""
    weight = module.weight
    module.weight_storage_dtype = dtype
    module.weight_compute_dtype = weight.dtype  # what a dequantized copy (an export) comes back as
    module.register_buffer("weight_scale", torch.empty(weight.shape[0], 1, device=weight.device), persistent=False)
    module.register_load_state_dict_pre_hook(_quantize_incoming_weight)
    quantize_fp8_weight_(module)


@torch.no_grad()
def _quantize_incoming_weight(module, state_dict, prefix, *args) -> None:
    # load_state_dict with a full-precision weight (a checkpoint's) into a quantized module: quantize it, rather than
    # let copy_ cast the values to fp8 without their scales.
    key = prefix + "weight"
    if is_fp8_stored(module) and key in state_dict and state_dict[key].dtype != module.weight_storage_dtype:
        codes, scale = quantize_fp8(state_dict[key], module.weight_storage_dtype)
        state_dict[key] = codes
        module.weight_scale.copy_(scale)


def has_fp8_storage(module: nn.Module) -> bool:
    """Whether ``module`` keeps (or will keep, once loaded) its weight in fp8."""
    return getattr(module, "weight_storage_dtype", None) is not None


def is_fp8_stored(module: nn.Module) -> bool:
    """Whether ``module.weight`` holds fp8 codes now."""
    return has_fp8_storage(module) and module.weight.dtype == module.weight_storage_dtype


@torch.no_grad()
def quantize_fp8_weight_(module: nn.Module) -> None:
    """Quantize a marked module's real, full-precision weight to fp8 in place (no-op otherwise)."""
    if not has_fp8_storage(module) or is_fp8_stored(module) or module.weight.is_meta:
        return
    module.weight_compute_dtype = module.weight.dtype
    codes, scale = quantize_fp8(module.weight, module.weight_storage_dtype)
    module.weight = nn.Parameter(codes, requires_grad=False)
    module.weight_scale = scale


def stored_weight(module: nn.Module) -> torch.Tensor:
    """``module.weight`` as a plain tensor in its original dtype (fp8 storage dequantized; others as they are)."""
    if is_fp8_stored(module):
        return dequantize_fp8(module.weight, module.weight_scale, module.weight_compute_dtype)
    return module.weight


class FrozenFp8Linear(nn.Linear):
    """A linear layer with a frozen weight stored in fp8 (see the module docstring), upcast to the input's dtype
    at each call. Built from an ``nn.Linear`` with :meth:`from_linear` (on meta too: quantized once loaded).
    State-dict keys are ``weight`` (the fp8 codes once quantized) and ``bias``, as for ``nn.Linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        nn.Module.__init__(self)  # not nn.Linear.__init__: the weight is adopted, not allocated
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        store_weight_as_fp8(self, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "FrozenFp8Linear":
        return cls(linear.weight, linear.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_linear(x, self.weight, self.weight_scale) if is_fp8_stored(self) else F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.weight_storage_dtype}"
