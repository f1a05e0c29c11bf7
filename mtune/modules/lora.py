"""LoRA and DoRA adapters, applied as a transform over any built model by module name.

LoRA (Hu et al. 2021) freezes a linear layer's weight W and learns a low-rank update:

    y = x W^T + b + s * B(A(dropout(x))),    A: [rank, in], B: [out, rank], s = alpha / rank

A starts Kaiming-uniform and B at zero, so the adapted model starts equal to the base model.

DoRA (Liu et al. 2024) splits the adapted weight into a direction and a learned magnitude m (one value per output
row, named `lora_magnitude_vector` in PEFT):

    W' = m * (W + s B A) / ||W + s B A||_row,   with the norm treated as a constant (detached), as PEFT does.

m starts at ||W||_row, so DoRA also starts equal to the base model. Both follow PEFT's definitions exactly, so
an adapter saved in PEFT's names (`mtune.modules.lora_state`) loads in `peft.PeftModel.from_pretrained`.

With `quantize_base=True` (QLoRA) the frozen base weights are stored as NF4 (`mtune.modules.nf4_linear`); every
other nn.Linear inside `model.layers` becomes a `FrozenNF4Linear` too, so all frozen projections are 4-bit. A base
may instead be stored in fp8 (`mtune.training.memory.techniques.weight_storage.fp8`, after `apply_lora`);
`LoRALinear.base_weight` reads whichever storage the base has.

Order of use on a meta-device model: build on meta -> `apply_lora` -> `to_empty` -> load base weights ->
`reset_lora_parameters(model)` (initializes A, B, magnitudes; quantizes NF4 bases) -> optionally load adapter state.
On a model with real weights `apply_lora` does the reset itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mtune.config.errors import ConfigError
from mtune.config.keys import LORA_TARGETS
from mtune.modules.expert_linear import ExpertLinear, LoRAExpertLinear
from mtune.modules.fp8_linear import fp8_linear, is_fp8_stored, quantize_fp8_weight_, stored_weight
from mtune.modules.nf4_linear import FrozenNF4Linear, dequantize, is_nf4, linear_maybe_nf4, quantize_nf4

__all__ = ["LoRALinear", "adapters_disabled", "apply_lora", "freeze_base", "reset_lora_parameters", "merge_adapter",
           "is_adapter_param", "has_nf4_weight", "ADAPTER_PARAM_NAMES", "LORA_TARGETS"]

ADAPTER_PARAM_NAMES = ("lora_a.weight", "lora_b.weight", "magnitude")
"""Name suffixes of adapter parameters (LoRA A/B, DoRA magnitude): trainable, and absent from base checkpoints."""


def is_adapter_param(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter (and so is not in a base checkpoint)."""
    return name.endswith(ADAPTER_PARAM_NAMES)


