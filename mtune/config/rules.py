"""The cross-key rules of the keys declared in `mtune.config.keys`: each is `cfg -> list[str]` of one-line problems
naming the keys and the fix. The memory techniques' rules live with each technique
(`mtune.training.memory.techniques`) and are collected by `mtune.training.memory.registry`. A recipe attaches its
rules to its `RecipeSchema(groups, rules=...)` (``RUN_RULES + MEMORY_RULES``, ``DISTRIBUTED_RUN_RULES +
DISTRIBUTED_MEMORY_RULES``, `MERGE_RULES`, `GENERATE_RULES`); `mtune validate` and `mtune run` run them, on the
config with its defaults filled in, before anything is built.

No torch import here: `mtune validate` reads this module.
"""

from __future__ import annotations

from typing import Any

from mtune.config.keys import reference_choice, run_kind
from mtune.units import SizeError, parse_budget

__all__ = [
    "RUN_RULES",
    "check_eval_dataset",
    "check_optimizer_values",
    "check_optimizer_step",
    "check_loss_contract",
    "check_device_memory_limit",
    "DISTRIBUTED_RUN_RULES",
    "check_distributed_backend",
    "MERGE_RULES",
    "GENERATE_RULES",
    "PREFERENCE_RULES",
    "FULL_PREFERENCE_RULES",
    "check_preference_loss",
    "check_full_reference",
    "check_reference_storage",
    "check_reference_cache",
]


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return default
        node = node[part]
    return default if node is None else node


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


def _component(cfg: Any, node: str) -> Any:
    """The object ``node._component_`` names, or None (no node, or a path that does not import: the schema's
    component check names that)."""
    from mtune.config.errors import ConfigError
    from mtune.config.instantiate import resolve_component

    path = _get(cfg, f"{node}._component_")
    try:
        return resolve_component(path, f"{node}._component_") if isinstance(path, str) else None
    except (ConfigError, ImportError):
        return None


def check_loss_contract(cfg: Any) -> list[str]:
    """The loss is one the training loop can call: an mtune token loss (``loss_fn(logits or hidden, labels,
    lm_head) -> (summed loss, tokens)``, its ``needs_hidden`` saying which it takes) or a preference loss. A loss
    such as ``torch.nn.CrossEntropyLoss`` would fail inside the first step."""
    import inspect

    target = _component(cfg, "loss")
    if not inspect.isclass(target) or hasattr(target, "needs_hidden") or target.__name__ in PREFERENCE_LOSSES:
        return []  # a function may build any loss: only what it returns tells
    return [f"loss: {target.__module__}.{target.__qualname__} is not a loss mtune's training loop can call (it calls "
            "loss_fn(logits or hidden states, labels, lm_head) for (summed loss, token count)): use "
            "mtune.modules.loss.ChunkedCrossEntropyLoss or CrossEntropyLoss, or a class of your own with their "
            "forward and needs_hidden"]


