"""Frozen linear layers whose weight is stored as 4-bit NormalFloat (NF4), as in QLoRA.

torchao's `NF4Tensor` stores a weight in 4-bit codes with one scale per 64 values (the scales themselves quantized
to 8 bits per 256), about 0.26x the bytes of bf16. The forward dequantizes to the weight's original dtype and runs a
normal matmul, so compute happens in the model dtype. NF4 weights are frozen: they never receive gradients.

torchao needs each weight's element count divisible by 16384 (`quantize_nf4` says so when it is not); the tiny test
models are sized for it. Under FSDP2 a weight whose 256-scale blocks do not split over the ranks quantizes its scales
in smaller blocks (`dense_scaler_block`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from mtune.config.errors import ConfigError
from mtune.modules.nf4_dequantize import dequantize_nf4

__all__ = ["FrozenNF4Linear", "FrozenNF4Matmul", "is_nf4", "quantize_nf4", "quantize_nf4_expert_shard",
           "dense_scaler_block", "dequantize", "linear_maybe_nf4", "nf4_part", "nf4_row_chunk"]

# torchao >= 0.18 keeps NF4 under quantize_.workflows, older versions under dtypes
_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")
_nf4: ModuleType | None = None  # torchao's NF4 module, once imported


def _nf4_api() -> ModuleType:
    """torchao's NF4 module, imported on first use: importing torchao loads torch._dynamo (~85 MiB of resident
    memory and about a second), which runs without NF4 weights never need. Kept in a module global (not a cache
    wrapper), so torch.compile traces a plain attribute read here instead of breaking the graph on the import."""
    global _nf4
    if _nf4 is None:
        for name in _NF4_MODULES:
            try:
                _nf4 = importlib.import_module(name)
                break
            except ImportError:
                continue
        else:
            raise ImportError(f"torchao provides none of {_NF4_MODULES}: QLoRA needs torchao (pip install torchao)")
    return _nf4


def is_nf4(tensor: torch.Tensor) -> bool:
    if _nf4 is None:
        # no NF4 weight was made here yet, so torchao's module may not be imported: ask the class where it lives.
        # (Not sys.modules: torch.compile guards on its length, and every later import recompiled each block.)
        return type(tensor).__module__ in _NF4_MODULES
    return isinstance(tensor, _nf4.NF4Tensor)


def nf4_tensor_class() -> type | None:
    """torchao's ``NF4Tensor`` once an NF4 weight was made in this process, else None (no import for it)."""
    return None if _nf4 is None else _nf4.NF4Tensor


def quantize_nf4(weight: torch.Tensor, ranks: int = 1) -> nn.Parameter:
    """Returns a frozen Parameter holding `weight` as NF4 (dequantizes back to `weight.dtype`). A 3-D weight (every
    expert's copy of a projection) is quantized as its 2-D ``[-1, in]`` rows: torchao's NF4 takes 2-D only; each
    expert must then be a whole number of second-level scale blocks (:func:`nf4_part` splits by expert), so its
    scaler block is the largest power of two up to 256 that divides an expert's scale count (gpt-oss's 2880 x 5760
    experts: 128; 2880 x 2880: 64), torchao's 256 wherever that fits. A 2-D weight that FSDP2 splits by rows over
    ``ranks`` has the scaler block :func:`dense_scaler_block` gives (256 on one device)."""
    scaler_block = NF4_SCALER_BLOCK
    if weight.dim() > 2:
        scaler_block = _expert_scaler_block(weight)
        weight = weight.reshape(-1, weight.shape[-1])
    elif weight.numel() % 16384 != 0:
        raise ConfigError(
            f"NF4 needs a weight whose element count is divisible by 16384; got shape {tuple(weight.shape)}: "
            "pick model sizes with larger or rounder linear layers, or set lora.quantize_base=false"
        )
    else:
        scaler_block = dense_scaler_block(weight.shape, ranks)
    if is_fake(weight):  # mtune plan: no values to quantize, only torchao's layout to build
        return nn.Parameter(_nf4_layout(weight.detach(), scaler_block), requires_grad=False)
    return nn.Parameter(_nf4_api().to_nf4(weight.detach(), NF4_BLOCK, scaler_block), requires_grad=False)


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
"""Values per scale and scales per second-level scale: torchao's ``to_nf4`` defaults, which `quantize_nf4` uses."""


