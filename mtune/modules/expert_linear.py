"""Every expert's copy of one projection in one 3-D parameter, and its LoRA adapter.

:class:`ExpertLinear` holds ``weight [n_experts, out, in]`` (``bias [n_experts, out]`` when biased): one tensor per
projection per layer instead of ``n_experts`` ``nn.Linear`` modules, so a 128-expert layer is 3 parameters, not 384
(what made planning Qwen3-30B-A3B on fake tensors slow), the grouped kernel reads the weights in place, and FSDP2's
``Shard(0)`` splits them by expert. How a family's checkpoints lay them out (one key per expert, whole and
transposed, or gate and up side by side) and the translation both ways: :mod:`mtune.modules.expert_layout`.

Under QLoRA the frozen weight is stored as one NF4 tensor of the ``[n_experts * out, in]`` rows (torchao quantizes
2-D tensors only). Each 64-value block, its codes and its scale lie inside one expert (``out * in`` is a multiple of
16384), so expert ``e`` is the ``e``-th of ``n_experts`` row blocks (:func:`~mtune.modules.nf4_linear.nf4_part`),
dequantized alone. Only the mean the scales are centred on before their own 8-bit quantization is the projection's
rather than the expert's, so values differ from quantizing each expert apart by a rounding of the scales. Under
FSDP2 the weight is held as those rows before sharding (:meth:`ExpertLinear.hold_nf4_rows_`), each rank keeping its
experts' rows of the whole projection's NF4 tensor.

:class:`LoRAExpertLinear` adds per-expert low-rank factors ``lora_a.weight [n_experts, rank, in]`` and
``lora_b.weight [n_experts, out, rank]`` (expert ``e``: ``y = x W_e^T + s (x A_e^T) B_e^T``, ``s = alpha / rank``).
DoRA is not offered on experts.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from mtune.config.errors import ConfigError
from mtune.modules.nf4_dequantize import decodes_alone
from mtune.modules.nf4_linear import dequantize, is_nf4, linear_maybe_nf4, nf4_part, quantize_nf4

__all__ = ["DEQUANTIZE_PARTS", "STACK_WHOLE_WHERE_ALONE", "ExpertLinear", "LoRAExpertLinear"]

DEQUANTIZE_PARTS = 8
"""How many calls :meth:`ExpertLinear.stacked` dequantizes an NF4 projection in where torchao's ops do it (the CPU,
or CUDA without the compiled kernel). While they run they hold the codes as int64 (8 bytes a value) beside their bf16
products, several times the 2-byte result, so a whole projection at once would raise a large MoE's peak by
gigabytes; one call per expert is ``n_experts`` small calls, which left Qwen3-30B-A3B's QLoRA without one finished
step in minutes on an H100. An eighth at a time keeps the transient near the result's own size, in 8 calls. The
compiled kernel allocates only its result, so there a projection is dequantized whole, in one call and no copy."""

STACK_WHOLE_WHERE_ALONE = True
"""Whether :meth:`ExpertLinear.stacked` dequantizes a projection whole where that allocates only the result (False:
by parts everywhere, as before 2026-11-27; the GPU suite's twin row sets it to measure one against the other)."""


def _nf4_parts_traceable() -> bool:
    """Whether an NF4 weight's parts (:func:`~mtune.modules.nf4_linear.nf4_part`) can be built here: not while
    torch.compile traces (dynamo fails building NF4 tensors of symbolic sizes, torch 2.13 / torchao 0.18), where a
    projection is dequantized whole instead."""
    return not torch.compiler.is_compiling()


class _Factor(nn.Module):
    """A holder for one low-rank factor, so its parameter is named ``lora_a.weight`` / ``lora_b.weight`` as a
    ``LoRALinear``'s are (the names the adapter checks and exports key on)."""

    def __init__(self, shape: tuple[int, ...], device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class ExpertLinear(nn.Module):
    """``n_experts`` linear maps ``in_features -> out_features``: ``weight [n_experts, out, in]``.

    ``nf4``: store the frozen weight as NF4 once it is loaded (:meth:`quantize_`; set by ``apply_lora`` with
    ``quantize_base``). :meth:`pieces` and :meth:`run` compute one expert's rows; the grouped kernel reads
    :meth:`stacked`.
    """

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(n_experts, out_features, device=device, dtype=dtype)) if bias
                     else None)
        self.nf4 = False

    def initializers(self, std: float = 0.02):
        """``(name, fill)`` as ``TransformerDecoder.initializers`` lists them: normal weights, zero biases."""
        yield "weight", functools.partial(nn.init.normal_, std=std)
        if self.bias is not None:
            yield "bias", nn.init.zeros_

    def quantize_(self) -> None:
        """Store the weight as NF4 (``[n_experts * out, in]``) when marked ``nf4``; no-op otherwise or on meta."""
        if self.nf4 and not is_nf4(self.weight) and not self.weight.is_meta:
            self.weight = quantize_nf4(self.weight.view(self.weight_shape))  # by expert, also when held as rows

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """``(n_experts, out, in)``: the weight as checkpoints and initializers hold it, whatever form it is stored
        in (NF4, or its ``[n_experts * out, in]`` rows under FSDP2: :meth:`hold_nf4_rows_`)."""
        return self.n_experts, self.out_features, self.in_features

    def hold_nf4_rows_(self) -> None:
        """Hold a weight marked ``nf4`` and not yet stored as the ``[n_experts * out, in]`` rows its NF4 form has
        (on meta or not), before FSDP2 shards it: FSDP2 keeps the shape it shards (its shards, padding and
        all-gathers) and torchao's NF4 is 2-D only. Its ``Shard(0)`` then splits the rows by expert all the same."""
        if self.nf4 and not is_nf4(self.weight) and self.weight.dim() == 3:
            weight = self.weight
            self.weight = nn.Parameter(weight.detach().reshape(-1, self.in_features),
                                       requires_grad=weight.requires_grad)

    def plain_weight(self) -> torch.Tensor:
        """The weight as a plain ``[n_experts, out, in]`` tensor (NF4 dequantized: a new tensor)."""
        return dequantize(self.weight).view(self.n_experts, self.out_features, self.in_features)

    def stacked(self) -> torch.Tensor:
        """The weight for ``torch._grouped_mm``, ``[n_experts, out, in]``: the parameter itself when plain (no copy);
        when NF4 a new tensor, dequantized whole where that allocates only the result (the compiled kernel:
        :func:`~mtune.modules.nf4_dequantize.decodes_alone`), else an eighth of the experts at a time
        (:data:`DEQUANTIZE_PARTS`)."""
        if (not is_nf4(self.weight) or not _nf4_parts_traceable()  # (compiling: before decodes_alone's is_fake)
                or STACK_WHOLE_WHERE_ALONE and decodes_alone(self.weight)):
            return self.plain_weight()
        parts = math.gcd(self.n_experts, DEQUANTIZE_PARTS)
        out = torch.empty(self.weight_shape, dtype=self.weight.dtype, device=self.weight.device)
        for index, rows in enumerate(out.chunk(parts)):
            rows.copy_(dequantize(nf4_part(self.weight, parts, index)).view(rows.shape))
            if isinstance(out, FakeTensor):  # planning: alike parts, each freed before the next, one gives the peak
                break  # (the type, not is_fake: torch.compile traces with fake tensors and needs every part)
        return out

    def pieces(self) -> list[tuple]:
        """Each expert's tensors, split once per forward (``unbind``: autograd then writes one gradient of the whole
        parameter, not one per expert): ``(weight [out, in] or its NF4 rows, bias [out] or None)``."""
        if is_nf4(self.weight) and _nf4_parts_traceable():
            weights = [nf4_part(self.weight, self.n_experts, e) for e in range(self.n_experts)]
        elif is_nf4(self.weight):
            weights = self.plain_weight().unbind(0)
        else:
            weights = self.weight.unbind(0)
        biases = self.bias.unbind(0) if self.bias is not None else [None] * self.n_experts
        return list(zip(weights, biases))

    def piece(self, expert: int) -> tuple:
        """Expert ``expert``'s tensors alone, as :meth:`pieces` gives them (for frozen weights: indexing a trainable
        one would give it a whole-parameter gradient per expert)."""
        weight = (nf4_part(self.weight, self.n_experts, expert) if is_nf4(self.weight) else self.weight[expert])
        return weight, None if self.bias is None else self.bias[expert]

    def run(self, x: torch.Tensor, piece: tuple) -> torch.Tensor:
        """One expert's rows ``x [rows, in]`` -> ``[rows, out]``."""
        weight, bias = piece[:2]
        out = linear_maybe_nf4(x, weight)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4={self.nf4}")