class LoRALinear(nn.Linear):
    """A frozen linear layer (plain or NF4) plus a trainable LoRA / DoRA adapter.

    It is an nn.Linear, so model-wide code that initializes or inspects linear layers (`init_weights` after
    `to_empty`) still reaches its base weight; only the forward differs.

    State-dict keys: `weight`, `bias` (as nn.Linear, so base checkpoints load unchanged), `lora_a.weight`
    [rank, in], `lora_b.weight` [out, rank], and `magnitude` [out] for DoRA. Input [..., in] -> output [..., out]
    in the input's dtype. While ``adapters_enabled`` is false (:func:`adapters_disabled`) it is its base linear.
    """

    adapters_enabled = True

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_dora: bool = False,
        quantize_base: bool = False,
    ):
        nn.Module.__init__(self)  # not nn.Linear.__init__: the weight is adopted, not allocated
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.use_dora, self.quantize_base = use_dora, quantize_base
        # Keep the Parameter object itself, so a weight shared with another module stays shared.
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.weight.requires_grad_(False)
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_a = nn.Linear(in_features, rank, bias=False, **factory)
        self.lora_b = nn.Linear(rank, out_features, bias=False, **factory)
        self.magnitude = nn.Parameter(torch.empty(out_features, **factory)) if use_dora else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "LoRALinear":
        return cls(linear.weight, linear.bias, **kwargs)

    @staticmethod
    def adapter_initializers() -> list[tuple[str, Callable[[torch.Tensor], object]]]:
        """``(parameter name, fill)`` of the adapter matrices, in the order :meth:`reset_adapter` draws them from
        torch's RNG: A Kaiming-uniform (PEFT's default), B zeros. ``fill(t)`` fills a full-shape tensor in place."""
        return [("lora_a.weight", lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5))),
                ("lora_b.weight", nn.init.zeros_)]

    @staticmethod
    def row_norms(weight: torch.Tensor) -> torch.Tensor:
        """||W||_row in fp32 for a plain or NF4 weight [out, in]: the starting DoRA magnitude."""
        return torch.linalg.norm(dequantize(weight).float(), dim=1)

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A, B by :meth:`adapter_initializers`; quantizes the base if asked (NF4, or fp8 storage); magnitude =
        ||W||_row of the stored base."""
        for name, fill in self.adapter_initializers():
            fill(self.get_parameter(name))
        if self.quantize_base and not is_nf4(self.weight):
            self.weight = quantize_nf4(self.weight)
        quantize_fp8_weight_(self)
        if self.magnitude is not None:
            self.magnitude.copy_(self.row_norms(self.base_weight()))

    def base_weight(self) -> torch.Tensor:
        """The frozen base weight as a plain tensor in its original dtype (NF4 or fp8 storage dequantized)."""
        return dequantize(stored_weight(self))

    def _base_linear(self, x: torch.Tensor, frozen: tuple | None = None) -> torch.Tensor:
        if frozen is not None:
            return F.linear(x, frozen[0])
        if is_fp8_stored(self):
            return fp8_linear(x, self.weight, self.weight_scale)
        return linear_maybe_nf4(x, self.weight)

    def _weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        delta = self.lora_b.weight @ self.lora_a.weight
        return torch.linalg.norm(weight + self.scaling * delta.detach().to(weight.dtype), dim=1).detach()

    def forward(self, x: torch.Tensor, frozen: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> torch.Tensor:
        """``frozen``: the base ``(weight, bias)`` to use instead of the stored ones, already dequantized (the tiled
        MLP dequantizes once per pass, not once per tile)."""
        bias = self.bias if frozen is None else frozen[1]
        base = self._base_linear(x, frozen)
        if not self.adapters_enabled:
            return base if bias is None else base + bias
        x_drop = self.dropout(x)
        if self.magnitude is None:
            # base + s * A(x) B^T in one addmm (alpha=s): no [tokens, out] temporaries for the scaled update and the
            # sum, and no elementwise ops in backward. Not in place: selective checkpointing keeps the base matmul's
            # output to reuse in recomputation, and an in-place update would hand it back already updated.
            hidden = self.lora_a(x_drop)
            out = torch.addmm(base.view(-1, self.out_features), hidden.view(-1, self.rank), self.lora_b.weight.t(),
                              alpha=self.scaling).view(base.shape)
            return out if bias is None else out + bias
        # DoRA
        lora = self.lora_b(self.lora_a(x_drop)) * self.scaling
        weight = self.base_weight() if frozen is None else frozen[0]
        scale = self.magnitude / self._weight_norm(weight.to(x.dtype))
        # With active dropout PEFT rescales the base output of the dropped input (x_drop), not x.
        base_drop = (base if isinstance(self.dropout, nn.Identity) or not self.training
                     else self._base_linear(x_drop, frozen))
        out = base + (scale - 1) * base_drop + scale * lora
        return out if bias is None else out + bias

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This layer's base weight with the adapter folded in (:func:`merge_adapter`), in the base dtype."""
        return merge_adapter(self.base_weight(), self.lora_a.weight, self.lora_b.weight, self.scaling,
                             self.magnitude)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, dora={self.use_dora}, nf4={is_nf4(self.weight)}"
        )


def has_nf4_weight(module: nn.Module) -> bool:
    """Whether ``module.weight`` is stored as NF4 once loaded: a `FrozenNF4Linear`, or a QLoRA `LoRALinear`."""
    return (isinstance(module, FrozenNF4Linear) or (isinstance(module, LoRALinear) and module.quantize_base)
            or (isinstance(module, ExpertLinear) and module.nf4))


