"""The cross-key rules, all of them: each is `cfg -> list[str]` of one-line problems naming the keys and the fix.
A recipe attaches one tuple to its `RecipeSchema(groups, rules=...)` (`TRAINING_RULES`, `DISTRIBUTED_RULES`,
`MERGE_RULES`, `GENERATE_RULES`); `mtune validate` and `mtune run` run them, on the config with its defaults filled
in, before anything is built.

No torch import here: `mtune validate` reads this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtune.config.keys import LORA_TARGETS

__all__ = [
    "MEMORY_RULES",
    "TRAINING_RULES",
    "check_eval_dataset",
    "check_optimizer_values",
    "check_optimizer_in_bwd",
    "check_lora_node",
    "check_lora_on_tied_lm_head",
    "check_activation_offloading",
    "check_optimizer_offload",
    "check_weight_offloading",
    "check_weight_storage",
    "check_activation_checkpointing_policy",
    "DISTRIBUTED_RULES",
    "check_distributed_adapter_start",
    "check_distributed_optimizer",
    "check_distributed_backend",
    "check_distributed_offload",
    "check_distributed_weight_storage",
    "MERGE_RULES",
    "GENERATE_RULES",
]



def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def check_optimizer_in_bwd(cfg: Any) -> list[str]:
    """optimizer_in_bwd steps each parameter during backward, so nothing may need all gradients first."""
    if not _get(cfg, "optimizer_in_bwd", False):
        return []
    problems = []
    steps = _get(cfg, "gradient_accumulation_steps", 1)
    if steps > 1:
        problems.append(f"optimizer_in_bwd=true cannot be combined with gradient_accumulation_steps={steps}: "
                        "set gradient_accumulation_steps=1 or optimizer_in_bwd=false")
    clip = _get(cfg, "clip_grad_norm")
    if clip is not None:
        problems.append(f"optimizer_in_bwd=true cannot be combined with clip_grad_norm={clip} (clipping needs every "
                        "gradient before the step): set clip_grad_norm=null or optimizer_in_bwd=false")
    if _get(cfg, "dtype") == "fp16":
        problems.append("optimizer_in_bwd=true cannot be combined with dtype=fp16 (loss scaling must see every "
                        "gradient to skip a step): set dtype=bf16 or dtype=fp32, or optimizer_in_bwd=false")
    return problems


def check_lora_node(cfg: Any) -> list[str]:
    """The lora node's values; and QLoRA needs adapters (a full fine-tune cannot train NF4 weights)."""
    problems = []
    if _get(cfg, "quantize_base") is not None or _get(cfg, "model.quantize_base") is not None:
        problems.append("quantize_base belongs in the lora node: use lora.quantize_base=true (QLoRA); a full "
                        "fine-tune cannot train NF4 weights")
    lora = _get(cfg, "lora")
    if lora is None:
        return problems
    if not _get(cfg, "lora.modules"):
        if _get(cfg, "lora.quantize_base", False):
            problems.append("lora.quantize_base=true without lora.modules: NF4 base weights are frozen, so a full "
                            "fine-tune cannot use them: set lora.modules (QLoRA) or remove lora.quantize_base")
        else:
            problems.append("lora.modules is empty: list the layers to adapt, e.g. lora.modules=[q_proj,v_proj]")
    unknown = sorted(set(_get(cfg, "lora.modules", [])) - set(LORA_TARGETS))
    if unknown:
        problems.append(f"lora.modules has unknown names {unknown}: choose from {list(LORA_TARGETS)}")
    return problems


def _ties_embeddings(cfg: Any) -> bool | None:
    explicit = _get(cfg, "model.tie_embeddings")
    if explicit is not None:
        return bool(explicit)
    checkpoint_dir = _get(cfg, "model.checkpoint_dir")
    if checkpoint_dir is None:
        return None
    config_file = Path(str(checkpoint_dir)) / "config.json"
    if not config_file.is_file():
        return None  # another rule reports a missing checkpoint
    # Llama, Qwen2 and Mistral configs all default to untied when the field is absent.
    return bool(json.loads(config_file.read_text()).get("tie_word_embeddings", False))


