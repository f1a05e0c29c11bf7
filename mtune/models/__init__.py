"""Model families: one arguments dataclass and a table of named sizes each; :func:`build_model` builds any of them.

Family names are those of the config folders (``llama2``, ``llama3``, ``llama3_1``, ``llama3_2``, ``llama3_3``,
``qwen2``, ``qwen2_5``, ``qwen3``, ``qwen3_moe``, ``qwen3_5``, ``mistral``, ``phi4``, ``gemma3``, ``gemma4``,
``gpt_oss``, and
``tiny``, which is Llama 3.1's tiny size).
"""

from dataclasses import replace

import torch

from mtune.config.errors import ConfigError
from mtune.models.gemma3 import GEMMA3_SIZES, Gemma3Args
from mtune.models.gemma4 import GEMMA4_SIZES, Gemma4Args
from mtune.models.gpt_oss import GPT_OSS_SIZES, GptOssArgs
from mtune.models.llama2 import LLAMA2_SIZES, Llama2Args
from mtune.models.llama3 import LLAMA3_1_SIZES, LLAMA3_2_SIZES, LLAMA3_3_SIZES, LLAMA3_SIZES, Llama3Args
from mtune.models.mistral import MISTRAL_SIZES, MistralArgs
from mtune.models.phi4 import PHI4_SIZES, Phi4Args
from mtune.models.qwen2 import QWEN2_5_SIZES, QWEN2_SIZES, Qwen2Args
from mtune.models.qwen3 import QWEN3_SIZES, Qwen3Args
from mtune.models.qwen3_5 import QWEN3_5_SIZES, Qwen3_5Args
from mtune.models.qwen3_moe import QWEN3_MOE_SIZES, Qwen3MoeArgs
from mtune.modules.transformer import DecoderArgs, TransformerDecoder

# family name -> (arguments dataclass, sizes)
FAMILIES: dict[str, tuple[type[DecoderArgs], dict[str, dict]]] = {
    "llama2": (Llama2Args, LLAMA2_SIZES),
    "llama3": (Llama3Args, LLAMA3_SIZES),
    "llama3_1": (Llama3Args, LLAMA3_1_SIZES),
    "llama3_2": (Llama3Args, LLAMA3_2_SIZES),
    "llama3_3": (Llama3Args, LLAMA3_3_SIZES),
    "qwen2": (Qwen2Args, QWEN2_SIZES),
    "qwen2_5": (Qwen2Args, QWEN2_5_SIZES),
    "qwen3": (Qwen3Args, QWEN3_SIZES),
    "qwen3_moe": (Qwen3MoeArgs, QWEN3_MOE_SIZES),
    "qwen3_5": (Qwen3_5Args, QWEN3_5_SIZES),
    "mistral": (MistralArgs, MISTRAL_SIZES),
    "phi4": (Phi4Args, PHI4_SIZES),
    "gemma3": (Gemma3Args, GEMMA3_SIZES),
    "gemma4": (Gemma4Args, GEMMA4_SIZES),
    "gpt_oss": (GptOssArgs, GPT_OSS_SIZES),
    "tiny": (Llama3Args, {"tiny": LLAMA3_1_SIZES["tiny"]}),
}

def model_args(family: str, size: str = "tiny", **overrides) -> DecoderArgs:
    """The arguments of a named size, e.g. ``model_args("llama3_1", "8B")``; ``overrides`` replace fields."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    args_cls, sizes = FAMILIES[family]
    if size not in sizes:
        raise ConfigError(f"unknown size {size!r} for family {family!r}; choose one of {list(sizes)}")
    return args_cls(**{**sizes[size], **overrides})


def build_model_from_args(
    args: DecoderArgs, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> TransformerDecoder:
    """Build a decoder on the meta device; with ``device``, materialise it there and initialise it randomly."""
    with torch.device("meta"):
        model = (args.decoder or TransformerDecoder)(args)
    if dtype is not None:
        model.to(dtype)
    if device is not None and torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def build_model(
    family: str, size: str = "tiny", device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    **overrides,
) -> TransformerDecoder:
    """Build ``family``/``size`` (on meta unless ``device`` is given; then with random weights from torch's RNG)."""
    return build_model_from_args(model_args(family, size, **overrides), device=device, dtype=dtype)


__all__ = ["FAMILIES", "model_args", "build_model", "build_model_from_args", "DecoderArgs"]


def shortened(args, n_layers: int):
    """``args`` with its first ``n_layers`` blocks: a per-layer list (``layer_types``: Gemma 3's, Qwen3.5's) cut to
    match, and Gemma 4's KV-sharing tail counted only where it falls among them."""
    changes = {"n_layers": n_layers}
    if types := getattr(args, "layer_types", None):
        changes["layer_types"] = list(types[:n_layers])
    if shared := getattr(args, "n_kv_shared_layers", 0):
        changes["n_kv_shared_layers"] = max(0, n_layers - (args.n_layers - shared))
    return replace(args, **changes)


def layer_period(args) -> int:
    """The fewest blocks whose ``layer_types`` repeat through the model (Qwen3.5's 3 DeltaNet + 1 attention: 4;
    Gemma 3's 5 sliding + 1 global: 6); 1 for a model of one kind. A plan shortened to whole periods keeps the
    model's mix of layers. A model whose last layers differ from the rest (Gemma 4's KV-sharing tail: no K/V
    projections, double-wide MLPs) has no shorter period than itself: it is planned whole."""
    if getattr(args, "n_kv_shared_layers", 0):
        return args.n_layers
    types = list(getattr(args, "layer_types", None) or [])
    return next((p for p in range(1, len(types)) if all(t == types[i % p] for i, t in enumerate(types))),
                max(1, len(types)))