@torch.no_grad()
def merge_adapter(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    magnitude: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The merged weight [out, in]: W + s B A (LoRA) or m * (W + s B A) / ||W + s B A||_row (DoRA, PEFT's merge).

    Computed in fp32 on ``weight``'s device and returned in ``dtype`` (default: ``weight``'s dtype). ``lora_a`` is
    [rank, in], ``lora_b`` [out, rank], ``magnitude`` [out]; they may live on another device.
    """
    device = weight.device
    merged = weight.float() + scaling * (lora_b.to(device).float() @ lora_a.to(device).float())
    if magnitude is not None:
        merged = merged * (magnitude.to(device).float() / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
    return merged.to(dtype or weight.dtype)


def _is_tied_lm_head(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    return head is not None and embed is not None and head.weight is embed.weight


def apply_lora(
    model: nn.Module,
    modules: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> nn.Module:
    """Swaps every nn.Linear whose last name is in `modules` (HF names, e.g. "q_proj", "lm_head") for a LoRALinear,
    in place, then freezes everything but the adapters (`freeze_base`). Returns the model.

    `quantize_base=True` also stores every other frozen nn.Linear inside `model.layers` as NF4 (the lm_head stays
    in the model dtype unless targeted, and so do the linears a module lists in its `kept_in_model_dtype`). On a meta-device model nothing is initialized: call
    `reset_lora_parameters(model)` once real base weights are loaded.
    """
    modules = set(modules)
    unknown = modules - set(LORA_TARGETS)
    if unknown:
        raise ConfigError(f"lora.modules has unknown names {sorted(unknown)}: choose from {list(LORA_TARGETS)}")
    if "lm_head" in modules and _is_tied_lm_head(model):
        raise ConfigError(
            "lora.modules contains lm_head but this model ties lm_head to embed_tokens: remove lm_head from lora.modules"
        )
    kwargs = dict(rank=rank, alpha=alpha, dropout=dropout, use_dora=use_dora, quantize_base=quantize_base)
    projections = {name for parent in model.modules() if not isinstance(parent, LoRALinear)
                   for name, child in parent.named_children() if type(child) in (nn.Linear, ExpertLinear)}
    if modules - projections:  # names of another family's projections (qkv_proj on a Llama) would adapt nothing
        family = getattr(getattr(model, "args", None), "family", None) or type(model).__name__
        raise ConfigError(f"lora.modules {sorted(modules - projections)} match no projection of this {family} model: "
                          f"it has {sorted(projections)}")
    found = set()
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, LoRALinear):  # its own lora_a / lora_b are not targets
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is ExpertLinear:  # every expert's copy of a projection: per-expert adapters
                child.nf4 = quantize_base
                if child_name in modules:
                    setattr(parent, child_name, LoRAExpertLinear(child, **kwargs))
                    found.add(child_name)
                continue
            if type(child) is not nn.Linear:
                continue
            if child_name in modules:
                setattr(parent, child_name, LoRALinear.from_linear(child, **kwargs))
                found.add(child_name)
            elif (quantize_base and parent_name.startswith("layers.")
                  and child_name not in getattr(parent, "kept_in_model_dtype", ())):
                setattr(parent, child_name, FrozenNF4Linear.from_linear(child))
    if not found:
        raise ConfigError(f"lora.modules {sorted(modules)} matched no projection in the model")
    freeze_base(model)
    if not any(p.is_meta for p in model.parameters()):
        reset_lora_parameters(model)
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every `LoRALinear` of ``model`` computes its base linear only (no adapter, no dropout) inside the block: the
    model the adapters started from, e.g. DPO's reference model, at no memory cost."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExpertLinear))]
    for layer in layers:
        layer.adapters_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_enabled = True


def reset_lora_parameters(model: nn.Module) -> None:
    """Initializes every adapter (A Kaiming, B zero, DoRA magnitude from the current base weight) and quantizes
    pending NF4 bases. Call after the base weights are loaded, before loading any saved adapter."""
    for module in model.modules():
        if isinstance(module, (LoRALinear, LoRAExpertLinear)):
            module.reset_adapter()
        elif isinstance(module, (FrozenNF4Linear, ExpertLinear)):
            module.quantize_()
        else:
            quantize_fp8_weight_(module)  # fp8 storage (no-op elsewhere)


def freeze_base(model: nn.Module) -> None:
    """requires_grad=False on every parameter except the LoRA A/B matrices and DoRA magnitudes."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(ADAPTER_PARAM_NAMES))