def check_lora_on_tied_lm_head(cfg: Any) -> list[str]:
    """A tied lm_head shares its weight with embed_tokens; an adapter (or NF4) on one would change the other."""
    if "lm_head" not in (_get(cfg, "lora.modules") or []) or not _ties_embeddings(cfg):
        return []
    return ["lora.modules contains lm_head but the model ties lm_head to embed_tokens (tie_word_embeddings): "
            "remove lm_head from lora.modules"]


def check_activation_offloading(cfg: Any) -> list[str]:
    """mtune offloads the inputs that checkpointed blocks keep; without checkpointing it would copy every saved
    activation of every layer over PCIe each step, which makes training transfer-bound."""
    if _get(cfg, "enable_activation_offloading", False) and not _get(cfg, "enable_activation_checkpointing", False):
        return ["enable_activation_offloading=true needs enable_activation_checkpointing=true (offloading moves what "
                "checkpointed blocks keep; alone it would copy every activation over PCIe): set "
                "enable_activation_checkpointing=true or enable_activation_offloading=false"]
    return []


# ---- optimizer-state offload and weight group offloading ---------------------------------------------
OPTIMIZER_OFFLOAD_OPTIMIZERS = ("torch.optim.AdamW",)
"""The optimizers ``optimizer_offload=cpu`` steps on the host: those with a vectorised (foreach / fused) CPU step
whose state is plain tensors shaped like the parameters."""


def check_optimizer_offload(cfg: Any) -> list[str]:
    """optimizer_offload=cpu moves each gradient to the host as backward produces it and steps there: the optimizer
    must have a CPU step, and nothing may step on the device or need the gradients where they were."""
    target = _get(cfg, "optimizer_offload")
    if target is None:
        return []
    problems = []
    component = str(_get(cfg, "optimizer._component_", ""))
    if component not in OPTIMIZER_OFFLOAD_OPTIMIZERS:
        problems.append(f"optimizer_offload={target} cannot be combined with optimizer._component_={component}: "
                        f"offloading steps on the host with {', '.join(OPTIMIZER_OFFLOAD_OPTIMIZERS)} (foreach / "
                        "fused CPU step); set optimizer._component_=torch.optim.AdamW or optimizer_offload=null")
    if _get(cfg, "optimizer_in_bwd", False):
        problems.append(f"optimizer_offload={target} cannot be combined with optimizer_in_bwd=true (both take over "
                        "the optimizer step): set optimizer_in_bwd=false or optimizer_offload=null")
    if _get(cfg, "dtype") == "fp16":
        problems.append(f"optimizer_offload={target} cannot be combined with dtype=fp16 (loss scaling checks the "
                        "gradients on the device, which offloading has already moved): set dtype=bf16 or "
                        "dtype=fp32, or optimizer_offload=null")
    return problems


def check_weight_offloading(cfg: Any) -> list[str]:
    """weight_offloading keeps frozen weights in host memory: a run must have some (the base of LoRA), and
    torch.compile is not run over blocks whose weights come and go."""
    if _get(cfg, "weight_offloading") is None:
        return []
    problems = []
    if _get(cfg, "lora") is None:
        problems.append("weight_offloading is set but every weight is trained (no lora node): it offloads frozen "
                        "weights only; fine-tune with LoRA (lora.modules) or set weight_offloading=null (for "
                        "optimizer states, optimizer_offload=cpu)")
    if _get(cfg, "compile", False):
        problems.append("weight_offloading cannot be combined with compile=true (compiled blocks would capture "
                        "weights that are freed between uses): set compile=false or weight_offloading=null")
    return problems