def check_optimizer_step(cfg: Any) -> list[str]:
    """The optimizer steps once per optimizer step with no arguments; one whose ``step`` needs a closure
    (``torch.optim.LBFGS``, which evaluates the loss several times a step) would fail in the first step."""
    import inspect

    target = _component(cfg, "optimizer")
    step = getattr(target, "step", None) if inspect.isclass(target) else None
    try:
        parameters = list(inspect.signature(step).parameters.values())[1:] if callable(step) else []
    except (TypeError, ValueError):
        return []
    needed = [p.name for p in parameters if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if needed:
        return [f"optimizer: {target.__module__}.{target.__qualname__}.step needs {', '.join(needed)}: mtune's training "
                "loop calls optimizer.step() once per step with no arguments; choose an optimizer that steps so "
                "(torch.optim.AdamW, SGD, bitsandbytes' 8-bit AdamW, ...)"]
    return []


def check_device_memory_limit(cfg: Any) -> list[str]:
    """device_memory_limit is a size of at least 1 MiB (20GiB, 512MiB, or an int of bytes)."""
    limit = _get(cfg, "device_memory_limit")
    if limit is None:
        return []
    try:
        parse_budget(limit, "device_memory_limit")
    except SizeError as err:
        return [f"{err} (null: the whole device)"]
    return []


RUN_RULES = (check_optimizer_values, check_optimizer_step, check_loss_contract, check_eval_dataset,
             check_device_memory_limit)
"""The rules of the keys every training recipe reads besides the memory techniques' (whose rules are
`mtune.training.memory.registry.MEMORY_RULES`); a recipe attaches both to its `RecipeSchema`."""


_DISTRIBUTED_BACKENDS = ("nccl", "gloo")


def check_distributed_backend(cfg: Any) -> list[str]:
    backend = _get(cfg, "distributed_backend")
    if backend is not None and backend not in _DISTRIBUTED_BACKENDS:
        return [f"distributed_backend={backend!r} is not supported: use null (nccl on GPUs, gloo on CPU), nccl or gloo"]
    return []


DISTRIBUTED_RUN_RULES = RUN_RULES + (check_distributed_backend,)
"""`RUN_RULES` and the distributed keys' own; the techniques' FSDP2 rules are
`mtune.training.memory.registry.DISTRIBUTED_MEMORY_RULES`."""


PREFERENCE_LOSSES = ("DPOLoss", "IPOLoss", "SimPOLoss")


def check_preference_loss(cfg: Any) -> list[str]:
    """A preference recipe trains with a preference loss."""
    loss = str(_get(cfg, "loss._component_", ""))
    if loss.rsplit(".", 1)[-1] not in PREFERENCE_LOSSES:
        return [f"loss: a preference recipe needs a preference loss, got {loss or 'none'!r}: set "
                "loss._component_=mtune.modules.preference_loss.DPOLoss (or IPOLoss, SimPOLoss)"]
    return []


def check_full_reference(cfg: Any) -> list[str]:
    """A full fine-tune has no adapters to disable."""
    if _get(cfg, "reference") == "adapters_off":
        return ["reference=adapters_off needs LoRA adapters to disable: use reference=precomputed or reference=copy "
                "for a full fine-tune"]
    return []


def check_reference_storage(cfg: Any) -> list[str]:
    """fp8 storage is of a reference copy, on one device (FSDP2 does not shard the fp8 scales)."""
    storage = _get(cfg, "reference_storage_dtype")
    if storage is None:
        return []
    if _get(cfg, "reference") != "copy":
        return [f"reference_storage_dtype={storage} stores a reference copy, but reference is "
                f"{_get(cfg, 'reference')}: set reference=copy, or reference_storage_dtype=null"]
    if run_kind(cfg) == "distributed":
        return [f"reference_storage_dtype={storage} is not supported by the distributed recipes yet (FSDP2 shards "
                "the weights but not their fp8 scales): set reference_storage_dtype=null"]
    return []


def check_reference_cache(cfg: Any) -> list[str]:
    """A cache directory is of precomputed reference log-probs (the reference another choice would silently drop)."""
    cache, kind = _get(cfg, "reference_cache_dir"), reference_choice(cfg, adapters=_get(cfg, "lora") is not None)
    if cache is not None and kind != "precomputed":
        return [f"reference_cache_dir={cache} holds precomputed reference log-probs, but reference is {kind}: set "
                "reference=precomputed, or reference_cache_dir=null"]
    return []


PREFERENCE_RULES = (check_preference_loss, check_reference_storage, check_reference_cache)
"""The rules the LoRA preference (DPO) recipes add to their run's."""
FULL_PREFERENCE_RULES = PREFERENCE_RULES + (check_full_reference,)
"""The rules the full preference recipes add to their run's."""


def check_merge_base(cfg: Any) -> list[str]:
    """base_model_dir and model.checkpoint_dir name the same thing; one of them at most."""
    model = cfg.get("model") or {}
    if cfg.get("base_model_dir") and model.get("checkpoint_dir") and cfg.base_model_dir != model.checkpoint_dir:
        return ["base_model_dir and model.checkpoint_dir differ: set only one of them (the adapter's base model)"]
    return []


MERGE_RULES = (check_merge_base,)
"""The rules the merge_lora recipe attaches to its `RecipeSchema`."""


def check_generate_input(cfg: Any) -> list[str]:
    """Exactly one of prompt / messages; messages are {role, content} mappings; top_k / top_p only with sampling
    (temperature > 0)."""
    prompt, messages = cfg.get("prompt"), cfg.get("messages")
    if (prompt is None) == (messages is None):
        return ["set exactly one of prompt (plain text) or messages (a list of {role, content})"]
    for i, message in enumerate(messages or []):
        if not hasattr(message, "keys") or set(message.keys()) != {"role", "content"}:
            return [f"messages.{i}: each message is a mapping with exactly the keys role and content"]
    filters = [f"{key}={cfg.get(key)}" for key in ("top_k", "top_p") if cfg.get(key) is not None]
    if filters and not (cfg.get("temperature") or 0) > 0:  # greedy decoding takes the top token: they would not act
        return [f"{' and '.join(filters)} filter sampling, but temperature={cfg.get('temperature')} decodes greedily: "
                "set temperature > 0 (e.g. 0.8) to sample, or drop them"]
    return []


GENERATE_RULES = (check_generate_input,)
"""The rules the generate recipe attaches to its `RecipeSchema`."""