def dense_scaler_block(shape: tuple[int, ...] | torch.Size, ranks: int = 1) -> int:
    """The scaler block (scales per 8-bit second-level block) of a 2-D NF4 weight ``[out, in]`` that FSDP2 splits
    by rows over ``ranks``: each rank's rows must hold whole second-level blocks (FSDP2 splits the codes, the
    scales and the blocks' factors alike), so torchao's 256 where the scales of ``out / ranks`` rows divide by it,
    else the largest power of two that divides them: gpt-oss's ``[512, 2880]`` k_proj and v_proj on 8 ranks, 2880
    scales a rank, 64; Gemma 4 26B-A4B's ``[2112, 2816]`` MLP on 2 ranks, 46464 scales a rank, 128. Smaller blocks
    only make the scales' own quantization finer (a factor per block more), but they are other values than one
    device's 256 give: the run's log says which weights. ConfigError where the rows or the 64-value blocks do not
    split."""
    rows, cols = shape
    if rows % ranks:
        raise ConfigError(f"an NF4 weight {list(shape)}: its {rows} rows do not split evenly over {ranks} ranks: "
                          "launch a number of processes that divides them, or set lora.quantize_base=false")
    if rows // ranks * cols % NF4_BLOCK:
        raise ConfigError(f"an NF4 weight {list(shape)}: a rank's {rows // ranks} rows are not whole {NF4_BLOCK}-value "
                          f"blocks over {ranks} ranks: launch fewer processes, or set lora.quantize_base=false")
    scales = rows // ranks * cols // NF4_BLOCK
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % b == 0)


def _expert_scaler_block(weight: torch.Tensor) -> int:
    """The scaler block of a 3-D expert stack ``[n_experts, out, in]`` (see :func:`quantize_nf4`)."""
    per_expert = weight[0].numel()
    if per_expert % NF4_BLOCK:
        raise ConfigError(f"NF4 needs each expert's weights to be a multiple of {NF4_BLOCK} values; got "
                          f"{tuple(weight.shape[1:])}: set lora.quantize_base=false")
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if per_expert // NF4_BLOCK % b == 0)