# ---------------------------------------------------------------------------------------------------------------
# ---- fp8 weight storage and op-level selective checkpointing ---------------------------------------------
def check_weight_storage(cfg: Any) -> list[str]:
    """fp8 storage is for frozen weights: it needs adapters to train (a full fine-tune updates every weight, and an
    fp8 copy cannot take small updates), and it is one storage choice, so not together with NF4."""
    dtype = _get(cfg, "weight_storage_dtype")
    patterns = _get(cfg, "weight_storage_skip_patterns", [])
    problems = [f"weight_storage_skip_patterns: each entry must be a string glob such as 'model.layers.0.*', got "
                f"{p!r}" for p in patterns if not isinstance(p, str)]
    if dtype is None:
        return problems
    if _get(cfg, "lora") is None:
        problems.append(f"weight_storage_dtype={dtype} stores frozen weights, but this config has no lora node (a full "
                        "fine-tune trains every weight): add a lora node (a LoRA recipe), or set "
                        "weight_storage_dtype=null")
    elif _get(cfg, "lora.quantize_base", False):
        problems.append(f"weight_storage_dtype={dtype} cannot be combined with lora.quantize_base=true (the base "
                        "weights are stored either as fp8 or as NF4): set one of weight_storage_dtype=null or "
                        "lora.quantize_base=false")
    return problems


def check_activation_checkpointing_policy(cfg: Any) -> list[str]:
    """A policy says how checkpointed blocks recompute; it needs checkpointing to be on."""
    policy = _get(cfg, "activation_checkpointing_policy", "block")
    if policy != "block" and not _get(cfg, "enable_activation_checkpointing", False):
        return [f"activation_checkpointing_policy={policy} needs enable_activation_checkpointing=true (the policy "
                "chooses what checkpointed blocks keep): set enable_activation_checkpointing=true or "
                "activation_checkpointing_policy=block"]
    return []
# -------------------------------------------------------------------------------------------------------------------