class LoRAExpertLinear(ExpertLinear):
    """:class:`ExpertLinear` with a LoRA adapter per expert (``lora_a.weight [E, rank, in]``, ``lora_b.weight
    [E, out, rank]``); while ``adapters_enabled`` is false it is its base."""

    adapters_enabled = True
    use_dora = False

    def __init__(self, base: ExpertLinear, rank: int, alpha: float, dropout: float = 0.0, use_dora: bool = False,
                 quantize_base: bool = False):
        if use_dora:
            raise ConfigError("lora.use_dora=true: DoRA is not offered on experts (nor by peft on 3-D expert "
                              "parameters): remove gate_proj/up_proj/down_proj from lora.modules or set use_dora=false")
        nn.Module.__init__(self)
        self.n_experts, self.in_features, self.out_features = base.n_experts, base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # adopted, not copied
        self.nf4 = base.nf4 or quantize_base
        self.quantize_base = self.nf4
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_a = _Factor((self.n_experts, rank, self.in_features), **factory)
        self.lora_b = _Factor((self.n_experts, self.out_features, rank), **factory)
        self.magnitude = None

    @staticmethod
    def adapter_initializers():
        """``(name, fill)`` of the factors in draw order: each expert's A Kaiming-uniform (as a ``[rank, in]``
        LoRALinear's A), B zeros."""
        def kaiming(t):
            for matrix in t:
                nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        return [("lora_a.weight", kaiming), ("lora_b.weight", nn.init.zeros_)]

    @torch.no_grad()
    def reset_adapter(self) -> None:
        for name, fill in self.adapter_initializers():
            fill(self.get_parameter(name))
        self.quantize_()

    def pieces(self) -> list[tuple]:
        if not self.adapters_enabled:
            return super().pieces()
        return [(*base, a, b) for base, a, b in zip(super().pieces(), self.lora_a.weight.unbind(0),
                                                    self.lora_b.weight.unbind(0))]

    def run(self, x: torch.Tensor, piece: tuple) -> torch.Tensor:
        out = super().run(x, piece)
        if len(piece) == 2:
            return out
        a, b = piece[2:]
        return torch.addmm(out, self.dropout(x) @ a.t(), b.t(), alpha=self.scaling)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W_e + s B_e A_e`` for every expert, ``[n_experts, out, in]`` in the base dtype (computed in fp32)."""
        base = self.plain_weight()
        delta = torch.bmm(self.lora_b.weight.float(), self.lora_a.weight.float())
        return (base.float() + self.scaling * delta).to(base.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"