@torch.no_grad()
def quantize_nf4_expert_shard(local: torch.Tensor, group) -> torch.Tensor:
    """This rank's experts ``local [n_experts / ranks, out, in]`` of an expert stack split by expert over the
    process ``group`` (equal shares, in rank order) as the NF4 rows ``quantize_nf4(whole)`` gives this rank
    (:func:`nf4_row_chunk`), bit for bit, though no rank reads another's experts. A collective: every rank calls it.

    Codes and 64-value scales are per block, so this rank's own; the 8-bit quantization of the scales centres them
    on the mean of the whole stack's, taken here over the scales all-gathered from the ranks (1/32 of the experts'
    bytes in the weight dtype); each second-level block of 256 (or fewer) scales lies inside one expert.
    """
    nf4 = _nf4_api()
    experts, out, inp = local.shape
    scaler_block = _expert_scaler_block(local)
    flat = local.detach().contiguous().reshape(-1)
    scales = nf4.get_block_absmax(flat, NF4_BLOCK)  # torchao's first-level scales of these blocks, [n / 64]
    every = [torch.empty_like(scales) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, scales, group=group)
    mean = torch.cat(every).mean()  # torchao's scaler_mean: the same tensor, the same reduction
    centred = scales - mean
    blocks = centred.numel() // scaler_block
    factor = 256 / (2 * nf4.get_block_absmax(centred, scaler_block))  # per second-level block
    quantized = (centred.view(blocks, scaler_block) * factor[:, None]).round().clamp(-128, 127)
    table = _nf4_table(local.dtype, local.device)
    codes = nf4.NF4Tensor.convert_to_norm_float_weight(flat, flat.numel() // NF4_BLOCK, NF4_BLOCK, table)
    rows = torch.Size([experts * out, inp])
    meta = nf4.SubclassTensorArgs(rows, (inp, 1), 0, local.dtype, local.device, False)
    # n_blocks as the whole weight's: a chunk of it keeps that count, and FSDP2's all-gather passes it on
    return nf4.NF4Tensor(meta, NF4_BLOCK, len(every) * flat.numel() // NF4_BLOCK, scaler_block,
                         quantized.flatten().to(torch.int8), factor.contiguous(), mean, codes, nf4=table)


def _nf4_table(dtype: torch.dtype, device) -> torch.Tensor:
    """torchao's 16 NF4 values in ``dtype`` on ``device``, as ``to_nf4`` makes them (read off a tiny quantization:
    torchao builds the table inside ``from_tensor``)."""
    return _nf4_api().to_nf4(torch.ones(NF4_BLOCK * NF4_SCALER_BLOCK, dtype=dtype, device=device)).nf4


def _nf4_layout(weight: torch.Tensor, scaler_block: int = NF4_SCALER_BLOCK) -> torch.Tensor:
    """An NF4Tensor laid out as ``to_nf4(weight)`` lays it out (the same inner tensors, shapes and dtypes: a test
    compares them), with uninitialised values: what a fake weight quantizes to, without the quantization's dozens
    of ops per weight (a quarter of a QLoRA plan's time when they ran on fake tensors)."""
    nf4 = _nf4_api()
    n = weight.numel()
    blocks = n // NF4_BLOCK

    def empty(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=weight.device)

    meta = nf4.SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), weight.dtype,
                                  weight.device, weight.requires_grad)
    return nf4.NF4Tensor(meta, NF4_BLOCK, blocks, scaler_block,
                         empty(blocks, torch.int8),                       # quantized_scalers
                         empty(blocks // scaler_block, weight.dtype),     # quantization_factor
                         empty((), weight.dtype),                         # scaler_mean
                         empty(n // 2, torch.uint8),                      # quantized_data: two codes a byte
                         nf4=empty(16, weight.dtype))                     # the 16 NF4 values


def nf4_row_chunk(weight: torch.Tensor, chunks: int, index: int) -> torch.Tensor:
    """Rows ``index`` of ``chunks`` of an NF4 weight, as ``fully_shard`` splits it, in memory of its own.

    NF4Tensor's ``chunk`` returns views of the whole weight's codes and scales (one rank's shard would keep the
    whole weight alive), and its ``clone`` re-quantizes against the shard's own scales (other values); this
    copies the shard's codes and scales as they are.
    """
    nf4 = _nf4_api()
    piece = torch.chunk(weight, chunks, dim=0)[index]
    owned = {name: getattr(piece, name).clone() for name in ("quantized_scalers", "quantization_factor",
                                                             "quantized_data")}
    return nf4.NF4Tensor(*nf4.construct_nf4_args(piece, owned))


def nf4_part(weight: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rows block ``index`` of ``parts`` equal blocks of an NF4 weight: a view of its codes and scales, as
    ``torch.chunk(weight, parts)[index]`` gives it, without building the other ``parts - 1`` blocks."""
    nf4 = _nf4_api()
    own = {name: getattr(weight, name).view(parts, -1)[index] for name in ("quantized_scalers", "quantization_factor",
                                                                           "quantized_data")}
    own["size"] = torch.Size([weight.shape[0] // parts, *weight.shape[1:]])
    return nf4.NF4Tensor(*nf4.construct_nf4_args(weight, own))


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor for `weight`, NF4 or not (NF4 comes back in its original dtype; on CUDA through one compiled
    kernel, :mod:`~mtune.modules.nf4_dequantize`)."""
    return dequantize_nf4(weight) if is_nf4(weight) else weight


class FrozenNF4Matmul(torch.autograd.Function):
    """``x @ weight.T`` for a frozen NF4 ``weight``, eager: saves the NF4 weight, not its dequantized copy, and
    dequantizes it again in backward for the input's gradient (torchao's ``linear_nf4`` does the same with its
    eager dequantization; this one goes through :func:`dequantize`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, dequantize(weight).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ dequantize(weight).to(grad.dtype), None


def _dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


def linear_maybe_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T without bias, for a plain or NF4 weight.

    Eager, an NF4 weight goes through :class:`FrozenNF4Matmul`. Compiled, an autograd function hides its dequantized
    weight from the partitioner badly (torchao's ``linear_nf4`` did: without checkpointing the graph saved every
    dequantized weight for backward, a bf16 copy of the frozen model, and with checkpointing on torch 2.11 the
    linears' outputs as well; 8B QLoRA on an H100 saved 34 GiB where bf16 LoRA saved 2.2 GiB, docs/benchmarks.md).
    So under compile the dequantization is a checkpointed region of its own, recomputed from the NF4 weight in
    backward, and the matmul is a plain one."""
    if not is_nf4(weight):
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return F.linear(x, checkpoint(_dequantized, weight, x.dtype, use_reentrant=False))
    return FrozenNF4Matmul.apply(x, weight)


class FrozenNF4Linear(nn.Linear):
    """A bias-free-or-not linear layer with a frozen weight, stored as NF4 once real weights are present.

    Built from an `nn.Linear` with `from_linear`. On the meta device the weight stays a plain (meta) tensor until
    `quantize_()` is called after the real weights are loaded; `mtune.modules.lora.reset_lora_parameters` does that.
    State-dict keys are `weight` / `bias`, as for `nn.Linear` (of which it is a subclass, so model-wide init code
    still reaches the weight before it is quantized), and checkpoints load unchanged.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: the weight is adopted, not allocated
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if not weight.is_meta:
            self.quantize_()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FrozenNF4Linear":
        return cls(linear.weight, linear.bias)

    def quantize_(self) -> None:
        """Converts the weight to NF4 in place (no-op when it already is)."""
        if not is_nf4(self.weight) and not self.weight.is_meta:
            self.weight = quantize_nf4(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear_maybe_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4={is_nf4(self.weight)}"