MEMORY_RULES = (
    check_optimizer_in_bwd,
    check_lora_node,
    check_lora_on_tied_lm_head,
    check_activation_offloading,
    check_optimizer_offload,
    check_weight_offloading,
    check_weight_storage,
    check_activation_checkpointing_policy,
)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_optimizer_values(cfg: Any) -> list[str]:
    """The optimizer's numbers, whatever its component: lr and weight_decay numbers >= 0, eps > 0, betas two
    numbers in [0, 1); and a schedule's num_warmup_steps an integer >= 0."""
    problems = []
    for name, ok, what in (("lr", lambda v: v >= 0, ">= 0"), ("weight_decay", lambda v: v >= 0, ">= 0"),
                           ("eps", lambda v: v > 0, "> 0")):
        value = _get(cfg, f"optimizer.{name}")
        if value is None:
            continue
        if not _number(value):
            problems.append(f"optimizer.{name}: expected a number, got {type(value).__name__} {value!r}")
        elif not ok(value):
            problems.append(f"optimizer.{name}: must be {what}, got {value!r}")
    betas = _get(cfg, "optimizer.betas")
    if betas is not None and not (len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
        problems.append(f"optimizer.betas: must be two numbers in [0, 1), e.g. [0.9, 0.999], got {list(betas)!r}")
    warmup = _get(cfg, "lr_scheduler.num_warmup_steps")
    if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
        problems.append(f"lr_scheduler.num_warmup_steps: must be an integer >= 0, got {warmup!r}")
    return problems


def check_eval_dataset(cfg: Any) -> list[str]:
    """eval_every_n_steps needs a held-out set (dataset_val) to compute val_loss on."""
    if _get(cfg, "eval_every_n_steps") is not None and _get(cfg, "dataset_val") is None:
        return ["eval_every_n_steps is set but dataset_val is not: add a dataset_val node or set eval_every_n_steps=null"]
    return []


TRAINING_RULES = MEMORY_RULES + (check_optimizer_values, check_eval_dataset)
"""Every rule a single-device training recipe attaches to its `RecipeSchema`."""


# ------------------------------------------------------------------------------------------------ distributed
# Measured with torch 2.13 + FSDP2 on 2 gloo processes (docs/distributed.md, benchmarks/fsdp2_support_matrix.py).
# Works and needs no rule: NF4 (QLoRA) bases, DoRA, activation checkpointing, optimizer_in_bwd, CPU offload,
# torch.optim.AdamW and torchao.optim.AdamW8bit.
_DISTRIBUTED_BACKENDS = ("nccl", "gloo")


def check_distributed_optimizer(cfg: Any) -> list[str]:
    """Optimizers that cannot step FSDP2's sharded (DTensor) parameters."""
    component = str(_get(cfg, "optimizer._component_", ""))
    if component.startswith("bitsandbytes."):
        return [f"optimizer._component_={component} cannot step FSDP2's sharded parameters (its kernels get mixed "
                "torch.Tensor and DTensor arguments): use torchao.optim.AdamW8bit for 8-bit states, or "
                "torch.optim.AdamW"]
    if component == "torchao.optim.AdamW4bit":
        return ["optimizer._component_=torchao.optim.AdamW4bit fails on FSDP2's sharded parameters (its compiled "
                "4-bit kernel rejects the DTensor shards): use torchao.optim.AdamW8bit or torch.optim.AdamW"]
    return []


def check_distributed_backend(cfg: Any) -> list[str]:
    backend = _get(cfg, "distributed_backend")
    if backend is not None and backend not in _DISTRIBUTED_BACKENDS:
        return [f"distributed_backend={backend!r} is not supported: use null (nccl on GPUs, gloo on CPU), nccl or gloo"]
    return []


def check_distributed_offload(cfg: Any) -> list[str]:
    """optimizer_offload and weight_offloading are single-device techniques; FSDP2 has its own CPU offload."""
    problems = []
    for key, value in (("optimizer_offload", _get(cfg, "optimizer_offload")),
                       ("weight_offloading", _get(cfg, "weight_offloading"))):
        if value is not None:
            problems.append(f"{key} is a single-device technique: the distributed recipes offload parameters, "
                            f"gradients and optimizer states with fsdp_cpu_offload=true; set {key}=null")
    return problems


def check_distributed_weight_storage(cfg: Any) -> list[str]:
    """fp8 weight storage keeps a per-row scale beside each weight; FSDP2 sharding and sharded loading do not
    handle it yet."""
    dtype = _get(cfg, "weight_storage_dtype")
    if dtype is not None:
        return [f"weight_storage_dtype={dtype} is not supported by the distributed recipes yet (FSDP2 shards the "
                "weights but not their fp8 scales): set weight_storage_dtype=null (lora.quantize_base=true gives "
                "4-bit bases that FSDP2 shards), or train on one device"]
    return []


def check_distributed_adapter_start(cfg: Any) -> list[str]:
    if _get(cfg, "lora.adapter_dir") is not None:
        return ["lora.adapter_dir is not supported by the distributed recipes yet: start from the adapter with "
                "lora_single_device, or resume a distributed run with resume_from_checkpoint"]
    return []


DISTRIBUTED_RULES = TRAINING_RULES + (check_distributed_optimizer, check_distributed_backend,
                                      check_distributed_adapter_start, check_distributed_offload,
                                      check_distributed_weight_storage)
"""Every rule a distributed training recipe attaches to its `RecipeSchema`."""


# ------------------------------------------------------------------------------------------------ merge_lora
def check_merge_base(cfg: Any) -> list[str]:
    """base_model_dir and model.checkpoint_dir name the same thing; one of them at most."""
    model = cfg.get("model") or {}
    if cfg.get("base_model_dir") and model.get("checkpoint_dir") and cfg.base_model_dir != model.checkpoint_dir:
        return ["base_model_dir and model.checkpoint_dir differ: set only one of them (the adapter's base model)"]
    return []


MERGE_RULES = (check_merge_base,)
"""The rules the merge_lora recipe attaches to its `RecipeSchema`."""


# ------------------------------------------------------------------------------------------------ generate
def check_generate_input(cfg: Any) -> list[str]:
    """Exactly one of prompt / messages; messages are {role, content} mappings."""
    prompt, messages = cfg.get("prompt"), cfg.get("messages")
    if (prompt is None) == (messages is None):
        return ["set exactly one of prompt (plain text) or messages (a list of {role, content})"]
    for i, message in enumerate(messages or []):
        if not hasattr(message, "keys") or set(message.keys()) != {"role", "content"}:
            return [f"messages.{i}: each message is a mapping with exactly the keys role and content"]
    return []


GENERATE_RULES = (check_generate_input,)
"""The rules the generate recipe attaches to its `RecipeSchema`."""
